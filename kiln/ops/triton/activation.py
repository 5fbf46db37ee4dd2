"""Gated activations as a Triton kernel: out = act(gate) * up, where x = [gate | up]."""

from __future__ import annotations

import torch
import triton

from kiln.ops.triton.dependent_launch import pdl_args
from kiln.ops.triton.kernels.activation import gated_activation_kernel
from kiln.ops.triton.launch import launch

BLOCK = 1024


def _gated(x: torch.Tensor, name: str, gelu_tanh: bool) -> torch.Tensor:
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"{name}: last dim must be even (gate and up halves), got {x.shape[-1]}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim must be contiguous, got strides {x.stride()}")
    width = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], width, dtype=x.dtype, device=x.device)
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0 or width == 0:
        return out
    out_rows = out.view(-1, width)
    grid = (rows.shape[0], triton.cdiv(width, BLOCK))
    launch(gated_activation_kernel, grid, rows, out_rows, rows.stride(0), out_rows.stride(0), width,
           BLOCK=BLOCK, GELU_TANH=gelu_tanh, num_warps=4, **pdl_args(x.device))
    return out


def gated_activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    """silu_and_mul or gelu_tanh_and_mul, by name ("silu" / "gelu_tanh")."""
    if activation not in ("silu", "gelu_tanh"):
        raise ValueError(f"gated_activation: {activation!r} is neither 'silu' nor 'gelu_tanh'")
    return _gated(x, f"{activation}_and_mul", gelu_tanh=activation == "gelu_tanh")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:], a new [..., I] tensor of x's dtype."""
    return _gated(x, "silu_and_mul", gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> gelu(x[..., :I], approximate="tanh") * x[..., I:] (Gemma's MLP)."""
    return _gated(x, "gelu_tanh_and_mul", gelu_tanh=True)
