"""Once-per-process work that a warm start waits on, started early on a background thread.

Loading a piece artifact from the compile cache first imports much of Inductor (its codegen,
kernel templates, the AOTAutograd cache: hundreds of modules, each compiled from source where
an install has no .pyc files) and computes keys that torch caches for the life of the process:
Inductor's torch_key() (a hash of torch's source files, which every artifact load checks) and,
on CUDA, Triton's key and backend hash (a hash of Triton's sources, and the compiler version).

On the CPU it also runs Inductor's ISA probes (a subprocess each) inside the entry this start
most likely uses (kiln.compile.cache.entry.probe_isa_in), then loads that entry's pieces once
(load_pieces_in: Inductor keeps its precompiled-header check for the process). The
imports run with the garbage collector paused (kiln.compile.gc_pause). None of it depends on
the model's weights, so the engine starts it all before the weights load, and the warm
start joins it before it touches the cache (the wait is part of the timed warm start, so the
compile phase never looks shorter than what the start-up waited for). Only where a warm start
is likely: mode 3 with the compile cache on, and an entry of this model on this device type in
the cache. Nothing here changes a result: every call is a cached function torch would call on
first use anyway, and a failure only means the warm start does the work itself.

Where a cold CPU capture is certain instead, only its ISA probes start early (isa_probes_ahead_due,
kiln.compile.cache.entry.probe_isa_ahead): the rest it needs at once. A cold capture with compile
workers runs the imports and torch's key itself while the workers compile (prepare_loading). Not
on the thread before Dynamo: on an H200 that slowed the trace and the captures after it by more
than it saved (benchmarks/results/cold_preload_ab_h200/).
"""

from __future__ import annotations

import importlib
import json
import logging
import threading
import time
from pathlib import Path

import torch

from kiln.compile.cache import source_keys
from kiln.compile.cache.entry import MANIFEST, load_pieces_in, packaged, probe_isa_in
from kiln.compile.cache.model_cache import CompileCache
from kiln.compile.config import CompilationConfig
from kiln.compile.gc_pause import collector_paused
from kiln.compile.monitor import logger

# What an artifact load imports (torch 2.11-2.13), roots only: each pulls in the rest. A
# module missing from this torch is skipped.
COMMON_MODULES = (
    "torch._inductor.codecache",
    "torch._inductor.standalone_compile",
    "torch._functorch._aot_autograd.autograd_cache",
    "torch._inductor.compile_fx",
    "torch._inductor.output_code",
    "torch._inductor.async_compile",
    "torch._inductor.select_algorithm",  # kernel templates, jinja
    "torch._inductor.runtime.autotune_cache",
    "torch._inductor.hooks",
    "torch._inductor.codegen.memory_planning",
    "torch._functorch._aot_autograd.subclass_codegen",
    "torch.fx.experimental.validator",
)
DEVICE_MODULES = {
    "cpu": ("torch._inductor.codegen.cpp", "torch._inductor.cpu_vec_isa", "torch._inductor.cpp_builder",
            "torch.utils.cpp_extension"),
    "cuda": ("torch._inductor.codegen.triton", "torch._inductor.runtime.triton_heuristics",
             "torch._inductor.runtime.static_triton_launcher"),
}


class Preload:
    """The background thread and what it did: `parts` maps each step to its seconds."""

    def __init__(self, device: torch.device, root: Path | None, probe_entry: Path | None = None):
        self.device, self.root, self.probe_entry = device, root, probe_entry
        self.parts: dict[str, float] = {}
        self.errors: list[str] = []
        self.cuda_index = None
        if device.type == "cuda":
            # The thread's current device is its own: tell it this one's (a worker of a
            # tensor-parallel engine is on its rank's GPU, never on GPU 0 by default).
            self.cuda_index = device.index if device.index is not None else torch.cuda.current_device()
        self.thread = threading.Thread(target=self._run, name="kiln-compile-preload", daemon=True)
        self.waited = False

    def start(self) -> "Preload":
        self.thread.start()
        return self

    def wait(self) -> float:
        """Join the thread; the seconds this call waited."""
        start = time.perf_counter()
        self.thread.join()
        if not self.waited:
            self.waited = True
            logger.log(logging.INFO if self.errors else logging.DEBUG, "compile preload: %s%s",
                       ", ".join(f"{k} {v:.3f} s" for k, v in self.parts.items()),
                       f"; failed (the warm start does it): {'; '.join(self.errors)}" if self.errors else "")
        return time.perf_counter() - start

    def _step(self, name: str, fn) -> None:
        _timed_step(self.parts, self.errors, name, fn)

    def _run(self) -> None:
        _import_loading_path(self.device.type, self.root, self.parts, self.errors)
        if self.probe_entry is not None:
            self._step("isa_probe", lambda: probe_isa_in(self.probe_entry))
            self._step("pieces", lambda: load_pieces_in(self.probe_entry))
        if self.device.type == "cuda":
            self._step("triton_key", lambda: _triton_keys(self.cuda_index))


