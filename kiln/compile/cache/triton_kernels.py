"""Triton's kernel cache inside kiln's cache root, and a count of the kernels Triton compiles.

Kernels launched outside Inductor (kiln's own GEMV, attention, norms, rotary) compile on
their first launch into Triton's cache dir, ~/.triton/cache unless TRITON_CACHE_DIR says
otherwise. kiln points Triton at <cache root>/triton instead, so that what a start compiled
travels with `kiln cache export` and an imported root has nothing left to compile. An
explicit TRITON_CACHE_DIR wins. Triton keys each kernel by its source, its own version and
the GPU target, so one directory serves every model and GPU.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger("kiln")

TRITON_DIR = "triton"

_start_up_done = False
_counts = {"compiled": 0, "compiled_in_workers": 0, "cache_hits": 0, "precompile_s": 0.0, "precompile_kernel_s": 0.0,
           "precompile_workers": 0, "precompile_launcher_s": 0.0, "precompile_kernels": []}
_listening = False


def use_cache_root(root: Path) -> Path | None:
    """Point Triton's kernel cache at `root`/triton (unless TRITON_CACHE_DIR is set) and start
    counting compiles; returns the directory in use, or None when the user's wins."""
    listen()
    if os.environ.get("TRITON_CACHE_DIR"):
        return None
    from triton import knobs

    from kiln.compile.cache.store import private_dir

    path = root / TRITON_DIR
    private_dir(path)
    knobs.cache.dir = str(path)
    return path


def listen() -> None:
    """Count every kernel Triton compiles or finds in its cache, from now on (in this process)."""
    global _listening
    if _listening:
        return
    try:
        from triton import knobs
    except ImportError:  # no Triton (a CPU-only install): nothing compiles
        return
    previous = knobs.compilation.listener

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        _counts["cache_hits" if cache_hit else "compiled"] += 1
        if not cache_hit and _start_up_done:
            # A compile after start-up stalls the step that launched it (~1 s): name it, so the
            # start-up warm-up can be made to cover it.
            fn = getattr(src, "fn", None)
            logger.warning("Triton compiled %s after start-up, while serving: the step that launched it waited "
                           "for the compile (its specialization: %s)", getattr(fn, "__name__", src),
                           str(getattr(src, "attrs", getattr(src, "constants", "")))[:300])
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

    knobs.compilation.listener = listener
    _listening = True


def start_up(done: bool) -> None:
    """Whether an engine's start-up is over: a compile after it is a kernel the warm-up missed,
    and is logged (an engine built later in the process starts its own start-up)."""
    global _start_up_done
    _start_up_done = done


def add_worker_compiles(done: dict) -> None:
    """Count what kiln.compile.triton_precompile's KernelCompiler compiled for this process."""
    _counts["compiled"] += done["compiled"]
    _counts["compiled_in_workers"] += done["compiled"]
    _counts["precompile_s"] += done["seconds"]
    _counts["precompile_kernel_s"] += done["kernel_seconds"]
    _counts["precompile_workers"] = max(_counts["precompile_workers"], done["workers"])
    _counts["precompile_launcher_s"] += done["launcher_seconds"]
    _counts["precompile_kernels"].extend(done["kernels"])


def counts() -> dict:
    """{"compiled": kernels Triton compiled for this process (in it, or in kiln's precompile
    workers: "compiled_in_workers" of them, taking "precompile_s", "precompile_kernel_s" summed
    over the kernels, "precompile_launcher_s" of it building C launchers, in up to
    "precompile_workers" processes; "precompile_kernels": (name, submitted, done) seconds after
    the compiler started, per kernel), "cache_hits": found in its cache}. Inductor's own
    compiles in its worker processes are not seen here."""
    return {k: list(v) if isinstance(v, list) else v for k, v in _counts.items()}
