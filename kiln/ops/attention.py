"""Attention as two opaque ops: a KV-cache write, then attention over the paged cache.

Why opaque: attention reads a paged cache through block tables whose shapes and contents
change every step; no compiler can specialise that usefully, and the kernels are written
by hand anyway. So the compile pipeline splits the graph at these ops (see
kiln.compile.split) and runs them eagerly between compiled pieces.

Why two ops: the write must happen before attention reads the cache. Attention takes the
write's (empty) result as an input, so the data dependency, not op order, keeps them
together, and no graph pass can move one without the other.

Where the rotary kernel is on (custom_ops), the write takes the rotation along:
kiln::rotary_kv_cache_write rotates q and k and writes k and v in one launch, and returns the
rotated q and k with its (empty) result; one launch fewer per layer than rotary + write.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kiln.compile.split import split_op
from kiln.forward_context import AttentionMetadata, get_forward_context
from kiln.ops.attention_reference import (
    causal_attention_reference,
    paged_attention_reference,
    write_kv_reference,
)
from kiln.ops.cpu import sdpa_attention
from kiln.ops.cpu.extension import kernel as cpu_kernel
from kiln.ops.custom_op import call, kiln_op
from kiln.ops.rotary import rotary_native


@split_op(reason="writes the paged KV cache from the forward context")
@kiln_op("kiln::kv_cache_write", mutates_args=())
def kv_cache_write(key: torch.Tensor, value: torch.Tensor, layer_name: str) -> torch.Tensor:
    cache = _layer_cache(layer_name)
    if cache is not None:
        kv_cache, slot_mapping = cache
        if kv_cache.is_cuda:
            from kiln.ops.triton.attention import write_kv

            write_kv(key, value, kv_cache, slot_mapping)
        else:
            write_kv_cpu(key, value, kv_cache, slot_mapping)
    return key.new_empty(0)


@kv_cache_write.register_fake
def _(key, value, layer_name):
    return key.new_empty(0)


def write_kv_cpu(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The built C++ write where there is one and the cache has the keys' dtype, else the reference."""
    kernel = cpu_kernel()
    if kernel is None or key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype:
        write_kv_reference(key, value, kv_cache, slot_mapping)
    else:
        kernel.write_kv(key.view(key.shape[0], -1), value.view(value.shape[0], -1), kv_cache, slot_mapping)


