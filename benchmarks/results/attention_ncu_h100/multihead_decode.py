"""Experiment: decode attention with HP kv heads per program (3-D batched tl.dot), to amortise a
short context's per-program prologue and load HP*256 contiguous bytes a key. Not kiln code."""
import math
import torch
import triton
import triton.language as tl


@triton.jit
def mh_decode_kernel(query_ptr, key_cache_ptr, value_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr,
                     scale_log2, query_token_stride, query_head_stride, out_token_stride, out_head_stride,
                     block_table_stride, cache_block_stride, cache_slot_stride, cache_head_stride,
                     GROUP: tl.constexpr, HP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    head_group = tl.program_id(0)
    seq = tl.program_id(1)
    seq_len = tl.max(tl.load(seq_lens_ptr + seq + tl.arange(0, 1)), axis=0)  # 0-d in the interpreter too
    hp = tl.arange(0, HP)[:, None, None]
    rows = tl.arange(0, BLOCK_G)[None, :, None]
    dims_last = tl.arange(0, HEAD_DIM)[None, None, :]
    kv_head = head_group * HP + hp  # [HP, 1, 1]
    q_head = kv_head * GROUP + rows  # [HP, BLOCK_G, 1]
    row_ok = rows < GROUP
    q = tl.load(query_ptr + seq.to(tl.int64) * query_token_stride + q_head * query_head_stride + dims_last,
                mask=row_ok, other=0.0)
    acc = tl.zeros([HP, BLOCK_G, HEAD_DIM], dtype=tl.float32)
    row_max = tl.full([HP, BLOCK_G], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([HP, BLOCK_G], dtype=tl.float32)
    table = block_tables_ptr + seq * block_table_stride
    dims_mid = tl.arange(0, HEAD_DIM)[None, :, None]
    for tile_begin in range(0, seq_len, BLOCK_N):
        keys = tile_begin + tl.arange(0, BLOCK_N)
        in_range = keys < seq_len
        block = tl.load(table + keys // BLOCK_SIZE, mask=in_range, other=0)
        slots = block * cache_block_stride + (keys % BLOCK_SIZE) * cache_slot_stride
        k_t = tl.load(key_cache_ptr + kv_head * cache_head_stride + dims_mid + slots[None, None, :],
                      mask=in_range[None, None, :], other=0.0)  # [HP, HEAD_DIM, BLOCK_N]
        scores = tl.dot(q, k_t)  # [HP, BLOCK_G, BLOCK_N]
        scores = tl.where(in_range[None, None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=2))
        p = tl.exp2(scores * scale_log2 - (new_max * scale_log2)[:, :, None])
        correction = tl.exp2((row_max - new_max) * scale_log2)
        row_sum = row_sum * correction + tl.sum(p, axis=2)
        v = tl.load(value_cache_ptr + kv_head * cache_head_stride + slots[None, :, None] + dims_last,
                    mask=in_range[None, :, None], other=0.0)  # [HP, BLOCK_N, HEAD_DIM]
        acc = acc * correction[:, :, None] + tl.dot(p.to(v.dtype), v)
        row_max = new_max
    out = acc / row_sum[:, :, None]
    tl.store(out_ptr + seq.to(tl.int64) * out_token_stride + q_head * out_head_stride + dims_last,
             out.to(out_ptr.dtype.element_ty), mask=row_ok)


def mh_decode(query, kv_cache, out, block_tables, seq_lens, scale, hp=2, block_n=32, num_warps=4, num_stages=2):
    num_seqs = seq_lens.shape[0]
    num_heads = query.shape[1]
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    group = num_heads // num_kv_heads
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    mh_decode_kernel[(num_kv_heads // hp, num_seqs)](
        query, key_cache, value_cache, out, block_tables, seq_lens, scale * math.log2(math.e),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        GROUP=group, HP=hp, BLOCK_G=max(16, group), HEAD_DIM=head_dim, BLOCK_N=block_n,
        BLOCK_SIZE=kv_cache.shape[2], num_warps=num_warps, num_stages=num_stages)
