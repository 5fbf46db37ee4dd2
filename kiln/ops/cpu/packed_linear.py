"""Linear weights reordered once for oneDNN, for kiln's linear ops on the CPU in bf16.

A plain bf16 matmul on the CPU (aten::mm, through oneDNN) reorders the weight into the layout
its AMX kernel reads on every call; a weight reordered at load skips that. On the 2-core dev
machine, SmolLM2's linears at 16 rows, a decode step's worth, each weight read from memory as in
a step: 20.5 ms plain, 12.4 ms prepacked (21.6 GB/s: the memory's rate); with the same bits as
aten::mm at 1 to 2048 rows. In fp32 the prepacked kernel sums in another order and is slower at
one row, so only bf16 packs.

The packed tensor is an MKLDNN-layout tensor, which Dynamo and Inductor cannot take as a graph
input, so the graph passes the ordinary weight and the op finds its packed twin here, by the
weight's address and shape. Each entry lives as long as its weight (a finalizer drops it), so a
freed weight's address, reused by another tensor, never finds a stale twin.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

from kiln.config import CPU_PACKED_LINEAR_DTYPES

_packed: dict[tuple, torch.Tensor] = {}


def _key(weight: torch.Tensor) -> tuple:
    return weight.data_ptr(), tuple(weight.shape), tuple(weight.stride())


def packs(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in CPU_PACKED_LINEAR_DTYPES and weight.dim() == 2
            and torch.backends.mkldnn.is_available())


def pack_linear_weights(weights: Iterable[torch.Tensor]) -> int:
    """Packs each of `weights` (kiln.ops.linear.kiln_linear_weights: the layers whose matmul is
    one of kiln's linear ops) that packs; returns the bytes the packed copies take (the weights
    stay: the graph and tied embeddings read them)."""
    total = 0
    for weight in weights:
        key = _key(weight)
        if key in _packed or not packs(weight):
            continue
        with torch.inference_mode():
            _packed[key] = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        weakref.finalize(weight, _packed.pop, key, None)
        total += weight.numel() * weight.element_size()
    return total


def packed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x @ weight.T through weight's packed twin, or None when it has none (or x's dtype differs)."""
    packed = _packed.get(_key(weight)) if x.dtype == weight.dtype and x.device.type == "cpu" else None
    if packed is None:
        return None
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, None, "none", [], "")
    return y.view(*x.shape[:-1], weight.shape[0])
