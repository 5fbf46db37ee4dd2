"""Rotary position embedding (rotate-half / NeoX layout) as a Triton kernel.

One program per token rotates every head of q and of k. For a column d of a head, with
half = rotary_dim // 2:
    d < half:              x[d] * cos[d]        - x[d + half] * sin[d]
    half <= d < rotary_dim: x[d] * cos[d - half] + x[d - half] * sin[d - half]
    rotary_dim <= d:        x[d]  (passes through)
so each column is x * cos + sign * partner * sin, which the kernel computes in one tile.
cos and sin are rounded to the dtype of q first, as `rotary_native` does; the rest is
fp32, rounded once (the native path rounds after every op: results may differ by ~1 ulp).
"""

from __future__ import annotations

import torch
import triton

from kiln.ops.triton.kernels.rotary import rotary_kernel


def _check(positions, q, k, cos_sin_cache, head_dim) -> None:
    if positions.dim() != 1:
        raise ValueError(f"rotary_embedding: positions must be 1-D [tokens], got {tuple(positions.shape)}")
    num_tokens = positions.shape[0]
    for name, x in (("q", q), ("k", k)):
        if x.dim() != 2 or x.shape[0] != num_tokens or x.shape[1] % head_dim != 0:
            raise ValueError(f"rotary_embedding: {name} must be [{num_tokens}, heads * {head_dim}], "
                             f"got {tuple(x.shape)}")
        if x.stride(1) != 1:
            raise ValueError(f"rotary_embedding: {name}'s last dim must be contiguous, got strides {x.stride()}")
    if q.dtype != k.dtype:
        raise ValueError(f"rotary_embedding: q is {q.dtype} but k is {k.dtype}")
    rotary_dim = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or cos_sin_cache.stride(1) != 1 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_embedding: cos_sin_cache must be [max_position, rotary_dim] with an even "
                         f"rotary_dim <= head_dim {head_dim}, last dim contiguous; got {tuple(cos_sin_cache.shape)}")


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q [T, Hq * D] and k [T, Hkv * D] (contiguous; inputs untouched)."""
    _check(positions, q, k, cos_sin_cache, head_dim)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return q_out, k_out
    num_q_heads, num_kv_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache, q_out, k_out, q.stride(0), k.stride(0), cos_sin_cache.stride(0),
        num_q_heads, num_kv_heads,
        HEAD_DIM=head_dim, ROTARY_DIM=cos_sin_cache.shape[-1], BLOCK_DIM=triton.next_power_of_2(head_dim),
        BLOCK_Q_HEADS=triton.next_power_of_2(num_q_heads), BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
        num_warps=8 if num_q_heads * head_dim >= 8192 else 4,
    )
    return q_out, k_out
