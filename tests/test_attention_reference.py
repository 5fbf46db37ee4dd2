"""The CPU paged-attention reference against plain causal attention on contiguous tensors."""

import torch

from kiln.forward_context import AttentionMetadata
from kiln.ops.attention_reference import (
    causal_attention_reference,
    paged_attention_reference,
    write_kv_reference,
)


def _metadata(seq_lens, query_lens, block_size, num_blocks, gen):
    """Random (shuffled) block tables for sequences whose last query_lens tokens are queries."""
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, starts = [], [], [0]
    for length, q in zip(seq_lens, query_lens):
        table = [free.pop() for _ in range(-(-length // block_size))]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(length - q, length)]
        starts.append(starts[-1] + q)
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), num_actual_tokens=starts[-1], seq_lens_cpu=list(seq_lens),
        query_start_loc_cpu=starts)


def test_mixed_batch_matches_contiguous_causal_attention():
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, block_size = 6, 2, 16, 4
    seq_lens, query_lens = [9, 1, 13, 5], [9, 1, 4, 1]  # prefill, decode, chunk mid-prompt, decode
    full_k = [torch.randn(n, hkv, d, generator=gen) for n in seq_lens]
    full_v = [torch.randn(n, hkv, d, generator=gen) for n in seq_lens]
    full_q = [torch.randn(n, hq, d, generator=gen) for n in seq_lens]
    meta = _metadata(seq_lens, query_lens, block_size, 32, gen)
    cache = torch.full((2, 32, block_size, hkv, d), float("nan"))
    # Earlier steps wrote the context before this step's queries...
    for i, (n, q) in enumerate(zip(seq_lens, query_lens)):
        table = meta.block_tables[i].tolist()
        past = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n - q)],
                            dtype=torch.long)
        write_kv_reference(full_k[i][: n - q], full_v[i][: n - q], cache, past)
    # ...and this step writes its own tokens, then attends.
    key = torch.cat([k[n - q:] for k, n, q in zip(full_k, seq_lens, query_lens)])
    value = torch.cat([v[n - q:] for v, n, q in zip(full_v, seq_lens, query_lens)])
    query = torch.cat([x[n - q:] for x, n, q in zip(full_q, seq_lens, query_lens)])
    write_kv_reference(key, value, cache, meta.slot_mapping)
    out = torch.full_like(query, float("nan"))
    paged_attention_reference(query, cache, out, meta, d**-0.5)

    for i, (n, q) in enumerate(zip(seq_lens, query_lens)):
        expected = torch.empty(n, hq, d)
        causal_attention_reference(full_q[i], full_k[i], full_v[i], expected, [0, n], d**-0.5)
        s = meta.query_start_loc_cpu[i]
        torch.testing.assert_close(out[s:s + q], expected[n - q:], rtol=1e-5, atol=1e-5)


def test_padding_slots_are_not_written():
    cache = torch.zeros(2, 2, 4, 1, 8)
    key = torch.ones(3, 1, 8)
    write_kv_reference(key, key, cache, torch.tensor([0, -1, 5]))
    assert cache[0].flatten(0, 1)[[0, 5]].eq(1).all()
    assert cache.sum() == 2 * 2 * 8
