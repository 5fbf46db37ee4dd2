"""Compile the Triton kernels a start will launch in parallel processes, before it launches them.

A cold start on a fresh machine launches a few dozen specializations of kiln's own Triton
kernels (GEMV, attention, norms, rotary), and Triton compiles each on its first launch, one
after another: ~0.3-0.5 s each on the H200 host, 14 of a 15 s default start there
(benchmarks/results/fresh_start_cuda.json). Threads do not help (Triton holds the GIL for
most of a compile); processes do.

Inside `MissingKernels()`, a launch whose kernel is neither loaded nor in Triton's cache
dir is not compiled and not launched: its specialization is recorded instead (the outputs
of such a run are garbage; the caller runs it again for real afterwards). A KernelCompiler
compiles what was recorded in worker processes (kiln.compile.triton_worker) into the cache
dir, where the real launches find them, each as soon as it is recorded (MissingKernels.compiler).
A warm cache records nothing, and costs the caller one recorded run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kiln.compile import triton_worker
from kiln.compile.cache import source_keys

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


def triton_target(root: Path | None = None):
    """The current GPU's Triton target (backend, arch, warp size). Starting Triton's driver
    (which builds its C utilities on a fresh machine) and Triton's key (part of every cache
    key: recorded in the cache root `root`, see kiln.compile.cache.source_keys) happen here
    once, so that a caller can run this in the background. The two side by side: on a fresh
    machine the key hashes Triton's ~400 MB library and the driver runs the C compiler, and
    neither holds the GIL for long."""
    from triton.runtime import driver  # imports every backend: the key's walk over them imports nothing more

    with ThreadPoolExecutor(1, thread_name_prefix="kiln-triton-key") as pool:
        key = pool.submit(source_keys.triton_key, root)
        target = driver.active.get_current_target()
        key.result()
    return target


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


class _Skipped:
    """Stands in Triton's in-memory kernel cache for a recorded kernel while the recorder is on,
    so that its later launches (every layer, every bucket) take Triton's fast path, which
    launches this: nothing. Otherwise each would pack its arguments and serialise its
    specialization for the hook, ~0.35 ms a launch on the H200 host: ~2 s of a cold -O2 start's
    6,400 recorded launches. (Triton 3.6's launch reads these four attributes.)"""

    function = packed_metadata = None

    def launch_metadata(self, *args):
        return None

    def run(self, *args):
        return None


_SKIPPED = _Skipped()


class MissingKernels(contextlib.AbstractContextManager):
    """Within: launches that would compile are skipped and recorded in `self.launches`.
    `target` is the GPU's Triton target (triton.runtime.driver.active.get_current_target())."""

    def __init__(self, target):
        self.target = target
        self.launches: dict[str, KernelLaunch] = {}
        self.compiler: KernelCompiler | None = None  # while set, each recorded launch is submitted to it
        self._previous = None
        self._stand_ins: list[tuple[dict, object]] = []  # (a JIT function's kernel cache, key) holding _SKIPPED

    def compiled(self) -> None:
        """The recorded kernels are in Triton's cache dir now: their next launches load them."""
        self.launches.clear()
        for cache, key in self._stand_ins:
            if cache.get(key) is _SKIPPED:
                del cache[key]
        self._stand_ins.clear()

    def __enter__(self) -> MissingKernels:
        from triton import knobs

        self._previous = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._hook
        return self

    def __exit__(self, *exc) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook = self._previous
        self.compiled()  # a stand-in must never outlive the recorder: its launch does nothing

    def _hook(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled) -> bool:
        specialization = compile["specialization_data"]
        if specialization in self.launches:
            # Recorded kernels stay uncompiled, so each later launch of one (every layer, every
            # bucket) comes back here: skip the cache lookup, which hashes the kernel's source.
            return True
        jit = fn.jit_function
        if in_cache(jit, specialization, self.target):
            return False  # compiles as usual: a load from the cache dir
        launch = KernelLaunch(fn.module, jit.fn.__code__.co_filename, jit.fn.__name__, specialization)
        self.launches[specialization] = launch
        if self.compiler is not None:
            self.compiler.submit(launch)
        kernels = getattr(jit, "device_caches", {}).get(compile.get("device"))
        if isinstance(kernels, tuple) and kernels and isinstance(kernels[0], dict):
            kernels[0][key] = _SKIPPED
            self._stand_ins.append((kernels[0], key))
        return True  # Triton neither compiles nor launches it


class KernelCompiler:
    """Compiles kernels in worker processes (kiln.compile.triton_worker) into `cache_dir` as they
    are submitted: a recorder that streams its launches here (MissingKernels.compiler) has them
    compiling while its runs go on. A process starts with each submission until there are
    `workers` (default: one per CPU, at most MAX_WORKERS); each compiles one kernel after another."""

    def __init__(self, target, cache_dir: str, workers: int | None = None):
        self.start = time.perf_counter()
        self.workers = max(1, workers or min(os.cpu_count() or 1, MAX_WORKERS))
        self.env = dict(os.environ, TRITON_CACHE_DIR=cache_dir)
        from triton.runtime import cache

        # The key this process computed or read (triton_target): its workers need not hash Triton again.
        self.header = json.dumps({"target": [target.backend, target.arch, target.warp_size],
                                  "triton_key": cache.triton_key()}) + "\n"
        self.todo: queue.Queue[tuple[KernelLaunch, float] | None] = queue.Queue()  # with when it came
        self.threads: list[threading.Thread] = []
        self.submitted: set[str] = set()  # the launches' specializations
        self.lock = threading.Lock()
        self.results = {"compiled": 0, "failed": 0, "launchers": 0, "kernel_seconds": 0.0,
                        "launcher_seconds": 0.0, "slowest": ("", 0.0), "kernels": []}

    def submit(self, launch: KernelLaunch) -> None:
        """Compile `launch`'s kernel, unless it was submitted before."""
        if launch.specialization in self.submitted:
            return
        self.submitted.add(launch.specialization)
        self.todo.put((launch, time.perf_counter() - self.start))
        if len(self.threads) < self.workers:
            thread = threading.Thread(target=self._feed, daemon=True)
            thread.start()
            self.threads.append(thread)

    def finish(self) -> dict:
        """Wait for every submitted kernel; {"compiled", "failed", "launchers" (C launchers built
        too; none without a GPU driver), "workers", "seconds" (since construction),
        "kernel_seconds" (summed), "launcher_seconds" (the launchers' share of it), "slowest"
        (the name and seconds of the kernel that took longest), "kernels" (per kernel, in the order
        they finished: its name and when it was submitted and done, seconds since construction)}.
        A kernel that fails here is logged and left to compile (and fail) at its launch."""
        for _ in self.threads:
            self.todo.put(None)
        for thread in self.threads:
            thread.join()
        while True:  # left behind by workers that exited early: they compile at their launch
            try:
                if self.todo.get_nowait() is not None:
                    self.results["failed"] += 1
            except queue.Empty:
                break
        return {**self.results, "workers": len(self.threads), "seconds": time.perf_counter() - self.start}

    def _feed(self) -> None:
        # One worker: take the next kernel, send it, wait for its answer, until told to stop.
        proc = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env=self.env)
        try:
            proc.stdin.write(self.header)
            while (job := self.todo.get()) is not None:
                launch, submitted = job
                proc.stdin.write(launch.job() + "\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
                answer = json.loads(line) if line else {"ok": False, "error": "the worker exited"}
                with self.lock:
                    self.results["compiled" if answer["ok"] else "failed"] += 1
                    self.results["launchers"] += int(answer.get("launcher", False))
                    self.results["kernel_seconds"] += answer.get("seconds", 0.0)
                    self.results["launcher_seconds"] += answer.get("launcher_seconds", 0.0)
                    self.results["kernels"].append((launch.name, round(submitted, 3),
                                                    round(time.perf_counter() - self.start, 3)))
                    if answer.get("seconds", 0.0) > self.results["slowest"][1]:
                        self.results["slowest"] = (launch.name, answer["seconds"])
                if not answer["ok"]:
                    logger.warning("Triton worker could not compile %s: %s", launch.name, answer["error"])
                if not line:
                    break
        finally:
            proc.stdin.close()
            proc.wait()
