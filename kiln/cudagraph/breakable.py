"""Breakable CUDA graphs: an eager forward captured with no compiler at all (SGLang's idea).

A dispatch mode watches every op of one forward. Ops run inside a CUDA graph segment until
a split op (attention) arrives: the segment ends, the split op runs eagerly and is
recorded, and the next op begins a new segment. Replaying is segment, split ops,
segment, ... so attention still reads this step's metadata from the forward context,
while everything else launches as one graph per segment. No Dynamo, no Inductor.

A split op's tensor arguments are the segments' tensors (pool memory, fixed addresses)
or outputs of earlier split ops; a split op's outputs are kept, and each replay copies
the fresh result into them, so a later segment reads it where it was captured. Only work
dispatched as torch ops is captured: a kernel launched behind torch's back would run once,
at capture, and never again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from kiln.cudagraph.pool import CudagraphPool, weak_outputs, weak_view


class SplitCall:
    def __init__(self, func, args, kwargs, out, owned: dict[int, torch.Tensor]):
        # owned: earlier split ops' outputs by id; nothing else keeps them alive, so they stay
        # strong. Every other tensor belongs to a segment (the pool) or to the caller: weak.
        self.func = func
        self.args, self.kwargs = pytree.tree_map_only(
            torch.Tensor, lambda x: owned.get(id(x)) if id(x) in owned else weak_view(x), (args, kwargs))
        self.outs = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]

    def run(self) -> None:
        fresh = self.func(*self.args, **self.kwargs)
        for old, new in zip(self.outs, [x for x in pytree.tree_leaves(fresh) if isinstance(x, torch.Tensor)]):
            if old.numel():
                old.copy_(new)


class BreakableCudagraph:
    def __init__(self, steps: list, output):
        self.steps, self.output = steps, output  # steps: CUDAGraph | SplitCall, in order

    def replay(self):
        for step in self.steps:
            if isinstance(step, SplitCall):
                step.run()
            else:
                step.replay()
        return self.output


class _Segmenter(TorchDispatchMode):
    def __init__(self, pool: CudagraphPool, split_names: set[str]):
        super().__init__()
        self.pool, self.split_names = pool, split_names
        self.steps: list = []
        self.owned: dict[int, torch.Tensor] = {}
        self.graph: torch.cuda.CUDAGraph | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.name in self.split_names:
            self.end_segment()
            out = func(*args, **kwargs)
            call = SplitCall(func, args, kwargs, out, self.owned)
            self.owned.update((id(x), x) for x in call.outs)
            self.steps.append(call)
            return out
        if self.graph is None:
            self.graph = self.pool.begin()
        return func(*args, **kwargs)

    def end_segment(self) -> None:
        if self.graph is not None:
            self.pool.end(self.graph)
            self.steps.append(self.graph)
            self.graph = None


def capture_breakable(pool: CudagraphPool, fn: Callable, args: tuple, split_names: set[str]):
    """Capture fn(*args) as segments cut at `split_names` ops; returns (graph, strong output)."""
    segmenter = _Segmenter(pool, split_names)
    try:
        with segmenter:
            out = fn(*args)
    finally:
        segmenter.end_segment()
    return BreakableCudagraph(segmenter.steps, weak_outputs(out)), out
