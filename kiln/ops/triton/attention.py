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
When no sequence has more than one query token (max_query_len == 1: decode), tile i is
sequence i and there is no search (its log2(num_seqs) dependent loads cost a short decode
context's program a large share of its life).

With few sequences and long contexts (decode) a launch may split each context into
kv_splits ranges handled by separate programs (flash-decoding). Each stores its partial
softmax, and the last of a tile's splits to finish (a per-tile counter in a persistent
zeroed buffer, which it zeroes again) merges them: no second launch, and capturable. The
ranges are whole key tiles, so a context shorter than kv_splits tiles (a graph captured for
the model's longest replayed on a short one) leaves the splits past its last tile idle: they
exit at once, and a context of one tile is written without a merge.

Rows of `out` past the batch's last query (query_start_loc[-1] onwards: padding up to a
CUDA-graph bucket) are left untouched.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import triton

from kiln.forward_context import AttentionMetadata
from kiln.ops.triton.dependent_launch import pdl_args
from kiln.ops.triton.device_buffers import kept_buffer
from kiln.ops.triton.kernels.attention import paged_attention_kernel, write_kv_kernel
from kiln.ops.triton.launch import launch

MAX_KV_SPLITS = 16
# Below this many keys a decode context is not worth splitting. A 256-wide head's 32-key tile
# is worth it: Gemma 2's 160-key contexts split 4 ways ran 1.5-1.7x faster at batches 1 and 8
# (benchmarks/attention_tiles.py --shape gemma-2-9b on the H200).
MIN_KEYS_PER_SPLIT = 128
WIDE_HEAD_MIN_KEYS_PER_SPLIT = 32
# Programs per SM a decode launch aims for before it splits contexts (measured on the H200
# with benchmarks/attention_tiles.py: 1 per SM left batch 8 at 2k tokens 1.8x slower).
PROGRAMS_PER_SM = 4
# Tiles x kv heads a split launch may have (its merge counters; a split decode batch has at
# most PROGRAMS_PER_SM x SMs / 2 of them).
MAX_SPLIT_PROGRAMS = 4096


# ---------------------------------------------------------------------------- KV write


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
    launch(write_kv_kernel, (num_tokens,),
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), num_kv_heads, kv_cache.shape[2],
        HEAD_DIM=head_dim, BLOCK_HEADS=_pow2(num_kv_heads), BLOCK_DIM=_pow2(head_dim), num_warps=4,
        **pdl_args(key.device),
    )


# A launch's shape-derived settings are computed once per shape: a forward calls these ops once a
# layer, and each call's host time is paid by every eager step and CUDA-graph capture
# (triton.next_power_of_2 alone took 2 us a call).
@functools.cache
def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


# ---------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class AttentionTiles:
    block_m: int  # rows of a program's tile: (query token, head in group) pairs
    block_n: int  # keys per step of the context loop
    num_warps: int
    num_stages: int | None = None  # software-pipelining depth; None: Triton's default
    heads_first: bool = False  # grid (kv heads, tiles, splits) rather than (tiles, kv heads, splits)
    max_registers: int | None = None  # ptxas's cap a thread (Triton's maxnreg); None: ptxas chooses


