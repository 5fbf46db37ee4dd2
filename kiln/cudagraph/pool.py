"""CUDA graph capture and replay, and the memory pool every graph of a model shares.

Every graph draws from one shared pool and is captured largest bucket first, so a smaller
graph reuses the memory a larger one needed. That is safe because the graphs never run
concurrently and a tensor is dead once the op after it has read it: the only tensors that
must outlive a replay are the outputs, and those are held weakly (a view that does not own
its memory), so capturing the next graph may reuse what they occupy. The caller must read
a replay's output before it replays another graph.

Inputs of a graph are read from the addresses seen at capture: the caller keeps its
inputs in static buffers (sliced the same way each time), and each piece's inputs are the
previous pieces' outputs. With debug on, every replay checks those addresses.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree

logger = logging.getLogger("kiln")


def weak_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor over t's memory that does not keep that memory alive."""
    storage = torch._C._construct_storage_from_data_pointer(
        t.untyped_storage().data_ptr(), t.device, t.untyped_storage().nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.shape, t.stride())


def weak_outputs(value):
    return pytree.tree_map_only(torch.Tensor, weak_view, value)


def tensor_addresses(args) -> list[int]:
    return [x.data_ptr() for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor)]


class CudagraphPool:
    """The memory pool, capture stream and bookkeeping shared by all CUDA graphs of one model."""

    def __init__(self, device: torch.device, debug: bool = False):
        self.device, self.debug = device, debug
        self.handle = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self.num_graphs = 0
        self.capture_s = 0.0

    @contextlib.contextmanager
    def session(self, collect: bool = True):
        """Around all captures of a start-up: one garbage collection before the first graph,
        none after (a collection during a capture could free memory a captured kernel uses;
        one before each capture would cost a heap walk each). The collection is of the young
        generations: what the warm-up runs left is there, while the start's imports and loads
        went to the oldest unwalked (kiln.compile.gc_pause), and a full walk of them took
        0.1-0.3 s on the GPU host. collect=False: no collection before (a capture while serving),
        none during either."""
        if collect:
            gc.collect(1)
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            if was_enabled:
                gc.enable()

    @contextlib.contextmanager
    def capturing(self):
        """Around one forward's captures: on the capture stream, finished when it ends."""
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:  # a capture that failed while serving too: the next step's writes must wait for it
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            torch.cuda.synchronize(self.device)
            self.capture_s += time.perf_counter() - start

    def capture(self, fn: Callable, *args) -> tuple["CapturedCudagraph", object]:
        """Capture fn(*args); returns the graph and fn's output, strongly held: the caller keeps
        it while later captures of the same forward read it, then drops it (the graph keeps
        only a weak view)."""
        # Read before the call: an Inductor partition empties the list of inputs it is given.
        addresses = tensor_addresses(args) if self.debug else None
        graph = self.begin()
        try:
            out = fn(*args)
        finally:
            self.end(graph)
        return CapturedCudagraph(graph, weak_outputs(out), addresses), out

    def begin(self) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.handle)
        return graph

    def end(self, graph: torch.cuda.CUDAGraph) -> None:
        graph.capture_end()
        self.num_graphs += 1

    def memory_bytes(self) -> int:
        """Device memory the caching allocator holds for this pool: what the graphs keep. (The
        change in free memory around a capture is not it: the allocator may release cached
        blocks meanwhile, which once made a capture look 3.7 GB negative.)"""
        handle = tuple(self.handle)
        return sum(segment["total_size"] for segment in torch.cuda.memory_snapshot()
                   if tuple(segment.get("segment_pool_id", ())) == handle)


class CapturedCudagraph:
    def __init__(self, graph: torch.cuda.CUDAGraph, output, addresses: list[int] | None):
        self.graph, self.output, self.addresses = graph, output, addresses

    def replay(self, *args):
        if self.addresses is not None:
            now = tensor_addresses(args)
            if now != self.addresses:
                moved = [i for i, (a, b) in enumerate(zip(now, self.addresses)) if a != b]
                raise RuntimeError(f"CUDA graph replay: input tensor(s) {moved or 'count'} are not where they "
                                   f"were at capture; a graph reads its inputs from fixed addresses, so the "
                                   f"caller must pass the same static buffers")
        self.graph.replay()
        return self.output


def log_capture(pool: CudagraphPool, memory_bytes: int, warm_up_runs: int, warm_up_s: float) -> None:
    logger.info("captured %d CUDA graphs in %.2f s (%.2f s of it in %d warm-up runs), %.2f GiB of graph memory",
                pool.num_graphs, pool.capture_s, warm_up_s, warm_up_runs, memory_bytes / 2**30)
