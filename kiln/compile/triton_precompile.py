"""Compile the Triton kernels a start will launch in parallel processes, before it launches them.

A cold start on a fresh machine launches a few dozen specializations of kiln's own Triton
kernels (GEMV, attention, norms, rotary), and Triton compiles each on its first launch, one
after another: ~0.3-0.5 s each on the H200 host, 14 of a 15 s default start there
(benchmarks/results/fresh_start_cuda.json). Threads do not help (Triton holds the GIL for
most of a compile); processes do.

Inside `MissingKernels()`, a launch whose kernel is neither loaded nor in Triton's cache
dir is not compiled and not launched: its specialization is recorded instead (the outputs
of such a run are garbage; the caller runs it again for real afterwards). `compile_all`
then compiles what was recorded in worker processes (kiln.compile.triton_worker) into the
cache dir, where the real launches find them. A warm cache records nothing, and costs the
caller one recorded run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kiln.compile import triton_worker

logger = logging.getLogger("kiln")

WORKER = Path(triton_worker.__file__)
MAX_WORKERS = 16


@dataclass(frozen=True)
class KernelLaunch:
    """What a worker needs to compile one specialization of a @triton.jit function."""

    module: str
    file: str
    name: str
    specialization: str  # Triton's JSON: signature, constexprs, attributes, options

    def job(self) -> str:
        return json.dumps({"module": self.module, "file": self.file, "name": self.name,
                           "specialization": self.specialization})


def triton_target():
    """The current GPU's Triton target (backend, arch, warp size). Starting Triton's driver
    (which builds its C utilities on a fresh machine) and hashing Triton's own sources (part
    of every cache key) happen here once, so that a caller can run this in the background."""
    from triton.runtime import driver
    from triton.runtime.cache import triton_key

    triton_key()
    return driver.active.get_current_target()


def in_cache(fn, specialization: str, target) -> bool:
    """Whether Triton's cache dir already holds this specialization for `target` (the lookup
    triton.compile makes before it compiles)."""
    import hashlib

    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import get_cache_key, get_cache_manager
    from triton.runtime.jit import get_cache_invalidating_env_vars

    src, options = triton_worker.source_and_options(fn, specialization)
    backend = make_backend(target)
    parsed = backend.parse_options(dict(options, **src.parse_options()))
    key = get_cache_key(src, backend, parsed, get_cache_invalidating_env_vars())
    manager = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest())
    return manager.get_group(f"{src.name[:150]}.json") is not None


class MissingKernels(contextlib.AbstractContextManager):
    """Within: launches that would compile are skipped and recorded in `self.launches`.
    `target` is the GPU's Triton target (triton.runtime.driver.active.get_current_target())."""

    def __init__(self, target):
        self.target = target
        self.launches: dict[str, KernelLaunch] = {}
        self._previous = None

    def __enter__(self) -> MissingKernels:
        from triton import knobs

        self._previous = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._hook
        return self

    def __exit__(self, *exc) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook = self._previous

    def _hook(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled) -> bool:
        specialization = compile["specialization_data"]
        if specialization in self.launches:
            # Recorded kernels stay uncompiled, so each later launch of one (every layer, every
            # bucket) comes back here: skip the cache lookup, which hashes the kernel's source.
            return True
        jit = fn.jit_function
        if in_cache(jit, specialization, self.target):
            return False  # compiles as usual: a load from the cache dir
        self.launches[specialization] = KernelLaunch(fn.module, jit.fn.__code__.co_filename, jit.fn.__name__,
                                                     specialization)
        return True  # Triton neither compiles nor launches it


def compile_all(launches: list[KernelLaunch], target, cache_dir: str, workers: int | None = None) -> dict:
    """Compile `launches` in up to `workers` processes (default: one per CPU, at most
    MAX_WORKERS) into `cache_dir`; returns {"compiled", "failed", "launchers" (C launchers
    built too; none without a GPU driver), "workers", "seconds", "kernel_seconds" (summed)}.
    A kernel that fails here is logged and left to compile (and fail) at its launch."""
    start = time.perf_counter()
    workers = max(1, min(len(launches), workers or min(os.cpu_count() or 1, MAX_WORKERS)))
    todo = list(launches)
    lock = threading.Lock()
    results = {"compiled": 0, "failed": 0, "launchers": 0, "kernel_seconds": 0.0}
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir)
    header = json.dumps([target.backend, target.arch, target.warp_size]) + "\n"

    def feed() -> None:
        # One worker: take the next kernel, send it, wait for its answer, until none is left.
        proc = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env=env)
        try:
            proc.stdin.write(header)
            while True:
                with lock:
                    if not todo:
                        break
                    launch = todo.pop()
                proc.stdin.write(launch.job() + "\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
                answer = json.loads(line) if line else {"ok": False, "error": "the worker exited"}
                with lock:
                    results["compiled" if answer["ok"] else "failed"] += 1
                    results["launchers"] += int(answer.get("launcher", False))
                    results["kernel_seconds"] += answer.get("seconds", 0.0)
                if not answer["ok"]:
                    logger.warning("Triton worker could not compile %s: %s", launch.name, answer["error"])
                if not line:
                    break
        finally:
            proc.stdin.close()
            proc.wait()

    threads = [threading.Thread(target=feed, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {**results, "workers": workers, "seconds": time.perf_counter() - start}