@functools.cache
def choose_tiles(max_query_len: int, group: int, head_dim: int, programs: int = 1,
                 device: torch.device | None = None, element_size: int = 2) -> AttentionTiles:
    """`programs`: sequences x kv heads of the launch (only decode looks at it); `element_size`:
    the bytes of the query's and cache's dtype."""
    # tl.dot needs at least 16 rows; a decode tile is one token's GROUP heads, padded to 16.
    rows_needed = _pow2(group)
    block_m = max(16 if max_query_len == 1 else 64, rows_needed)
    if max_query_len != 1:
        # Prefill: a sequence's kv heads side by side, with the kernel taking its query tiles last
        # first, start the tiles that see the most keys first (2048-token prompt on an H100: 132 ->
        # 107 us; alone, either order left it at 132).
        if head_dim > 128:
            return AttentionTiles(block_m=block_m, block_n=32, num_warps=4, heads_first=True)
        if max_query_len >= 1536 and element_size <= 2:
            # Long prompts amortize a taller tile's keys over twice the rows. Its fp32 accumulator
            # spills in 4 warps and leaves 8 warps one block a SM (186 registers); capped at 128, two
            # fit (H100, attention_ncu_h100/: 1536 tokens 65 -> 56 us, 2048 97 -> 87, 8192 1315 ->
            # 1255; at 1024 the 64-row tile stays faster). Not in fp32: ~200 KB of shared memory.
            return AttentionTiles(block_m=max(block_m, 128), block_n=64, num_warps=8, num_stages=3, heads_first=True,
                                  max_registers=128)
        return AttentionTiles(block_m=block_m, block_n=64, num_warps=4, num_stages=2, heads_first=True)
    sms = _multiprocessor_count(device or torch.device("cpu"))
    if head_dim > 128:
        # Gemma 2's decode (attention_tiles.py --shape gemma-2-9b): 32-key tiles pipelined 2 deep
        # at every batch (1.15-1.4x faster than unpipelined at 64 and 256), with 8 warps while the
        # programs do not fill the GPU (batches 1 and 8: 1.1-1.2x faster than 4).
        return AttentionTiles(block_m=block_m, block_n=32, num_warps=8 if programs < 2 * sms else 4, num_stages=2)
    # Decode (benchmarks/attention_tiles.py on the H200): a small batch, whose programs do not
    # fill the GPU, keeps more loads in flight with 128-key tiles (1.1-1.7x faster than 64). From a
    # few programs per SM on, benchmarks/decode_attention.py (each layer reading its own cache, as
    # in a step) chose 64-key tiles of 2 warps pipelined 3 deep (batch 64: 2-3% faster than 4 warps
    # 2 deep) and, from 6 per SM (batch 128, 256), 32-key tiles of 2 warps (batch 128: 8% faster);
    # a sequence's kv heads launched side by side were 0-2% faster than head by head. A CUDA graph
    # is captured for every context length, so the tiles follow the batch alone.
    if programs >= 6 * sms:
        return AttentionTiles(block_m=block_m, block_n=32, num_warps=2, num_stages=2, heads_first=True)
    if programs >= 2 * sms:
        return AttentionTiles(block_m=block_m, block_n=64, num_warps=2, num_stages=3, heads_first=True)
    return AttentionTiles(block_m=block_m, block_n=128, num_warps=4)


_sm_count: dict[int, int] = {}


