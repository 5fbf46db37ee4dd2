"""Paged attention in plain PyTorch: simple, correct, and the yardstick for the kernels."""

from __future__ import annotations

import torch

from kiln.forward_context import AttentionMetadata


def write_kv_reference(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Store each token's key and value at its slot; slot -1 marks padding and is skipped."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    key, value = key.view(-1, num_kv_heads, head_dim), value.view(-1, num_kv_heads, head_dim)
    # The CPU engine's steps have no padding rows: index_copy_ there, not boolean indexing,
    # whose nonzero calls made the op 119 us a layer at 16 decodes (bf16 SmolLM2; now 95).
    if bool((slot_mapping < 0).any()):
        valid = (slot_mapping >= 0).nonzero().squeeze(1)
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
            softcap: float = 0.0) -> torch.Tensor:
    """q [n, Hq, D] are the last n positions of a context k, v [L, Hkv, D]; causal, with window > 0
    over the last `window` positions only, and with softcap > 0 each score s becomes
    softcap * tanh(s / softcap) before the softmax (Gemma 2)."""
    n, length = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    query_pos = torch.arange(length - n, length, device=q.device)
    keys = torch.arange(length, device=q.device)[None, :]
    mask = keys <= query_pos[:, None]
    if window > 0:
        mask &= keys > query_pos[:, None] - window
    if softcap > 0:  # SDPA has no soft-capping: the scores are spelled out, softmax in fp32 as HF's Gemma 2
        scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
        scores = torch.tanh(scores / softcap) * softcap
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.einsum("hnl,lhd->nhd", probs, v)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


def paged_attention_reference(query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                              meta: AttentionMetadata, scale: float, window: int = 0,
                              softcap: float = 0.0) -> None:
    """out[tokens of seq i] = causal attention of its queries over its paged context."""
    block_size = kv_cache.shape[2]
    starts = meta.query_start_loc_cpu
    for i, length in enumerate(meta.seq_lens_cpu):
        s, e = starts[i], starts[i + 1]
        if e == s:
            continue
        blocks = meta.block_tables[i, : (length + block_size - 1) // block_size].long()
        k = kv_cache[0, blocks].flatten(0, 1)[:length]
        v = kv_cache[1, blocks].flatten(0, 1)[:length]
        out[s:e] = _attend(query[s:e], k, v, scale, window, softcap)


def causal_attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               out: torch.Tensor, query_start_loc: list[int], scale: float,
                               window: int = 0, softcap: float = 0.0) -> None:
    """Without a KV cache (profiling, or a bare forward): each sequence attends to itself."""
    for s, e in zip(query_start_loc[:-1], query_start_loc[1:]):
        if e > s:
            out[s:e] = _attend(query[s:e], key[s:e], value[s:e], scale, window, softcap)
