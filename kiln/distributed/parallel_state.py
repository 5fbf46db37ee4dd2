"""Which tensor-parallel rank this process is, and the process groups it talks through.

A process group is found by name: the collective ops take the name as a string argument,
so a traced graph holds a constant that means the same group on every rank and every run
(a ProcessGroup object cannot be baked into a graph or a compile-cache entry).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

TP_GROUP = "tp"


@dataclass(frozen=True)
class TensorParallelState:
    rank: int
    size: int
    group_name: str


SINGLE = TensorParallelState(rank=0, size=1, group_name=TP_GROUP)

# name -> group; None is the group of one process (no torch.distributed needed).
_groups: dict[str, dist.ProcessGroup | None] = {TP_GROUP: None}
_joined: TensorParallelState = SINGLE  # the group this process has joined
_building: TensorParallelState = SINGLE  # the state layers built now shard for


def tp_state() -> TensorParallelState:
    """The tensor-parallel state a layer built now shards its weights for."""
    return _building


@contextlib.contextmanager
def building_for(state: TensorParallelState):
    """Layers built inside this block hold rank `state.rank`'s shard of `state.size`.

    Scoped like custom_ops: joining a group does not make every model built later in the
    process sharded, only the one its runner builds here.
    """
    global _building
    previous, _building = _building, state
    try:
        yield
    finally:
        _building = previous


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
    global _joined
    if _joined.size > 1:
        raise RuntimeError(f"this process already runs tensor-parallel rank {_joined.rank} of {_joined.size}; "
                           f"shut that engine down first (one tensor-parallel engine per process)")
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size)
    group = dist.new_group(list(range(size)), backend=backend)
    # Connect now: NCCL builds its communicator at the first collective, which must not fall
    # inside a CUDA graph capture; and a rank that cannot connect fails here, at start-up.
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    _groups[TP_GROUP] = group
    _joined = TensorParallelState(rank=rank, size=size, group_name=TP_GROUP)
    return _joined


def destroy_tensor_parallel() -> None:
    global _joined
    if dist.is_initialized():
        dist.destroy_process_group()
    _groups[TP_GROUP] = None
    _joined = SINGLE
