"""Gated activations (SiLU-and-mul, GELU-tanh-and-mul) as a Triton kernel (the device code;
kiln.ops.triton.activation launches it)."""

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

GELU_BETA = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
GELU_KAPPA = tl.constexpr(0.044715)

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    @triton.jit
    def tanh(x):
        """The interpreter (CPU tests) has no libdevice: tanh by exp, within an ulp of it."""
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
else:
    tanh = libdevice.tanh


@triton.jit
def gated_activation_kernel(x_ptr, out_ptr, x_row_stride, out_row_stride, width, BLOCK: tl.constexpr,
                            GELU_TANH: tl.constexpr, PDL: tl.constexpr):
    """out = act(gate) * up for x = [gate | up]; act is SiLU, or GELU's tanh form with GELU_TANH."""
    if PDL:  # programmatic dependent launch: kiln.ops.triton.dependent_launch
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row_index = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    row_ptr = x_ptr + row_index * x_row_stride
    gate = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row_ptr + width + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    if GELU_TANH:
        # torch's GELU-tanh op for op, with the tanh its CUDA kernel calls (libdevice's), so that
        # Inductor's F.gelu and this kernel round alike (benchmarks/gpu_kernels.py checks it).
        inner = GELU_BETA * (gate + GELU_KAPPA * (gate * gate * gate))
        act = 0.5 * gate * (1.0 + tanh(inner))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    # Round act(gate) to the input dtype before the product, as `F.silu(gate) * up` does.
    act = act.to(dtype).to(tl.float32)
    tl.store(out_ptr + row_index * out_row_stride + cols, (act * up).to(dtype), mask=mask)