def prepare_loading(device_type: str, root: Path | None) -> dict[str, float]:
    """The preload's imports and torch's key, on this thread: what loading a first piece artifact
    would otherwise begin with (0.7-1.0 s on an H200 host). A cold capture calls it while its compile
    workers compile, where this thread would only wait. Its seconds per step; a failure only means
    the first load does the work itself."""
    parts: dict[str, float] = {}
    errors: list[str] = []
    _import_loading_path(device_type, root, parts, errors)
    logger.debug("artifact loading prepared: %s%s", ", ".join(f"{k} {v:.3f} s" for k, v in parts.items()),
                 f"; failed: {'; '.join(errors)}" if errors else "")
    return parts


def _import_loading_path(device_type: str, root: Path | None, parts: dict[str, float], errors: list[str]) -> None:
    with collector_paused():
        for module in COMMON_MODULES + DEVICE_MODULES.get(device_type, ()):
            _timed_step(parts, errors, "imports", lambda m=module: _import_if_present(m))
    _timed_step(parts, errors, "torch_key", lambda: source_keys.torch_key(root))


def _timed_step(parts: dict[str, float], errors: list[str], name: str, fn) -> None:
    start = time.perf_counter()
    try:
        fn()
    except Exception as e:  # another torch or triton: the load does it, or does without
        errors.append(f"{name}: {type(e).__name__}: {e}")
    parts[name] = parts.get(name, 0.0) + time.perf_counter() - start


def _import_if_present(name: str) -> None:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:  # the module is there but one of its imports is not
            raise


def _triton_keys(index: int) -> None:
    from torch.utils._triton import has_triton

    if not has_triton():
        return
    from torch._inductor import codecache
    from torch.utils._triton import triton_hash_with_backend

    torch.cuda.set_device(index)  # this thread's current device only
    if hasattr(codecache, "triton_key"):  # torch >= 2.12 wraps Triton's in its own cache
        codecache.triton_key()
    triton_hash_with_backend()  # Triton's key (cached by Triton) and its backend's hash


def isa_probes_ahead_due(config: CompilationConfig, cache: CompileCache | None, device: torch.device) -> bool:
    """Whether a cold CPU capture will follow, whose ISA probes are worth starting early
    (kiln.compile.cache.entry.probe_isa_ahead): mode 3 with Inductor pieces and the cache on, and
    no entry of this model on the CPU yet (a warm start's preload probes inside its entry)."""
    return (device.type == "cpu" and cache is not None and config.mode == 3 and not config.debug_guards
            and config.piece_compiler == "inductor" and not cache.root.has_entry_for(cache.name, "cpu"))


def start_preload(device: torch.device, root: Path | None, probe_entry: Path | None = None) -> Preload | None:
    """Start the preload for a model on `device` (`root`: the cache root, where the source keys
    are recorded); None if it could not start."""
    try:
        return Preload(device, root, probe_entry).start()
    except Exception as e:
        logger.debug("compile preload not started: %s: %s", type(e).__name__, e)
        return None


def _loads_pieces(config: CompilationConfig, cache: CompileCache | None) -> bool:
    """Whether a start under `config` may load Inductor pieces from `cache` (never on the eager path)."""
    return cache is not None and config.mode == 3 and not config.debug_guards and config.piece_compiler == "inductor"


def packaged_start_likely(config: CompilationConfig, cache: CompileCache | None, device: torch.device) -> bool:
    """Whether this start will likely load AOT packages only (kiln prewarm --aot made one of every
    piece in the entry of this model on this device written last): it needs neither Dynamo nor
    Inductor, so nothing imports them ahead and no preload starts. A wrong guess costs only the
    imports, made on first use."""
    if not _loads_pieces(config, cache):
        return False
    entries = cache.root.entries_for(cache.name, device.type)
    try:
        return bool(entries) and packaged(json.loads((entries[0] / MANIFEST).read_text()))
    except (OSError, ValueError):
        return False


def preload_if_warm(config: CompilationConfig, cache: CompileCache | None, device: torch.device) -> Preload | None:
    """Start the preload if this start will likely be warm (see the module's doc), and hand
    it to `cache`, where the warm start finds it. (A start from AOT packages needs none: the
    engine asks packaged_start_likely first.)"""
    if not _loads_pieces(config, cache):
        return None
    entries = cache.root.entries_for(cache.name, device.type)
    if not entries:
        return None
    # On the CPU, Inductor's ISA probes and a first load of the pieces too, in the entry last written:
    # most likely the one this start will use (if not, that one does both itself, as without the preload).
    cache.preload = start_preload(device, cache.root.path, entries[0] if device.type == "cpu" else None)
    return cache.preload
