"""Rotary position embedding (rotate-half / NeoX layout) as a Triton kernel.

One program per token rotates every head of q and of k. For a column d of a head, with
half = rotary_dim // 2:
    d < half:              x[d] * cos[d]        - x[d + half] * sin[d]
    half <= d < rotary_dim: x[d] * cos[d - half] + x[d - half] * sin[d - half]
    rotary_dim <= d:        x[d]  (passes through)
so each column is x * cos + sign * partner * sin, which the kernel computes in one tile.
cos and sin are rounded to the dtype of q first, and each product and the sum after it, as
`rotary_native`'s ops round: in bf16 and fp16 the two agree bit for bit.
The same launch can write the rotated k and v into the paged KV cache (kiln::rotary_kv_cache_write).
"""

from __future__ import annotations

import functools

import torch
import triton

from kiln.ops.triton.dependent_launch import pdl_args
from kiln.ops.triton.kernels.rotary import rotary_kernel
from kiln.ops.triton.launch import launch


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


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                     head_dim: int, value: torch.Tensor | None = None, kv_cache: torch.Tensor | None = None,
                     slot_mapping: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q [T, Hq * D] and k [T, Hkv * D] (contiguous; inputs untouched). With
    kv_cache ([2, blocks, block_size, Hkv, D]) and slot_mapping, the same launch also writes the
    rotated k and `value` [T, Hkv * D] at each token's slot (kiln.ops.triton.attention.write_kv's
    contract: slot -1 is skipped, as is every token past slot_mapping's length)."""
    _check(positions, q, k, cos_sin_cache, head_dim)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return q_out, k_out
    num_q_heads, num_kv_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    write = kv_cache is not None
    if write:
        _check_kv_write(k, value, kv_cache, slot_mapping, head_dim)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        cache_args = (value, key_cache, value_cache, slot_mapping, value.stride(0), key_cache.stride(0),
                      key_cache.stride(1), key_cache.stride(2), kv_cache.shape[2], slot_mapping.shape[0])
    else:  # unread placeholders
        cache_args = (k, k, k, positions, 0, 0, 0, 0, 1, 0)
    launch(rotary_kernel, (num_tokens,),
        positions, q, k, cos_sin_cache, q_out, k_out, q.stride(0), k.stride(0), cos_sin_cache.stride(0),
        num_q_heads, num_kv_heads, *cache_args, WRITE_KV=write,
        **_launch_config(head_dim, cos_sin_cache.shape[-1], num_q_heads, num_kv_heads), **pdl_args(q.device),
    )
    return q_out, k_out


@functools.cache
def _launch_config(head_dim: int, rotary_dim: int, num_q_heads: int, num_kv_heads: int) -> dict:
    # Once per shape: its three powers of two took 6 of the 20 us of host time a call.
    return dict(HEAD_DIM=head_dim, ROTARY_DIM=rotary_dim, BLOCK_DIM=triton.next_power_of_2(head_dim),
                BLOCK_Q_HEADS=triton.next_power_of_2(num_q_heads), BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
                num_warps=8 if num_q_heads * head_dim >= 8192 else 4)


def _check_kv_write(k, value, kv_cache, slot_mapping, head_dim) -> None:
    if value is None or slot_mapping is None:
        raise ValueError("rotary_embedding: writing the KV cache needs value and slot_mapping too")
    if value.shape != k.shape or value.stride(1) != 1 or value.dtype != k.dtype:
        raise ValueError(f"rotary_embedding: value must be like k, {tuple(k.shape)} {k.dtype} with a contiguous "
                         f"last dim; got {tuple(value.shape)} {value.dtype} strides {value.stride()}")
    heads = k.shape[1] // head_dim
    if (kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[-2:] != (heads, head_dim)
            or kv_cache.stride(-1) != 1 or kv_cache.dtype != k.dtype):
        raise ValueError(f"rotary_embedding: kv_cache must be [2, blocks, block_size, {heads}, {head_dim}] {k.dtype} "
                         f"with a contiguous last dim, got {tuple(kv_cache.shape)} {kv_cache.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rotary_embedding: slot_mapping must be 1-D int32/int64, got {tuple(slot_mapping.shape)} "
                         f"{slot_mapping.dtype}")
