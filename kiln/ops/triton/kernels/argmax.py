"""Row-wise argmax as a Triton kernel (the device code; kiln.ops.triton.argmax launches it), and
with Gumbel noise added to the values a row keeps: a sample."""

import triton
import triton.language as tl


@triton.jit
def argmax_kernel(x_ptr, out_ptr, part_value_ptr, part_index_ptr, counter_ptr, width, x_row_stride,
                  threshold_ptr, seed_ptr, temperature_ptr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
                  GUMBEL: tl.constexpr, SCALED: tl.constexpr, PDL: tl.constexpr):
    """out[row] = the first index of row's largest value (NaN counts as +inf). A program takes
    BLOCK columns of a row; the last of a row's CHUNKS programs to finish reduces their partials.
    GUMBEL: the values below threshold[row] count as -inf and the others get -log(-log(u)) added,
    u uniform from Philox at (seed[row], column): a draw from softmax(x) over the kept columns
    that depends on the row's seed alone. SCALED: x is x / temperature[row] first, rounded as
    torch divides (so the scaled logits need not be written out)."""
    if PDL:  # programmatic dependent launch: kiln.ops.triton.dependent_launch
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < width, other=float("-inf")).to(tl.float32)
    if SCALED:
        x = tl.math.div_rn(x, tl.load(temperature_ptr + row))
    x = tl.where(x != x, float("inf"), x)
    if GUMBEL:
        # rand can return exactly 0: its noise, -inf, would lose a row's only kept column to column 0.
        u = tl.maximum(tl.rand(tl.load(seed_ptr + row), cols), 1e-12)
        x = tl.where((x >= tl.load(threshold_ptr + row)) & (cols < width), x - tl.log(-tl.log(u)), float("-inf"))
    value, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    if CHUNKS == 1:
        tl.store(out_ptr + row, index.to(tl.int64))
        return
    tl.store(part_value_ptr + row * CHUNKS + chunk, value)
    tl.store(part_index_ptr + row * CHUNKS + chunk, chunk * BLOCK + index)
    # Release the partial before the arrival; the last arriver's acquire sees every program's (read at L2).
    tl.debug_barrier()
    if tl.atomic_add(counter_ptr + row, 1, sem="acq_rel", scope="gpu") == CHUNKS - 1:
        chunks = tl.arange(0, CHUNKS)
        values = tl.load(part_value_ptr + row * CHUNKS + chunks, cache_modifier=".cg")
        # The indices load beside the values: not a second round trip after choosing.
        indices = tl.load(part_index_ptr + row * CHUNKS + chunks, cache_modifier=".cg")
        best = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)[1]
        tl.store(out_ptr + row, tl.sum(tl.where(chunks == best, indices, 0), axis=0).to(tl.int64))
        tl.atomic_xchg(counter_ptr + row, 0, sem="relaxed", scope="gpu")
