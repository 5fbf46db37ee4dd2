"""Inductor's graph partitions (splitting_mode "inductor_partition"), each behind a slot that a
caller can wrap, as CompiledModel.wrap_pieces wraps the pieces of an FX split.

Inductor cuts its own graph at the split ops and generates one function per partition
between them; the split ops themselves (attention, the KV write) run in its `call` in
between. With a hook set through torch._inductor.utils.set_customized_partition_wrappers,
Inductor hands each partition function to that hook when an artifact is compiled or
loaded, and calls what the hook returns. Two catches decide the shape of this module:
- The hook must be set while Inductor generates code as well: without one (and without
  Inductor's own CUDA graphs) it emits no partition functions at all.
- It is process-global, and Inductor applies it at compile or load time, once. The
  CUDA-graph layer is made later (after the KV cache exists), so the hook hands back slots
  whose wrapper can be set afterwards, and kiln sets it only around its own compiles and loads.
Inductor partitions device code only: on the CPU every kernel stays in `call` and there are
no partitions (nothing to graph there anyway).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from kiln.compile.inductor_patches import patched


class PartitionSlot:
    """Stands in for one partition function; runs it directly or through the current wrapper."""

    def __init__(self, fn: Callable, index: int, count: int):
        self.fn, self.index, self.count = fn, index, count
        self.run = fn

    def __call__(self, *args):
        return self.run(*args)


class Partitions:
    """Every partition function of one compiled forward (all its pieces and token shapes)."""

    def __init__(self, counters=None):
        self.slots: list[PartitionSlot] = []
        self.wrapper: Callable[[Callable], Callable] | None = None
        self.counters = counters  # a CompileCounters whose `partitions` counts the slots

    def _hook(self, fn: Callable, metadata) -> PartitionSlot:
        slot = PartitionSlot(fn, metadata.partition_index, metadata.num_partitions)
        if self.wrapper is not None:
            slot.run = self.wrapper(fn)
        self.slots.append(slot)
        if self.counters is not None:
            self.counters.partitions += 1
        return slot

    def wrap(self, wrapper: Callable[[Callable], Callable] | None) -> None:
        """Route every partition, those already made and those to come, through `wrapper(fn)`."""
        self.wrapper = wrapper
        for slot in self.slots:
            slot.run = wrapper(slot.fn) if wrapper is not None else slot.fn


@contextlib.contextmanager
def inductor_scope(settings: dict, partitions: Partitions | None = None):
    """Around a compile or load of one of kiln's pieces: Inductor's settings for it and, where
    Inductor partitions at the split ops, the hook (`partitions`', or generate_only where no
    caller wraps them)."""
    with patched(settings):
        if not (settings.get("graph_partition") and settings.get("custom_should_partition_ops")):
            yield
            return
        with installed(partitions._hook if partitions is not None else generate_only):
            yield


def generate_only(fn: Callable, metadata) -> Callable:
    """A hook for a process that only compiles (a compile worker): Inductor emits partition
    functions, so the artifact is the one the engine's process would have made."""
    return fn


@contextlib.contextmanager
def installed(hook: Callable):
    from torch._inductor import utils as inductor_utils

    holder = inductor_utils._unstable_customized_partition_wrapper
    previous = holder.wrapper
    inductor_utils.set_customized_partition_wrappers(hook)
    try:
        yield
    finally:
        holder.wrapper = previous
