"""Paged attention and the KV-cache write as Triton kernels (the device code; kiln.ops.triton.attention
chooses tiles and splits and launches them)."""

import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
                     key_token_stride, key_head_stride, value_token_stride, value_head_stride,
                     cache_block_stride, cache_slot_stride, cache_head_stride, num_kv_heads, block_size,
                     HEAD_DIM: tl.constexpr,
                     BLOCK_HEADS: tl.constexpr, BLOCK_DIM: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # programmatic dependent launch: kiln.ops.triton.dependent_launch
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_DIM)[None, :]
    mask = (heads < num_kv_heads) & (dims < HEAD_DIM)
    # K and V are loaded with the slot, not after it: one memory round trip before the stores, not two.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    key = tl.load(key_ptr + token * key_token_stride + heads * key_head_stride + dims, mask=mask)
    value = tl.load(value_ptr + token * value_token_stride + heads * value_head_stride + dims, mask=mask)
    if slot < 0:  # a padding token
        return
    cache_offsets = ((slot // block_size) * cache_block_stride + (slot % block_size) * cache_slot_stride
                     + heads * cache_head_stride + dims)
    tl.store(key_cache_ptr + cache_offsets, key, mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value, mask=mask)


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
def _attend(q, query_pos, first_pos, key_begin, key_end, block_table_ptr, key_cache_ptr, value_cache_ptr,
            cache_block_stride, cache_slot_stride, scale_log2, window, softcap_log2,
            HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DIM: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, ONE_QUERY: tl.constexpr,
            HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, OFFSETS_64: tl.constexpr):
    """Online softmax of q [BLOCK_M, BLOCK_DIM] over keys [key_begin, key_end), causal by query_pos
    (and with HAS_WINDOW over each query's last `window` positions only; with HAS_SOFTCAP each
    score capped to softcap * tanh(score / softcap), softcap_log2 being softcap in log2 units).
    first_pos: the smallest position of a valid row (key_begin a multiple of BLOCK_N).

    key_cache_ptr / value_cache_ptr already point at this program's kv head. Returns the
    unnormalised (acc, row_max, row_sum), scores in log2 units; a row that saw no key has
    row_max -inf and row_sum 0.
    """
    acc = tl.zeros([BLOCK_M, BLOCK_DIM], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Tiles every valid row sees whole (in range, at or before its position, no window) skip the
    # masks: in a long prefill that is all but the diagonal's tiles. Decode keeps one loop: its
    # contexts are short in the steps that count, a second loop would start the last tile's loads
    # only after the first loop's (the pipeline does not cross loops), and its mask is the range alone.
    if HAS_WINDOW or ONE_QUERY:
        full_end = key_begin
    else:
        seen_by_all = tl.minimum(first_pos + 1, key_end) - key_begin
        full_end = key_begin + tl.maximum(seen_by_all, 0) // BLOCK_N * BLOCK_N
    for tile_begin in range(key_begin, full_end, BLOCK_N):
        acc, row_max, row_sum = _attend_tile(
            q, query_pos, tile_begin, key_end, acc, row_max, row_sum, block_table_ptr, key_cache_ptr,
            value_cache_ptr, cache_block_stride, cache_slot_stride, scale_log2, window, softcap_log2,
            HEAD_DIM, BLOCK_N, BLOCK_DIM, BLOCK_SIZE, DOT_PRECISION, ONE_QUERY, HAS_WINDOW, HAS_SOFTCAP, OFFSETS_64,
            False)
    for tile_begin in range(full_end, key_end, BLOCK_N):
        acc, row_max, row_sum = _attend_tile(
            q, query_pos, tile_begin, key_end, acc, row_max, row_sum, block_table_ptr, key_cache_ptr,
            value_cache_ptr, cache_block_stride, cache_slot_stride, scale_log2, window, softcap_log2,
            HEAD_DIM, BLOCK_N, BLOCK_DIM, BLOCK_SIZE, DOT_PRECISION, ONE_QUERY, HAS_WINDOW, HAS_SOFTCAP, OFFSETS_64,
            True)
    if not HAS_SOFTCAP:  # the tiles kept raw maxima
        row_max = row_max * scale_log2
    return acc, row_max, row_sum


@triton.jit
def _attend_tile(q, query_pos, tile_begin, key_end, acc, row_max, row_sum, block_table_ptr, key_cache_ptr,
                 value_cache_ptr, cache_block_stride, cache_slot_stride, scale_log2, window, softcap_log2,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, ONE_QUERY: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, OFFSETS_64: tl.constexpr, MASKED: tl.constexpr):
    """One key tile of _attend's online softmax; MASKED: some key of it is past key_end or hidden
    from some row. row_max is in the scores' units: log2 with HAS_SOFTCAP, raw dot products without."""
    keys = tile_begin + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_DIM)
    in_range = keys < key_end
    # A key's block and offset are a shift and a mask (BLOCK_SIZE is a constant).
    if MASKED:
        block = tl.load(block_table_ptr + keys // BLOCK_SIZE, mask=in_range, other=0)
    else:
        block = tl.load(block_table_ptr + keys // BLOCK_SIZE)
    if OFFSETS_64:
        block = block.to(tl.int64)
    slots = block * cache_block_stride + (keys % BLOCK_SIZE) * cache_slot_stride
    # Out-of-range slots load zeros, not whatever the cache holds: 0 * NaN would poison the dot.
    k_mask = (dims < HEAD_DIM)[:, None]
    v_mask = (dims < HEAD_DIM)[None, :]
    if MASKED:
        k_mask = k_mask & in_range[None, :]
        v_mask = v_mask & in_range[:, None]
    k_t = tl.load(key_cache_ptr + slots[None, :] + dims[:, None], mask=k_mask, other=0.0)
    scores = tl.dot(q, k_t, input_precision=DOT_PRECISION)
    if HAS_SOFTCAP:
        # In log2 units c * tanh(s / c) keeps its form with c scaled alike; tanh(x) = 1 - 2 / (e^2x + 1)
        # saturates to +-1 without overflow (e^2x = inf gives 1).
        scores = scores * scale_log2
        scores = softcap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap_log2) + 1.0))
        score_scale = 1.0
    else:
        # Raw scores, scaled inside the exponent: one FMA an element instead of a multiply and a subtract.
        score_scale = scale_log2
    if MASKED:
        visible = in_range[None, :]
        if not ONE_QUERY:  # a decode row's position is its context's last: in range is visible
            visible = visible & (keys[None, :] <= query_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (keys[None, :] > query_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    if MASKED:
        # A row with nothing visible yet keeps max -inf; subtract 0 then, not -inf (inf - inf = nan).
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    else:
        safe_max = new_max  # every row saw a key of this tile: finite
    p = tl.exp2(scores * score_scale - (safe_max * score_scale)[:, None])
    correction = tl.exp2((row_max - safe_max) * score_scale)
    row_sum = row_sum * correction + tl.sum(p, axis=1)
    v = tl.load(value_cache_ptr + slots[:, None] + dims[None, :], mask=v_mask, other=0.0)
    acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, new_max, row_sum


# num_seqs changes with the batch: specialising on its value (1, multiples of 16) would
# compile the kernel again for CUDA-graph buckets that need no new code.
@triton.jit(do_not_specialize=["num_seqs"])
def paged_attention_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr, counter_ptr, num_seqs, scale_log2,
    query_token_stride, query_head_stride, out_token_stride, out_head_stride, block_table_stride,
    cache_block_stride, cache_slot_stride, cache_head_stride, window, softcap_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ONE_QUERY: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HEADS_FIRST: tl.constexpr,
    OFFSETS_64: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # programmatic dependent launch: kiln.ops.triton.dependent_launch
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # HEADS_FIRST: the grid is (kv heads, tiles, splits), so a sequence's kv heads run side by side
    if HEADS_FIRST:
        kv_head = tl.program_id(0)
        tile = tl.program_id(1)
        num_kv_heads = tl.num_programs(0)
    else:
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        num_kv_heads = tl.num_programs(1)
    if not ONE_QUERY:
        # A prompt's last query tiles see the most keys: they start first, and the short ones fill the tail.
        tile = (tl.num_programs(1) if HEADS_FIRST else tl.num_programs(0)) - 1 - tile
    split = tl.program_id(2)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP

    if ONE_QUERY:  # no sequence has more than one query token (decode): tile i is sequence i
        seq = tile
    else:
        seq = _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    query_begin = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_begin
    first_row = 0 if ONE_QUERY else (tile - (query_begin // BLOCK_Q + seq)) * BLOCK_Q
    if first_row >= query_len:  # a spare tile of this sequence (or a padding sequence)
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
    num_key_tiles = tl.cdiv(key_end, BLOCK_N)
    tiles_per_split = tl.cdiv(num_key_tiles, KV_SPLITS)
    if KV_SPLITS == 1:
        used_splits = 1
    else:
        # A graph captured for long contexts replays on short ones: splits past the last key
        # tile leave without a partial, and with one split left there is nothing to merge.
        used_splits = tl.cdiv(num_key_tiles, tiles_per_split)
        if split >= used_splits:
            return
    key_begin = split * tiles_per_split * BLOCK_N
    key_end = tl.minimum(key_end, key_begin + tiles_per_split * BLOCK_N)

    acc, row_max, row_sum = _attend(
        q, query_pos, context_len + first_row, key_begin, key_end, block_tables_ptr + seq * block_table_stride,
        key_cache_ptr + kv_head * cache_head_stride, value_cache_ptr + kv_head * cache_head_stride,
        cache_block_stride, cache_slot_stride, scale_log2, window, softcap_log2,
        HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_DIM, BLOCK_SIZE, DOT_PRECISION, ONE_QUERY, HAS_WINDOW, HAS_SOFTCAP,
        OFFSETS_64,
    )
    if used_splits == 1:  # with KV_SPLITS > 1, the merge's arithmetic on one split: the same bits
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        out_ptrs = out_ptr + token[:, None] * out_token_stride + head[:, None] * out_head_stride + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        # partials are [tokens, query heads, KV_SPLITS (, BLOCK_DIM)], contiguous fp32
        partial_row = (token * (num_kv_heads * GROUP) + head) * KV_SPLITS
        tl.store(partial_max_ptr + partial_row + split, row_max, mask=row_valid)
        tl.store(partial_sum_ptr + partial_row + split, row_sum, mask=row_valid)
        tl.store(partial_acc_ptr + (partial_row + split)[:, None] * BLOCK_DIM + dims[None, :], acc, mask=io_mask)
        # The last split of this tile to arrive merges them all, as the GEMV's split-K does: every
        # thread's partials are stored before the arrival is published (release), and the last
        # arriver's acquire makes the other programs' visible; it reads them at L2 (.cg).
        tl.debug_barrier()
        counter = counter_ptr + tile * num_kv_heads + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == used_splits - 1:
            splits = tl.arange(0, KV_SPLITS)
            # The unused splits' slots hold an earlier launch's partials: read as weighing nothing.
            used = row_valid[:, None] & (splits[None, :] < used_splits)
            split_max = tl.load(partial_max_ptr + partial_row[:, None] + splits[None, :], mask=used,
                                other=float("-inf"), cache_modifier=".cg")
            split_max = tl.where(row_valid[:, None], split_max, 0.0)  # rows past the tile's queries
            split_sum = tl.load(partial_sum_ptr + partial_row[:, None] + splits[None, :], mask=used,
                                other=0.0, cache_modifier=".cg")
            # Every row sees itself, so some split's max is finite; splits that saw nothing (before
            # a window, or past the end) weigh 0.
            top = tl.max(split_max, axis=1)
            total = tl.sum(split_sum * tl.exp2(split_max - top[:, None]), axis=1)
            merged = tl.zeros([BLOCK_M, BLOCK_DIM], dtype=tl.float32)
            for s in tl.static_range(KV_SPLITS):
                weight = tl.exp2(tl.load(partial_max_ptr + partial_row + s, mask=row_valid & (s < used_splits),
                                         other=float("-inf"), cache_modifier=".cg") - top)
                merged += weight[:, None] * tl.load(partial_acc_ptr + (partial_row + s)[:, None] * BLOCK_DIM
                                                    + dims[None, :], mask=io_mask & (s < used_splits), other=0.0,
                                                    cache_modifier=".cg")
            out = merged / tl.where(total == 0.0, 1.0, total)[:, None]
            out_ptrs = out_ptr + token[:, None] * out_token_stride + head[:, None] * out_head_stride + dims[None, :]
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
