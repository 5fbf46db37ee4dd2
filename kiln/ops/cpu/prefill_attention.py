"""A prefill chunk's attention on the CPU: torch's flash attention over the sequence's gathered context.

torch's CPU flash attention multiplies in the cache's dtype with oneDNN (AMX for bf16 where the
CPU has it) and accumulates in fp32; the C++ paged kernel converts K and V to fp32 tiles for every
query tile. On the 2-core dev machine, bf16 SmolLM2 shapes (9 query heads, 3 KV heads, dim 64),
one layer: 2048 queries over 8000 keys 84 vs 676 ms, 168 over 8000 8.9 vs 63 ms, 8 over 2000
0.6 vs 2.0 ms, with the same error against an fp64 reference (2.3e-3 vs 1.7e-3 relative in bf16,
4e-7 in fp32). Gathering the context costs ~1.7 ms for 8000 tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

# A sequence with at least this many queries in a step takes this path; decode rows stay in the
# C++ kernel, which serves every sequence of a step in one call.
MIN_QUERIES = 8


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
    if window > 0:
        positions = torch.arange(length - n, length)[:, None]
        keys = torch.arange(first, length)[None, :]
        mask = (keys <= positions) & (keys > positions - window)
    else:
        # A whole prompt (n == length) runs as is_causal, no mask; a later chunk gets an n x length
        # mask from torch (2048 x 8192 bools at most by default: 16 MB).
        mask = causal_lower_right(n, length)
    out = F.scaled_dot_product_attention(query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                         value.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)
