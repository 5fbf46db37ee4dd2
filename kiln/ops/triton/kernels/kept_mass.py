"""The softmax mass a row keeps above its threshold, in chunks (the device code;
kiln.ops.triton.kept_mass launches it)."""

import triton
import triton.language as tl


@triton.jit
def kept_mass_kernel(x_ptr, temperature_ptr, top_ptr, threshold_ptr, part_ptr, width, x_row_stride, chunks,
                     BLOCK: tl.constexpr):
    """part[row, chunk] = the sum over the chunk's BLOCK columns of exp(s - top[row]) where
    s = x / temperature[row] (rounded as torch divides) is at or above threshold[row]."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside, other=float("-inf")).to(tl.float32)
    s = tl.math.div_rn(x, tl.load(temperature_ptr + row))
    kept = inside & (s >= tl.load(threshold_ptr + row))
    tl.store(part_ptr + row * chunks + chunk, tl.sum(tl.where(kept, tl.exp(s - tl.load(top_ptr + row)), 0.0), axis=0))