def _multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter on CPU: pretend to be an H100/H200
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_count:
        _sm_count[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_count[index]


def choose_kv_splits(meta: AttentionMetadata, num_kv_heads: int, device: torch.device, head_dim: int = 128) -> int:
    """How many ranges each context is cut into: >1 only for decode batches too small to fill the GPU.

    Any value gives the same result up to rounding; it depends on meta's Python ints (not device
    data), so a CUDA graph captured with one meta stays correct, if not optimal, for other
    lengths. The engine passes the model's length bound as max_seq_len for every decode step,
    graph or not, so a sequence's count (and rounding) does not depend on whether a graph ran.
    """
    if meta.max_query_len != 1:
        return 1
    return _kv_splits(meta.seq_lens.shape[0], num_kv_heads, meta.max_seq_len, device, head_dim)


@functools.cache
def _kv_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device, head_dim: int) -> int:
    programs = max(num_seqs, 1) * num_kv_heads
    by_occupancy = PROGRAMS_PER_SM * _multiprocessor_count(device) // programs
    by_length = max_seq_len // (MIN_KEYS_PER_SPLIT if head_dim <= 128 else WIDE_HEAD_MIN_KEYS_PER_SPLIT)
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
                    meta: AttentionMetadata, scale: float, *, window: int = 0, softcap: float = 0.0,
                    kv_splits: int | None = None,
                    tiles: AttentionTiles | None = None) -> None:
    """out[t] = causal attention of query[t] over its sequence's paged context (out is written in place);
    window > 0: over the last `window` positions only (the keys before are masked, not skipped);
    softcap > 0: each score s is softcap * tanh(s / softcap) before the softmax.

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
    chosen = tiles is None
    tiles = tiles or choose_tiles(meta.max_query_len, group, head_dim, num_seqs * num_kv_heads, query.device,
                                  query.element_size())
    splits = choose_kv_splits(meta, num_kv_heads, query.device, head_dim) if kv_splits is None else kv_splits
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"paged_attention: kv_splits must be a power of two, got {splits}")
    block_q = tiles.block_m // group
    block_dim = max(_pow2(head_dim), 16)
    one_query = meta.max_query_len == 1
    num_tiles = num_seqs if one_query else query.shape[0] // block_q + num_seqs
    partial_acc = partial_max = partial_sum = out  # unused placeholders when not split
    counters = _merge_counters(query.device)
    if splits > 1:
        if num_tiles * num_kv_heads > MAX_SPLIT_PROGRAMS:
            raise ValueError(f"paged_attention: {num_tiles} tiles x {num_kv_heads} kv heads split {splits} ways "
                             f"exceed the {MAX_SPLIT_PROGRAMS} merge counters; use fewer kv_splits (1 for this batch)")
        partial_max = torch.empty(query.shape[0], num_heads, splits, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty_like(partial_max)
        partial_acc = torch.empty(*partial_max.shape, block_dim, dtype=torch.float32, device=query.device)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    if tiles.heads_first and num_tiles > MAX_GRID_TILES:  # a grid's second dimension
        if not chosen:
            raise ValueError(f"paged_attention: heads_first tiles take at most {MAX_GRID_TILES} tiles, got "
                             f"{num_tiles}; pass tiles with heads_first=False")
        tiles = replace(tiles, heads_first=False)
    grid = (num_kv_heads, num_tiles, splits) if tiles.heads_first else (num_tiles, num_kv_heads, splits)
    launch(paged_attention_kernel, grid,
        query, key_cache, value_cache, out, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        partial_acc, partial_max, partial_sum, counters, num_seqs, scale * math.log2(math.e),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), window, softcap * math.log2(math.e),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_DIM=block_dim,
        # A constant: a key's block and offset are then a shift and a mask, not a division by a
        # runtime int (~20 instructions a key of every tile).
        BLOCK_SIZE=kv_cache.shape[2], KV_SPLITS=splits,
        # fp32 inputs would otherwise be multiplied in tf32 on the GPU
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", ONE_QUERY=one_query,
        HAS_WINDOW=window > 0, HAS_SOFTCAP=softcap > 0, HEADS_FIRST=tiles.heads_first,
        OFFSETS_64=needs_64bit_offsets(key_cache),
        num_warps=tiles.num_warps, **pdl_args(query.device),
        **({"num_stages": tiles.num_stages} if tiles.num_stages is not None else {}),
        **({"maxnreg": tiles.max_registers} if tiles.max_registers is not None else {}),
    )


def needs_64bit_offsets(cache: torch.Tensor) -> bool:
    """Whether an element offset into one half of a layer's cache (its keys or its values) may
    not fit in int32. Most caches fit, and 32-bit offsets halve the integer work of gathering K
    and V through the block table (the sm_90 code of a key tile: 577 -> 465 instructions in a
    prefill, 741 -> 600 in a batch-64 decode)."""
    return cache.shape[0] * cache.stride(0) > MAX_INT32_OFFSET


MAX_INT32_OFFSET = 2**31 - 1
MAX_GRID_TILES = 65535  # CUDA's limit on a grid's second (and third) dimension


def _merge_counters(device: torch.device) -> torch.Tensor:
    return kept_buffer("attention merge counters", MAX_SPLIT_PROGRAMS, torch.int32, device)
