"""Gated activations (SiLU-and-mul, GELU-tanh-and-mul) as a Triton kernel (the device code;
kiln.ops.triton.activation launches it)."""

import triton
import triton.language as tl

SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def gated_activation_kernel(x_ptr, out_ptr, x_row_stride, out_row_stride, width, BLOCK: tl.constexpr,
                            GELU_TANH: tl.constexpr):
    """out = act(gate) * up for x = [gate | up]; act is SiLU, or GELU's tanh form with GELU_TANH."""
    row_index = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    row_ptr = x_ptr + row_index * x_row_stride
    gate = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row_ptr + width + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    if GELU_TANH:
        inner = SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        # tanh(y) = 1 - 2 / (e^2y + 1): saturates to +-1 without overflow.
        act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    # Round act(gate) to the input dtype before the product, as `F.silu(gate) * up` does.
    act = act.to(dtype).to(tl.float32)
    tl.store(out_ptr + row_index * out_row_stride + cols, (act * up).to(dtype), mask=mask)
