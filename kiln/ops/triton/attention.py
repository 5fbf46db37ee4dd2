"""Paged attention over the KV cache, and the KV-cache write, as Triton kernels.

The cache of one layer is [2, num_blocks, block_size, num_kv_heads, head_dim]: keys at
index 0, values at 1. Token t of sequence i lives in block block_tables[i, t // block_size]
at offset t % block_size.

Attention is one launch for a whole mixed batch (prefill chunks and decode tokens packed
along the token dim). A program takes one sequence, one kv head, and a tile of BLOCK_Q
query tokens times the GROUP query heads that share that kv head; the tile's rows are
(query token, head) pairs, so GQA costs no extra reads of K and V. It walks the context in
tiles of BLOCK_N keys, gathering each key's cache slot through the block table, and keeps
an online softmax in fp32.

The grid depends only on tensor shapes and Python ints, never on device values, so the
launch can be captured in a CUDA graph: sequence i owns the query tiles starting at
query_start_loc[i] // BLOCK_Q + i (enough for its ceil(query_len / BLOCK_Q) tiles), and
each program finds its sequence by binary search over those starts; spare programs exit.

With few sequences and long contexts (decode) a launch may split each context into
kv_splits ranges handled by separate programs (flash-decoding); a second small kernel
merges the partial softmaxes.

Rows of `out` past the batch's last query (query_start_loc[-1] onwards: padding up to a
CUDA-graph bucket) are left untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.forward_context import AttentionMetadata

MAX_KV_SPLITS = 16
# Below this many keys a decode context is not worth splitting.
MIN_KEYS_PER_SPLIT = 128
# Programs per SM a decode launch aims for before it splits contexts (measured on the H200
# with benchmarks/attention_tiles.py: 1 per SM left batch 8 at 2k tokens 1.8x slower).
PROGRAMS_PER_SM = 4


# ---------------------------------------------------------------------------- KV write


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
                     key_token_stride, key_head_stride, value_token_stride, value_head_stride,
                     cache_block_stride, cache_slot_stride, cache_head_stride, num_kv_heads, block_size,
                     HEAD_DIM: tl.constexpr,
                     BLOCK_HEADS: tl.constexpr, BLOCK_DIM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token
        return
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_DIM)[None, :]
    mask = (heads < num_kv_heads) & (dims < HEAD_DIM)
    cache_offsets = ((slot // block_size) * cache_block_stride + (slot % block_size) * cache_slot_stride
                     + heads * cache_head_stride + dims)
    key = tl.load(key_ptr + token * key_token_stride + heads * key_head_stride + dims, mask=mask)
    tl.store(key_cache_ptr + cache_offsets, key, mask=mask)
    value = tl.load(value_ptr + token * value_token_stride + heads * value_head_stride + dims, mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value, mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """kv_cache[0 / 1] at slot_mapping[t] = key / value [t]; slot -1 (padding) is skipped.

    key, value: [T, Hkv, D], any token and head strides (views of a fused qkv output are
    fine) but a contiguous last dim.
    """
    _check_cache(kv_cache)
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    num_tokens = slot_mapping.shape[0]
    for name, x in (("key", key), ("value", value)):
        if x.dim() != 3 or x.shape[1:] != (num_kv_heads, head_dim) or x.shape[0] < num_tokens:
            raise ValueError(f"write_kv: {name} must be [>= {num_tokens}, {num_kv_heads}, {head_dim}] "
                             f"like the cache, got {tuple(x.shape)}")
        if x.stride(2) != 1:
            raise ValueError(f"write_kv: {name}'s last dim must be contiguous, got strides {x.stride()}")
        if x.dtype != kv_cache.dtype:
            raise ValueError(f"write_kv: {name} is {x.dtype} but the cache is {kv_cache.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"write_kv: slot_mapping must be 1-D int32/int64, got {tuple(slot_mapping.shape)} "
                         f"{slot_mapping.dtype}")
    if num_tokens == 0:
        return
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), num_kv_heads, kv_cache.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_HEADS=triton.next_power_of_2(num_kv_heads), BLOCK_DIM=triton.next_power_of_2(head_dim),
        num_warps=4,
    )


# ---------------------------------------------------------------------------- attention


@triton.jit
def _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence i whose first query tile, query_start_loc[i] // BLOCK_Q + i, is <= tile."""
    low = tile * 0  # an int32 tensor (num_seqs == 1 may arrive as a constant)
    high = low + num_seqs - 1
    while low < high:
        middle = (low + high + 1) // 2
        first_tile = tl.load(query_start_loc_ptr + middle) // BLOCK_Q + middle
        low = tl.where(first_tile <= tile, middle, low)
        high = tl.where(first_tile <= tile, high, middle - 1)
    return low


