"""SiLU-and-mul as a Triton kernel: out = silu(gate) * up, where x = [gate | up]."""

from __future__ import annotations

import torch
import triton

from kiln.ops.triton.kernels.activation import silu_and_mul_kernel

BLOCK = 1024


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
    silu_and_mul_kernel[grid](rows, out_rows, rows.stride(0), out_rows.stride(0), width,
                               BLOCK=BLOCK, num_warps=4)
    return out
