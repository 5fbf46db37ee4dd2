"""Which tensor-parallel rank this process is, and the process groups it talks through.

A process group is found by name: the collective ops take the name as a string argument,
so a traced graph holds a constant that means the same group on every rank and every run
(a ProcessGroup object cannot be baked into a graph or a compile-cache entry).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

TP_GROUP = "tp"


@dataclass(frozen=True)
class TensorParallelState:
    rank: int
    size: int
    group_name: str


# name -> group; None is the group of one process (no torch.distributed needed).
_groups: dict[str, dist.ProcessGroup | None] = {TP_GROUP: None}
_tp = TensorParallelState(rank=0, size=1, group_name=TP_GROUP)


def tp_state() -> TensorParallelState:
    """The tensor-parallel state layers are built against (rank 0 of 1 unless initialised)."""
    return _tp


def group_size(name: str) -> int:
    group = _group(name)
    return 1 if group is None else dist.get_world_size(group)


def process_group(name: str) -> dist.ProcessGroup | None:
    """The group registered as `name`; None for a group of one process."""
    return _group(name)


def _group(name: str) -> dist.ProcessGroup | None:
    try:
        return _groups[name]
    except KeyError:
        raise ValueError(f"no process group named {name!r}; known: {', '.join(sorted(_groups))}. "
                         f"Groups are made by kiln.distributed.init_tensor_parallel") from None


def init_tensor_parallel(rank: int, size: int, backend: str, init_method: str) -> TensorParallelState:
    """Join the `size` processes of one tensor-parallel group as `rank` and register it.

    The default group is always gloo: it carries the step messages, which are host
    objects. The tensor-parallel group is a second communicator on `backend` (gloo on CPU,
    NCCL on GPU) for the model's collectives.
    """
    global _tp
    if _tp.size > 1:
        raise RuntimeError(f"tensor parallelism is already initialised in this process ({_tp})")
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size)
    _groups[TP_GROUP] = dist.new_group(list(range(size)), backend=backend)
    _tp = TensorParallelState(rank=rank, size=size, group_name=TP_GROUP)
    return _tp


def destroy_tensor_parallel() -> None:
    global _tp
    if dist.is_initialized():
        dist.destroy_process_group()
    _groups[TP_GROUP] = None
    _tp = TensorParallelState(rank=0, size=1, group_name=TP_GROUP)
