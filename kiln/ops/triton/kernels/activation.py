"""SiLU-and-mul as a Triton kernel (the device code; kiln.ops.triton.activation launches it)."""

import triton
import triton.language as tl


@triton.jit
def silu_and_mul_kernel(x_ptr, out_ptr, x_row_stride, out_row_stride, width, BLOCK: tl.constexpr):
    row_index = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    row_ptr = x_ptr + row_index * x_row_stride
    gate = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row_ptr + width + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    # Round silu(gate) to the input dtype before the product, as `F.silu(gate) * up` does.
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row_index * out_row_stride + cols, (silu * up).to(dtype), mask=mask)
