"""Compiling unique pieces side by side, in worker processes.

One piece's Inductor compile is mostly serial Python (AOTAutograd, lowering, scheduling,
code generation), and Inductor is not thread-safe: a cold start of a Llama-3-8B-shaped
model spent 8.8 s compiling its 3 unique pieces one after another on a 16-core H200 host.
Workers compile the pieces at the same time, into the compile-cache entry; the parent
then loads what they wrote, exactly as a warm start would.

Each worker runs a warm-up task at once (importing Inductor, a first compile), so that its
start-up overlaps the weights' load and Dynamo's trace in the parent. Where the start is surely
cold (no entry of the model in the cache) the engine starts them before the weights load
(`start_before_cold_start`), otherwise they start when a cold capture begins. They are forked
where that is safe (Linux, the parent has not initialised CUDA and runs no other thread): a
fork starts with the parent's imports, where a spawned worker imports torch, kiln and Dynamo
itself (a spawned worker was warm 5.5-6.8 s after its start on the H200 host, ~3 s of it
importing). Otherwise they are spawned, skipping the parent's main script (kiln.compile.spawn).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from kiln.compile.spawn import SpawnContext

# Fewer cores than this per worker and the workers only steal time from each other and from
# Dynamo's trace in the parent (the 2-core CI machine compiles in-process).
CORES_PER_WORKER = 4
MAX_WORKERS = 4


def auto_worker_count() -> int:
    return min(MAX_WORKERS, (os.cpu_count() or 1) // CORES_PER_WORKER)


def worker_count(config) -> int:
    """How many workers `config` (a CompilationConfig) compiles with: 0 or 1 means in-process."""
    return auto_worker_count() if config.compile_workers is None else config.compile_workers


def compiles_in_workers(config) -> bool:
    """Whether a cold capture under `config` compiles its pieces in workers: Inductor pieces,
    no graph passes (they report to the parent's monitor, so they run in-process), >= 2 workers.
    (The workers also need the compile cache: they hand their artifacts over through it.)"""
    return config.piece_compiler == "inductor" and not config.passes and worker_count(config) >= 2


# Workers start_ahead started for an engine built later, by (cache root, model, device type).
_ahead: dict[tuple[str, str, str], CompileWorkers] = {}


def start_before_cold_start(config, cache, device_type: str) -> None:
    """Start the workers now, before the weights load, where a cold capture with workers is
    certain to follow: mode 3, compiles_in_workers, and no entry of this model on this device
    type in `cache` (a CompileCache), which keeps them for the capture. The capture starts them
    itself otherwise. Workers start_ahead started for this cache are taken instead."""
    if _certainly_cold(config, cache, device_type):
        cache.workers = _ahead.pop(_ahead_key(cache, device_type), None) or _started(config)


def start_ahead(config, cache, device_type: str) -> None:
    """start_before_cold_start for an engine that another thread builds later (`kiln serve`'s,
    beside uvicorn's loop): workers fork only from a process with one thread, so they start
    here, and that engine's start_before_cold_start takes them."""
    if _certainly_cold(config, cache, device_type):
        workers = _started(config)
        if workers is not None:
            _ahead[_ahead_key(cache, device_type)] = workers


def _ahead_key(cache, device_type: str) -> tuple[str, str, str]:
    return str(cache.root.path), cache.name, device_type


def _certainly_cold(config, cache, device_type: str) -> bool:
    return not (cache is None or config.mode != 3 or config.debug_guards or not compiles_in_workers(config)
                or cache.root.has_entry_for(cache.name, device_type))


def _started(config) -> CompileWorkers | None:
    try:
        return CompileWorkers(worker_count(config))
    except Exception:  # the capture tries again, and says why if it fails too
        return None


@dataclass
class PieceJob:
    """One unique piece for one token shape: what a worker needs to compile it."""

    index: int
    shape: object  # TokenShape
    graph: bytes  # the pickled piece graph (fx.GraphModule)
    op_modules: list[str]  # where the custom ops it calls are defined: imported before unpickling
    inputs: list  # PieceInput
    entry: object  # the CacheEntry whose Inductor dir receives the built files
    inductor_config: dict
    out: str  # where the worker saves the artifact


@dataclass
class PieceResult:
    index: int
    shape: object
    seconds: float
    fx_cache_hit: bool
    error: str | None = None


class CompileWorkers:
    def __init__(self, count: int):
        self.count = count
        # A pool starts its processes at the first task (spawned: one per task while none is idle):
        # one warm-up task each starts them all, now. Each compiles its Triton kernels itself: a pool
        # of Inductor's own per worker would start 16 more processes each, fighting Dynamo for the cores.
        self.started = time.perf_counter()
        self._ready_at: list[float] = []  # when each warm-up finished
        with _environment(TORCHINDUCTOR_COMPILE_THREADS="1", TORCH_WARM_POOL="0"):
            self.pool, self.start_method = _forked_pool(count), "fork"
            if self.pool is None:
                self.pool = ProcessPoolExecutor(count, mp_context=SpawnContext(), initializer=_settings)
                self.start_method = "spawn"
            for _ in range(count):
                self.pool.submit(_warm_up).add_done_callback(lambda _: self._ready_at.append(time.perf_counter()))
        self.timing: tuple[float, float] | None = None  # see compile()

    def compile(self, jobs: list[PieceJob], meanwhile: Callable[[], object] | None = None
                ) -> Iterator[tuple[PieceJob, PieceResult]]:
        """Each job with its result, in the order they finish (so the caller loads one
        artifact while the workers still compile others). `meanwhile` runs here once the
        workers have every job."""
        handed_over = time.perf_counter()
        futures: dict[Future, PieceJob] = {self.pool.submit(_compile, job): job for job in jobs}
        if meanwhile is not None:
            meanwhile()
        for future in as_completed(futures):
            yield futures[future], future.result()
        # (seconds from the workers' start until the last was warm, until the jobs came): where
        # the first is larger, the jobs waited for the workers' start-up.
        ready = max(self._ready_at, default=handed_over)
        self.timing = (ready - self.started, handed_over - self.started)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _fork_is_safe() -> bool:
    """A forked child may use CUDA only if the parent never initialised it, and holds no lock
    another of the parent's threads held at the fork."""
    import torch

    return sys.platform == "linux" and not torch.cuda.is_initialized() and threading.active_count() == 1


def _forked_pool(count: int) -> ProcessPoolExecutor | None:
    """Workers forked from this process, or None where a fork is not safe."""
    if not _fork_is_safe():
        return None
    importlib.import_module("torch._dynamo")  # else each child imports it again: ~1 s of its start

    pool = ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("fork"), initializer=_settings)
    # torch marks a child forked after the parent asked the CUDA runtime anything (even the device
    # count): CUDA is unusable there, and torch.cuda.is_initialized() does not tell it beforehand.
    if pool.submit(_cuda_is_usable).result():
        return pool
    pool.shutdown(wait=False, cancel_futures=True)
    return None


def _cuda_is_usable() -> bool:
    import torch

    return not torch.cuda._is_in_bad_fork()


def _settings() -> None:
    """First in every worker. A forked one inherits Inductor's settings as the parent imported
    them, before _environment's variables were set."""
    import torch
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1
    torch.set_num_threads(1)  # a compile runs no parallel op; a forked OpenMP pool may not be usable


@contextlib.contextmanager
def _environment(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _warm_up() -> float:
    """Everything a worker's first compile would otherwise pay for, while the parent traces."""
    start = time.perf_counter()
    import torch
    import torch._inductor.codecache  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.select_algorithm  # noqa: F401

    import kiln.compile.inductor_piece  # noqa: F401

    if torch.cuda.is_available():
        torch.cuda.init()
        _compile_a_toy("cuda")
    return time.perf_counter() - start


def _compile_a_toy(device: str) -> None:
    """A first Inductor compile loads Triton's backend and driver and warms code generation
    (seconds, once per process): done here on a toy, in a scratch cache dir."""
    import tempfile

    import torch
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    def toy(x):
        return (x * 2 + 1).relu()

    try:
        with tempfile.TemporaryDirectory() as scratch, temporary_cache_dir(scratch):
            graph = torch.fx.symbolic_trace(toy)
            torch._inductor.standalone_compile(graph, [torch.randn(64, device=device)],
                                               dynamic_shapes="from_example_inputs")
    except Exception:  # only a head start: the real compile pays the same costs if this fails
        pass


def op_modules(graph) -> list[str]:
    """The Python modules that define the custom ops (torch.library.custom_op) `graph` calls:
    a worker imports them, so that unpickling the graph finds the ops registered."""
    from torch._library.custom_ops import OPDEFS

    from kiln.compile.split import op_name

    found = set()
    for node in graph.graph.nodes:
        opdef = OPDEFS.get(op_name(node.target)) if node.op == "call_function" else None
        if opdef is not None:
            found.add(opdef._init_fn.__module__)
    return sorted(found)


def _compile(job: PieceJob) -> PieceResult:
    from torch._dynamo.utils import counters

    from kiln.compile.inductor_piece import compile_piece, specialise
    from kiln.compile.partitions import inductor_scope

    start = time.perf_counter()
    hits = counters["inductor"]["fxgraph_cache_hit"]
    try:
        for name in job.op_modules:
            importlib.import_module(name)
        graph = pickle.loads(job.graph)
        mode, inputs = specialise(job.inputs, job.shape)
        with job.entry.compiler_dirs(), inductor_scope(job.inductor_config):
            artifact = compile_piece(graph, mode, inputs)
            tmp = Path(job.out)
            tmp.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            artifact.save(path=str(tmp), format="binary")
    except Exception as e:  # the parent compiles this piece itself and says why
        return PieceResult(job.index, job.shape, time.perf_counter() - start, False, f"{type(e).__name__}: {e}")
    hit = counters["inductor"]["fxgraph_cache_hit"] > hits
    return PieceResult(job.index, job.shape, time.perf_counter() - start, hit)