def _layer_cache(layer_name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """This layer's KV cache and the step's slot mapping, if the forward context has them."""
    ctx = get_forward_context()
    if ctx is not None and ctx.attn_metadata is not None and layer_name in ctx.kv_caches:
        return ctx.kv_caches[layer_name], ctx.attn_metadata.slot_mapping
    return None


@split_op(reason="rotates q and k, then writes k and v into the paged KV cache from the forward context")
@kiln_op("kiln::rotary_kv_cache_write", mutates_args=())
def rotary_kv_cache_write(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cos_sin_cache: torch.Tensor,
                          layer_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k and v [T, Hkv, D] -> rotated q and k (same shapes), and the write's (empty) result."""
    cache = _layer_cache(layer_name)
    shape_q, shape_k, head_dim = q.shape, k.shape, q.shape[-1]
    q2, k2, v2 = q.flatten(1), k.flatten(1), v.flatten(1)  # views: the heads of a token are contiguous
    if q.is_cuda:
        from kiln.ops.triton.rotary import rotary_embedding

        q2, k2 = rotary_embedding(positions, q2, k2, cos_sin_cache, head_dim, *((v2, *cache) if cache else ()))
        return q2.view(shape_q), k2.view(shape_k), q.new_empty(0)
    q2, k2 = rotary_native(positions, q2, k2, cos_sin_cache, head_dim)
    q, k = q2.view(shape_q), k2.view(shape_k)
    if cache is not None:
        write_kv_cpu(k, v, *cache)
    return q, k, q.new_empty(0)


@rotary_kv_cache_write.register_fake
def _(positions, q, k, v, cos_sin_cache, layer_name):
    torch._check(positions.shape[0] == q.shape[0])  # as kiln::rotary_embedding's fake says
    return torch.empty_like(q), torch.empty_like(k), q.new_empty(0)


@split_op(reason="attention over the paged KV cache; metadata from the forward context")
@kiln_op("kiln::attention", mutates_args=("out",))
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_written: torch.Tensor,
              out: torch.Tensor, layer_name: str, scale: float, window: int = 0, softcap: float = 0.0) -> None:
    """window > 0: each query sees only the last `window` positions, itself included (Mistral's
    sliding window); softcap > 0: each score s is softcap * tanh(s / softcap) (Gemma 2). Both are
    arguments of the op, so the model has no branch for them."""
    ctx = get_forward_context()
    meta = ctx.attn_metadata if ctx is not None else None
    kv_cache = ctx.kv_caches.get(layer_name) if ctx is not None else None
    if meta is None or kv_cache is None:
        # No cache (forwards whose values do not matter: compile warm-ups, inspect, the GEMV warm-up):
        # attend within the fresh keys.
        starts = meta.query_start_loc_cpu if meta is not None else [0, query.shape[0]]
        causal_attention_reference(query, key, value, out, starts, scale, window, softcap)
    elif kv_cache.is_cuda:
        from kiln.ops.triton.attention import paged_attention

        paged_attention(query, kv_cache, out, meta, scale, window=window, softcap=softcap)
    else:
        paged_attention_cpu(query, kv_cache, out, meta, scale, window, softcap)


@dataclass
class _CpuPlan:
    """Where a step's rows go on the CPU (paged_attention_cpu), the same for each of its layers."""

    chunks: list[tuple[int, int, int]]  # (sequence, first row, end row) for prefill_attention
    decode: tuple | None  # (rows, decode_inputs()) for decode_attention
    kernel_rows: torch.Tensor | None  # the C++ kernel's rows, with their metadata as a step of their own
    kernel_meta: AttentionMetadata | None
    kernel_all: bool  # the kernel takes every row: no packing


def _cpu_plan(meta, kv_cache: torch.Tensor, window: int, softcap: float) -> _CpuPlan:
    starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    sdpa = softcap == 0.0  # SDPA has no soft-capping (Gemma 2)
    chunks, decode, rest = [], [], []
    for i in range(len(lens)):
        s, e = starts[i], starts[i + 1]
        if sdpa and e - s >= sdpa_attention.MIN_QUERIES:
            chunks.append((i, s, e))
        elif e - s == 1:
            decode.append(i)
        elif e > s:
            rest.append(i)
    decode_plan = None
    # Decode rows go to SDPA only where the C++ kernel is not built: threaded, the kernel was as
    # quick or quicker at every batch and context measured (1-64 rows, 40-4096 tokens).
    if (decode and sdpa and cpu_kernel() is None
            and sdpa_attention.decode_fits(len(decode), max(lens[i] for i in decode), kv_cache)):
        first_rows = [starts[i] for i in decode]
        rows = slice(0, len(decode)) if first_rows == list(range(len(decode))) else torch.tensor(first_rows)
        decode_plan = (rows, sdpa_attention.decode_inputs(meta.block_tables[decode], [lens[i] for i in decode],
                                                          kv_cache.shape[2], window))
    else:
        rest = sorted(rest + decode)
    if len(rest) == len(lens) or not rest:
        return _CpuPlan(chunks, decode_plan, None, None, len(rest) == len(lens))
    return _CpuPlan(chunks, decode_plan, *_sub_step(meta, rest), False)


def paged_attention_cpu(query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, meta, scale: float,
                        window: int, softcap: float) -> None:
    """Through torch's SDPA where it is the quicker (kiln.ops.cpu.sdpa_attention): each prompt
    chunk on its own and, without a built kernel, a step's decode rows in one padded call; the
    other sequences through the built C++ kernel (one call for them all), else the reference."""
    plan = meta.cpu_plans.get((window, softcap))
    if plan is None:
        plan = meta.cpu_plans[(window, softcap)] = _cpu_plan(meta, kv_cache, window, softcap)
    for i, s, e in plan.chunks:
        out[s:e] = sdpa_attention.prefill_attention(query[s:e], kv_cache, meta.block_tables[i], meta.seq_lens_cpu[i],
                                                    scale, window)
    if plan.decode is not None:
        rows, (blocks, mask) = plan.decode
        out[rows] = sdpa_attention.decode_attention(query[rows], kv_cache, blocks, mask, scale)
    if plan.kernel_all:
        _paged_attention_kernel(query, kv_cache, out, meta, scale, window, softcap)
    elif plan.kernel_rows is not None:
        sub_out = query.new_empty(plan.kernel_rows.shape[0], *query.shape[1:])
        _paged_attention_kernel(query[plan.kernel_rows], kv_cache, sub_out, plan.kernel_meta, scale, window, softcap)
        out[plan.kernel_rows] = sub_out


def _sub_step(meta, seqs: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
    """The query rows of sequences `seqs` and their metadata as a step of their own."""
    starts, lens = meta.query_start_loc_cpu, [meta.seq_lens_cpu[i] for i in seqs]
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in seqs])
    sub_starts = [0]
    for i in seqs:
        sub_starts.append(sub_starts[-1] + starts[i + 1] - starts[i])
    return rows, AttentionMetadata(
        slot_mapping=meta.slot_mapping[rows], block_tables=meta.block_tables[seqs],
        seq_lens=torch.tensor(lens, dtype=torch.int32), query_start_loc=torch.tensor(sub_starts, dtype=torch.int32),
        max_query_len=max(b - a for a, b in zip(sub_starts, sub_starts[1:])), max_seq_len=max(lens),
        num_actual_tokens=sub_starts[-1], seq_lens_cpu=lens, query_start_loc_cpu=sub_starts)


def _paged_attention_kernel(query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, meta, scale: float,
                            window: int, softcap: float) -> None:
    kernel = cpu_kernel()
    if kernel is None:
        paged_attention_reference(query, kv_cache, out, meta, scale, window, softcap)
        return
    target = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    kernel.paged_attention(query.contiguous(), kv_cache, target, meta.block_tables.to(torch.int32),
                           meta.seq_lens_cpu, meta.query_start_loc_cpu, scale, window, softcap)
    if target is not out:
        out.copy_(target)


@attention.register_fake
def _(query, key, value, kv_written, out, layer_name, scale, window=0, softcap=0.0):
    return None


class Attention(nn.Module):
    """Multi-head attention with GQA over the paged KV cache of layer `layer_name`."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_name: str, window: int = 0,
                 scale: float | None = None, softcap: float = 0.0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.layer_name = layer_name
        self.window = window  # 0: the whole context
        self.softcap = softcap  # 0: none

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None,
                cos_sin_cache: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq * D], k and v [T, Hkv * D]; with positions and a rotary cos_sin_cache, q and k
        arrive unrotated and the KV write rotates them (kiln::rotary_kv_cache_write)."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # Everything but the two ops first: a breakable graph's segment ends at each of them.
        out = torch.empty_like(q)
        if positions is None:
            written = call(kv_cache_write, k, v, self.layer_name)
        else:
            q, k, written = call(rotary_kv_cache_write, positions, q, k, v, cos_sin_cache, self.layer_name)
        call(attention, q, k, v, written, out, self.layer_name, self.scale, self.window, self.softcap)
        return out.flatten(1)