@triton.jit
def _attend(q, query_pos, key_begin, key_end, block_table_ptr, key_cache_ptr, value_cache_ptr,
            cache_block_stride, cache_slot_stride, block_size, scale_log2, HEAD_DIM: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DIM: tl.constexpr,
            DOT_PRECISION: tl.constexpr):
    """Online softmax of q [BLOCK_M, BLOCK_DIM] over keys [key_begin, key_end), causal by query_pos.

    key_cache_ptr / value_cache_ptr already point at this program's kv head. Returns the
    unnormalised (acc, row_max, row_sum), scores in log2 units; a row that saw no key has
    row_max -inf and row_sum 0.
    """
    acc = tl.zeros([BLOCK_M, BLOCK_DIM], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    dims = tl.arange(0, BLOCK_DIM)
    dim_mask = dims < HEAD_DIM
    for tile_begin in range(key_begin, key_end, BLOCK_N):
        keys = tile_begin + tl.arange(0, BLOCK_N)
        in_range = keys < key_end
        block = tl.load(block_table_ptr + keys // block_size, mask=in_range, other=0).to(tl.int64)
        slots = block * cache_block_stride + (keys % block_size) * cache_slot_stride
        # Out-of-range slots load zeros, not whatever the cache holds: 0 * NaN would poison the dot.
        k_t = tl.load(key_cache_ptr + slots[None, :] + dims[:, None],
                      mask=in_range[None, :] & dim_mask[:, None], other=0.0)
        scores = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2
        visible = in_range[None, :] & (keys[None, :] <= query_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # A row with nothing visible yet keeps max -inf; subtract 0 then, not -inf (inf - inf = nan).
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp2(scores - safe_max[:, None])
        correction = tl.exp2(row_max - safe_max)
        row_sum = row_sum * correction + tl.sum(p, axis=1)
        v = tl.load(value_cache_ptr + slots[:, None] + dims[None, :],
                    mask=in_range[:, None] & dim_mask[None, :], other=0.0)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max
    return acc, row_max, row_sum


# num_seqs changes with the batch: specialising on its value (1, multiples of 16) would
# compile the kernel again for CUDA-graph buckets that need no new code.
@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr, num_seqs, scale_log2,
    query_token_stride, query_head_stride, out_token_stride, out_head_stride, block_table_stride,
    cache_block_stride, cache_slot_stride, cache_head_stride, block_size,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_DIM: tl.constexpr, KV_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP

    seq = _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    query_begin = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_begin
    first_row = (tile - (query_begin // BLOCK_Q + seq)) * BLOCK_Q
    if first_row >= query_len:  # a spare tile of this sequence
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len  # tokens before this step's first query

    rows = tl.arange(0, BLOCK_M)
    query_row = first_row + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (query_row < query_len)
    token = (query_begin + query_row).to(tl.int64)
    query_pos = context_len + query_row
    dims = tl.arange(0, BLOCK_DIM)
    io_mask = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(query_ptr + token[:, None] * query_token_stride + head[:, None] * query_head_stride
                + dims[None, :], mask=io_mask, other=0.0)

    # The tile's last query sees keys [0, key_end); a split takes a run of whole key tiles.
    key_end = tl.minimum(seq_len, context_len + first_row + BLOCK_Q)
    tiles_per_split = tl.cdiv(tl.cdiv(key_end, BLOCK_N), KV_SPLITS)
    key_begin = split * tiles_per_split * BLOCK_N
    key_end = tl.minimum(key_end, key_begin + tiles_per_split * BLOCK_N)

    acc, row_max, row_sum = _attend(
        q, query_pos, key_begin, key_end, block_tables_ptr + seq * block_table_stride,
        key_cache_ptr + kv_head * cache_head_stride, value_cache_ptr + kv_head * cache_head_stride,
        cache_block_stride, cache_slot_stride, block_size, scale_log2,
        HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_DIM, DOT_PRECISION,
    )
    if KV_SPLITS == 1:
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        out_ptrs = out_ptr + token[:, None] * out_token_stride + head[:, None] * out_head_stride + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        # partials are [tokens, query heads, KV_SPLITS (, BLOCK_DIM)], contiguous fp32
        partial_row = (token * (tl.num_programs(1) * GROUP) + head) * KV_SPLITS + split
        tl.store(partial_max_ptr + partial_row, row_max, mask=row_valid)
        tl.store(partial_sum_ptr + partial_row, row_sum, mask=row_valid)
        tl.store(partial_acc_ptr + partial_row[:, None] * BLOCK_DIM + dims[None, :], acc, mask=io_mask)


@triton.jit(do_not_specialize=["num_seqs"])
def _merge_splits_kernel(out_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr, query_start_loc_ptr,
                         num_seqs, out_token_stride, out_head_stride,
                         HEAD_DIM: tl.constexpr, BLOCK_DIM: tl.constexpr, KV_SPLITS: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_seqs):  # padding past the batch
        return
    partial_row = (token * tl.num_programs(1) + head) * KV_SPLITS
    splits = tl.arange(0, KV_SPLITS)
    split_max = tl.load(partial_max_ptr + partial_row + splits)
    split_sum = tl.load(partial_sum_ptr + partial_row + splits)
    # Every row sees key 0 in split 0, so the overall max is finite; empty splits weigh 0.
    weight = tl.exp2(split_max - tl.max(split_max, axis=0))
    dims = tl.arange(0, BLOCK_DIM)
    split_acc = tl.load(partial_acc_ptr + (partial_row + splits)[:, None] * BLOCK_DIM + dims[None, :])
    out = tl.sum(split_acc * weight[:, None], axis=0) / tl.sum(split_sum * weight, axis=0)
    tl.store(out_ptr + token * out_token_stride + head * out_head_stride + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


@dataclass(frozen=True)
class AttentionTiles:
    block_m: int  # rows of a program's tile: (query token, head in group) pairs
    block_n: int  # keys per step of the context loop
    num_warps: int


def choose_tiles(max_query_len: int, group: int, head_dim: int) -> AttentionTiles:
    # tl.dot needs at least 16 rows; a decode tile is one token's GROUP heads, padded to 16.
    rows_needed = triton.next_power_of_2(group)
    block_m = max(16 if max_query_len == 1 else 64, rows_needed)
    # Decode tiles hold one token's heads, so wider key tiles are what keeps loads in flight
    # (128 keys: 1.1-1.7x faster than 64 for decode on the H200, benchmarks/attention_tiles.py).
    block_n = (128 if max_query_len == 1 else 64) if head_dim <= 128 else 32
    return AttentionTiles(block_m=block_m, block_n=block_n, num_warps=4)


_sm_count: dict[int, int] = {}


def _multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter on CPU: pretend to be an H100/H200
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_count:
        _sm_count[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_count[index]


def choose_kv_splits(meta: AttentionMetadata, num_kv_heads: int, device: torch.device) -> int:
    """How many ranges each context is cut into: >1 only for decode batches too small to fill the GPU.

    Any value gives the same result; it depends on meta's Python ints (not device data), so
    a CUDA graph captured with one meta stays correct, if not optimal, for other lengths.
    """
    if meta.max_query_len != 1:
        return 1
    programs = max(meta.seq_lens.shape[0], 1) * num_kv_heads
    by_occupancy = PROGRAMS_PER_SM * _multiprocessor_count(device) // programs
    by_length = meta.max_seq_len // MIN_KEYS_PER_SPLIT
    splits = min(by_occupancy, by_length, MAX_KV_SPLITS)
    return 1 if splits < 2 else 2 ** int(math.log2(splits))


def _check_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, kv_heads, head_dim], "
                         f"got {tuple(kv_cache.shape)}")
    if kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache's last dim must be contiguous, got strides {kv_cache.stride()}")


def _check_attention_inputs(query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                            meta: AttentionMetadata) -> None:
    _check_cache(kv_cache)
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    if query.dim() != 3 or query.shape[2] != head_dim or query.shape[1] % num_kv_heads != 0:
        raise ValueError(f"paged_attention: query must be [T, Hq, {head_dim}] with Hq a multiple of "
                         f"{num_kv_heads} kv heads, got {tuple(query.shape)}")
    if out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(f"paged_attention: out {tuple(out.shape)} {out.dtype} must match query "
                         f"{tuple(query.shape)} {query.dtype}")
    if query.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("paged_attention: query's and out's last dims must be contiguous")
    if query.dtype != kv_cache.dtype:
        raise ValueError(f"paged_attention: query is {query.dtype} but the cache is {kv_cache.dtype}")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"paged_attention: dtype {query.dtype} is not supported")
    num_seqs = meta.seq_lens.shape[0]
    if meta.query_start_loc.shape[0] != num_seqs + 1 or meta.block_tables.shape[0] != num_seqs:
        raise ValueError(f"paged_attention: metadata for {num_seqs} sequences needs query_start_loc "
                         f"[{num_seqs + 1}] and block_tables [{num_seqs}, max_blocks]; got "
                         f"{tuple(meta.query_start_loc.shape)} and {tuple(meta.block_tables.shape)}")
    for name in ("seq_lens", "query_start_loc", "block_tables"):
        if getattr(meta, name).dtype != torch.int32:
            raise ValueError(f"paged_attention: meta.{name} must be int32, got {getattr(meta, name).dtype}")
    if meta.block_tables.stride(1) != 1:
        raise ValueError("paged_attention: meta.block_tables' rows must be contiguous")


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                    meta: AttentionMetadata, scale: float, *, kv_splits: int | None = None,
                    tiles: AttentionTiles | None = None) -> None:
    """out[t] = causal attention of query[t] over its sequence's paged context (out is written in place).

    query, out: [T, Hq, D] (query may be a strided view); kv_cache: [2, blocks, block_size, Hkv, D].
    kv_splits: ranges per context (a power of two); None picks one from the batch shape.
    tiles: the tile shape; None picks one (benchmarks/attention_tiles.py compares them).
    """
    _check_attention_inputs(query, kv_cache, out, meta)
    num_seqs = meta.seq_lens.shape[0]
    if num_seqs == 0 or query.shape[0] == 0:
        return
    num_heads = query.shape[1]
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    group = num_heads // num_kv_heads
    tiles = tiles or choose_tiles(meta.max_query_len, group, head_dim)
    splits = choose_kv_splits(meta, num_kv_heads, query.device) if kv_splits is None else kv_splits
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"paged_attention: kv_splits must be a power of two, got {splits}")
    block_q = tiles.block_m // group
    block_dim = max(triton.next_power_of_2(head_dim), 16)
    num_tiles = query.shape[0] // block_q + num_seqs
    partial_acc = partial_max = partial_sum = out  # unused placeholders when not split
    if splits > 1:
        partial_max = torch.empty(query.shape[0], num_heads, splits, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty_like(partial_max)
        partial_acc = torch.empty(*partial_max.shape, block_dim, dtype=torch.float32, device=query.device)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _paged_attention_kernel[(num_tiles, num_kv_heads, splits)](
        query, key_cache, value_cache, out, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        partial_acc, partial_max, partial_sum, num_seqs, scale * math.log2(math.e),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), kv_cache.shape[2],
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_DIM=block_dim, KV_SPLITS=splits,
        # fp32 inputs would otherwise be multiplied in tf32 on the GPU
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps,
    )
    if splits > 1:
        _merge_splits_kernel[(query.shape[0], num_heads)](
            out, partial_acc, partial_max, partial_sum, meta.query_start_loc, num_seqs,
            out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_DIM=block_dim, KV_SPLITS=splits,
            num_warps=4,
        )
