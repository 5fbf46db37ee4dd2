"""SiLU-and-mul as a Triton kernel: out = silu(gate) * up, where x = [gate | up]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_row_stride, out_row_stride, width, BLOCK: tl.constexpr):
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


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:], a new [..., I] tensor of x's dtype."""
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"silu_and_mul: last dim must be even (gate and up halves), got {x.shape[-1]}")
    if x.stride(-1) != 1:
        raise ValueError(f"silu_and_mul: the last dim must be contiguous, got strides {x.stride()}")
    width = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], width, dtype=x.dtype, device=x.device)
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0 or width == 0:
        return out
    out_rows = out.view(-1, width)
    grid = (rows.shape[0], triton.cdiv(width, BLOCK))
    _silu_and_mul_kernel[grid](rows, out_rows, rows.stride(0), out_rows.stride(0), width,
                               BLOCK=BLOCK, num_warps=4)
    return out
