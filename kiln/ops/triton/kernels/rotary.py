"""Rotary position embedding as a Triton kernel (the device code; kiln.ops.triton.rotary launches it)."""

import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, token, x_token_stride, num_heads, cos, sin, partner_cols, sign, dtype: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_DIM: tl.constexpr):
    """A token's heads of x rotated, in `dtype`, with their (heads, cols, mask); stored by the caller
    after every load (a store ahead of a load keeps the load waiting behind it: they may alias)."""
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    cols = tl.arange(0, BLOCK_DIM)[None, :]
    mask = (heads < num_heads) & (cols < HEAD_DIM)
    head_ptrs = x_ptr + token * x_token_stride + heads * HEAD_DIM
    x = tl.load(head_ptrs + cols, mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(head_ptrs + partner_cols, mask=mask, other=0.0).to(tl.float32)
    # Each product rounded, then the sum, as rotary_native's ops round: a compiled model (whose
    # Inductor rotation emulates those casts) and this kernel then agree bit for bit.
    x_cos = (x * cos).to(dtype).to(tl.float32)
    partner_sin = (partner * sin).to(dtype).to(tl.float32)
    out = (x_cos + sign * partner_sin).to(dtype)
    return out, heads, cols, mask


# num_slots follows the batch: specialising on its value (1, multiples of 16) would compile the
# kernel again for CUDA-graph buckets that need no new code.
@triton.jit(do_not_specialize=["num_slots"])
def rotary_kernel(positions_ptr, q_ptr, k_ptr, cache_ptr, q_out_ptr, k_out_ptr,
                   q_token_stride, k_token_stride, cache_row_stride, num_q_heads, num_kv_heads,
                   v_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, v_token_stride,
                   cache_block_stride, cache_slot_stride, cache_head_stride, block_size, num_slots,
                   HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr, BLOCK_DIM: tl.constexpr,
                   BLOCK_Q_HEADS: tl.constexpr, BLOCK_KV_HEADS: tl.constexpr, WRITE_KV: tl.constexpr,
                   PDL: tl.constexpr):
    """Rotate token `program_id`'s q and k heads; WRITE_KV: also store its rotated k and its v in the
    paged KV cache at slot_mapping[token] (no store for slot -1, padding, or past num_slots), as
    kiln.ops.triton.attention's write_kv does, from the values the rotation left in registers."""
    if PDL:  # programmatic dependent launch: kiln.ops.triton.dependent_launch
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    if WRITE_KV:
        # Loaded first: neither depends on the rotation, so their memory round trips overlap its
        # (loaded where they are stored, the sm_90 code waited for the slot, then for v, at the end).
        slot = tl.load(slot_mapping_ptr + token, mask=token < num_slots, other=-1).to(tl.int64)
        v_heads = tl.arange(0, BLOCK_KV_HEADS)[:, None]
        v_cols = tl.arange(0, BLOCK_DIM)[None, :]
        value = tl.load(v_ptr + token * v_token_stride + v_heads * HEAD_DIM + v_cols,
                        mask=(v_heads < num_kv_heads) & (v_cols < HEAD_DIM))
    half: tl.constexpr = ROTARY_DIM // 2
    cols = tl.arange(0, BLOCK_DIM)[None, :]
    rotated = cols < ROTARY_DIM
    first_half = cols < half
    freq = tl.where(first_half, cols, cols - half)
    cache_row = cache_ptr + position * cache_row_stride
    cos = tl.load(cache_row + freq, mask=rotated, other=1.0)
    sin = tl.load(cache_row + half + freq, mask=rotated, other=0.0)
    dtype = q_ptr.dtype.element_ty
    cos, sin = cos.to(dtype).to(tl.float32), sin.to(dtype).to(tl.float32)
    partner_cols = tl.where(first_half, cols + half, tl.where(rotated, cols - half, cols))
    sign = tl.where(first_half, -1.0, 1.0)
    q_rot, q_heads, q_cols, q_mask = _rotate_heads(q_ptr, token, q_token_stride, num_q_heads, cos, sin, partner_cols,
                                                   sign, q_out_ptr.dtype.element_ty, HEAD_DIM, BLOCK_Q_HEADS, BLOCK_DIM)
    k_rot, heads, cols, mask = _rotate_heads(k_ptr, token, k_token_stride, num_kv_heads, cos, sin, partner_cols,
                                             sign, k_out_ptr.dtype.element_ty, HEAD_DIM, BLOCK_KV_HEADS, BLOCK_DIM)
    tl.store(q_out_ptr + token * num_q_heads * HEAD_DIM + q_heads * HEAD_DIM + q_cols, q_rot, mask=q_mask)
    tl.store(k_out_ptr + token * num_kv_heads * HEAD_DIM + heads * HEAD_DIM + cols, k_rot, mask=mask)
    if WRITE_KV:
        if slot >= 0:  # -1: padding, or a token past num_slots
            offsets = ((slot // block_size) * cache_block_stride + (slot % block_size) * cache_slot_stride
                       + heads * cache_head_stride + cols)
            tl.store(key_cache_ptr + offsets, k_rot, mask=mask)
            tl.store(value_cache_ptr + offsets, value, mask=mask)
