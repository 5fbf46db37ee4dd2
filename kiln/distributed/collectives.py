"""Collectives as `torch.library` custom ops, so Dynamo traces them as ordinary graph ops.

They are not split points: Inductor compiles the code on both sides of a collective into
the same piece, and a compiler pass can find, move or rewrite them by name (e.g. turn an
all-reduce into a reduce-scatter + all-gather for sequence parallelism). The group is a
name (see parallel_state): a traced constant that means the same group on every rank.

Every op returns a new tensor (custom ops may not alias their inputs); on a group of one
process each is a copy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kiln.distributed.parallel_state import group_size, process_group

# torch 2.13 renamed these (the old names warn); torch 2.11 only has the old ones.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@torch.library.custom_op("kiln::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of `x` over the group, on every rank."""
    out = x.clone(memory_format=torch.contiguous_format)
    group = process_group(group_name)
    if group is not None:
        dist.all_reduce(out, group=group)
    return out


@all_reduce.register_fake
def _(x, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("kiln::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of `x` over the group, split along dim 0: rank r keeps rows [r*n/size, (r+1)*n/size)."""
    group = process_group(group_name)
    if group is None:
        return x.clone(memory_format=torch.contiguous_format)
    size = dist.get_world_size(group)
    _check_rows(x, size, "reduce_scatter")
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    _reduce_scatter(out, x.contiguous(), group=group)
    return out


@reduce_scatter.register_fake
def _(x, group_name):
    size = group_size(group_name)
    return x.new_empty((x.shape[0] // size, *x.shape[1:]))


@torch.library.custom_op("kiln::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Every rank's `x` concatenated along dim 0, in rank order."""
    group = process_group(group_name)
    if group is None:
        return x.clone(memory_format=torch.contiguous_format)
    size = dist.get_world_size(group)
    out = x.new_empty((x.shape[0] * size, *x.shape[1:]))
    _all_gather(out, x.contiguous(), group=group)
    return out


@all_gather.register_fake
def _(x, group_name):
    size = group_size(group_name)
    return x.new_empty((x.shape[0] * size, *x.shape[1:]))


def _check_rows(x: torch.Tensor, size: int, op: str) -> None:
    if x.shape[0] % size:
        raise ValueError(f"kiln::{op} splits dim 0 over {size} ranks, but x has {x.shape[0]} rows; "
                         f"pad the rows to a multiple of {size}")
