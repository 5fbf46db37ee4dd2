"""CPU attention through torch's scaled_dot_product_attention over K and V gathered from the paged cache.

torch's CPU flash attention multiplies in the cache's dtype with oneDNN (AMX for bf16 where the
CPU has it) and accumulates in fp32; the C++ paged kernel converts K and V to fp32 tiles for every
query tile. On the 2-core dev machine, bf16 SmolLM2 shapes (9 query heads, 3 KV heads, dim 64),
one layer, SDPA against the C++ kernel (when it still ran on one thread; see extension.py):
- a prompt chunk (prefill_attention): 2048 queries over 8000 keys 84 vs 676 ms, 168 over 8000 8.9
  vs 63 ms, 8 over 2000 0.6 vs 2.0 ms, with the same error against an fp64 reference (2.3e-3 vs
  1.7e-3 relative in bf16, 4e-7 in fp32); gathering 8000 tokens' K and V costs ~1.7 ms. Threaded,
  the kernel still loses: 2048 over 2048 8.1 vs 71 ms, 128 over 128 0.15 vs 0.37 ms (bf16);
- decode rows, all sequences padded into one call (decode_attention): 16 at ~100 tokens 0.24 vs
  0.31 ms, 16 at 512 1.0 vs 1.7, 64 at 300 2.5 vs 4.3. Threaded, the kernel wins or ties: 16 at
  512 0.96 vs 0.71 ms, 64 at 2048 14.0 vs 13.9, 8 at 4096 5.2 vs 3.5 (bf16). So decode_attention
  serves only where the kernel is not built, in place of the much slower Python reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# A sequence with at least this many queries in a step takes prefill_attention. Alone, SDPA wins
# from 8 queries (above), but the kernel serves a step's short prompts in one call: with 8, 16
# chats of ~35 tokens ran 2% slower in the engine (fp32, benchmarks/cpu_attention.py).
MIN_QUERIES = 64
# Without a built kernel, decode_attention takes a step's decode rows when there are this many,
# the longest context has this many tokens, and their padded K and V fit in this many bytes
# (thresholds measured against the one-thread kernel; the reference is slower still).
MIN_DECODE_ROWS = 4
MIN_DECODE_CONTEXT = 256
MAX_DECODE_GATHER_BYTES = 64 << 20


def prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, length: int,
                      scale: float, window: int = 0) -> torch.Tensor:
    """Causal attention of query [n, Hq, D], the last n positions of a context of `length` tokens
    whose K and V lie in kv_cache [2, blocks, block_size, Hkv, D] at block_table's blocks;
    window > 0: each query sees the last `window` positions only. Returns [n, Hq, D]."""
    n = query.shape[0]
    first = max(0, length - n - window + 1) if window > 0 else 0  # keys no query of the chunk sees
    block_size = kv_cache.shape[2]
    blocks = block_table[first // block_size: -(-length // block_size)].long()
    skip = first % block_size
    key = kv_cache[0, blocks].flatten(0, 1)[skip: skip + length - first]
    value = kv_cache[1, blocks].flatten(0, 1)[skip: skip + length - first]
    if window == 0 and n < length:
        return _later_chunk(query, key, value, scale)
    mask = None  # a whole prompt (n == length) without a window: plain causal
    if window > 0:
        positions = torch.arange(length - n, length)[:, None]
        keys = torch.arange(first, length)[None, :]
        mask = (keys <= positions) & (keys > positions - window)
    out = F.scaled_dot_product_attention(query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                         value.transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None,
                                         scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _later_chunk(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """A chunk of n queries after a prefix: every query sees the whole prefix, and the chunk's own
    n keys causally. As one SDPA call that takes an n x length mask, which flash attention applies
    to every block; as two calls, the prefix unmasked and the chunk's square as is_causal (whose
    blocks above the diagonal are skipped), merged by their log-sum-exps: 2048 queries over 8000
    keys 175 -> 125 ms in fp32 (SmolLM2 heads, 2 threads), the same error against fp64."""
    n, q_heads, head_dim = query.shape
    kv_heads = key.shape[1]
    group, prefix = q_heads // kv_heads, key.shape[0] - n
    q = query.transpose(0, 1)[None]  # [1, Hq, n, D]
    k, v = key.transpose(0, 1)[None], value.transpose(0, 1)[None]
    # Over the prefix, a kv head's query heads are just more rows: no repeated K and V.
    out_prefix, lse_prefix = _flash(q.reshape(1, kv_heads, group * n, head_dim), k[:, :, :prefix], v[:, :, :prefix],
                                    is_causal=False, scale=scale)
    out_prefix, lse_prefix = out_prefix.reshape(1, q_heads, n, head_dim), lse_prefix.reshape(1, q_heads, n)
    out_chunk, lse_chunk = _flash(q, k[:, :, prefix:].repeat_interleave(group, 1),
                                  v[:, :, prefix:].repeat_interleave(group, 1), is_causal=True, scale=scale)
    lse = torch.logaddexp(lse_prefix, lse_chunk)
    out = (out_prefix.float() * torch.exp(lse_prefix - lse)[..., None]
           + out_chunk.float() * torch.exp(lse_chunk - lse)[..., None])
    return out[0].transpose(0, 1).to(query.dtype)


def _flash(q, k, v, *, is_causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    # The CPU flash kernel SDPA dispatches to, called directly for its log-sum-exp.
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)


def decode_fits(num_rows: int, max_len: int, kv_cache: torch.Tensor) -> bool:
    """Whether decode_attention takes these rows: enough of them, long enough, and their padded K
    and V small enough."""
    block_size, kv_heads, head_dim = kv_cache.shape[2:]
    gathered = 2 * num_rows * -(-max_len // block_size) * block_size * kv_heads * head_dim * kv_cache.element_size()
    return num_rows >= MIN_DECODE_ROWS and max_len >= MIN_DECODE_CONTEXT and gathered <= MAX_DECODE_GATHER_BYTES


def decode_inputs(block_tables: torch.Tensor, lengths: list[int], block_size: int,
                  window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """decode_attention's blocks [B, blocks] (the longest context's count) and key mask [B, 1, 1, keys]
    for one query row per sequence, each the last position of a context of lengths[b] tokens."""
    blocks = block_tables[:, : -(-max(lengths) // block_size)].long()
    keys = torch.arange(blocks.shape[1] * block_size)[None, :]
    last = torch.tensor(lengths)[:, None] - 1
    mask = keys <= last
    if window > 0:
        mask &= keys > last - window
    return blocks, mask[:, None, None, :]


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, blocks: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """query [B, Hq, D], one row per sequence: one SDPA call over the contexts padded to the
    longest (decode_inputs), the padding masked. Returns [B, Hq, D]."""
    key = kv_cache[0][blocks].flatten(1, 2)  # [B, padded length, Hkv, D]
    value = kv_cache[1][blocks].flatten(1, 2)
    out = F.scaled_dot_product_attention(query[:, :, None], key.transpose(1, 2), value.transpose(1, 2),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out[:, :, 0]
