"""RMSNorm and fused residual-add + RMSNorm as Triton kernels: one program per row.

The arithmetic follows `rms_norm_native`: the mean square and the scaling happen in fp32,
the normalised row is rounded to the input dtype, and only then multiplied by the weight
(in fp32, rounded once to the output dtype, as torch does for a bf16 * bf16 product). With
unit_offset (Gemma) the row is scaled by 1 + weight in fp32 without the rounding in between, and
the output has the input's dtype.
"""

from __future__ import annotations

import functools

import torch
import triton

from kiln.ops.triton.dependent_launch import pdl_args
from kiln.ops.triton.kernels.norm import fused_add_rms_norm_kernel, rms_norm_kernel
from kiln.ops.triton.launch import launch

# A whole row lives in registers; past this the kernel would need a loop over the row.
MAX_HIDDEN_SIZE = 65536


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """x [..., H] as a [rows, H] view (a copy only if the leading dims cannot be merged)."""
    if x.stride(-1) != 1:
        raise ValueError(f"{name}: the last (hidden) dim must be contiguous, got strides {x.stride()}")
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


# Once per hidden size: an 8B model's forward calls the norms 65 times, and its eager steps and
# graph captures pay every host microsecond of each call (next_power_of_2 alone took 2 us).
@functools.cache
def _launch_config(hidden_size: int) -> dict:
    if hidden_size > MAX_HIDDEN_SIZE:
        raise ValueError(f"rms_norm: hidden size {hidden_size} exceeds the supported {MAX_HIDDEN_SIZE}")
    block = triton.next_power_of_2(hidden_size)
    return {"BLOCK": block, "num_warps": min(max(block // 256, 1), 16)}


def _check_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1] or weight.stride(0) != 1:
        raise ValueError(f"rms_norm: weight must be contiguous [{x.shape[-1]}], got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"rms_norm: weight on {weight.device}, input on {x.device}")


def _out_dtype(x: torch.Tensor, weight: torch.Tensor, unit_offset: bool) -> torch.dtype:
    return x.dtype if unit_offset else torch.promote_types(x.dtype, weight.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """weight * rms_norm(x) over the last dim; a new tensor of dtype promote(x, weight)."""
    _check_weight(x, weight)
    rows = _rows(x, "rms_norm")
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight, unit_offset), device=x.device)
    if rows.shape[0] == 0:
        return out
    out_rows = out.view(-1, x.shape[-1])
    launch(rms_norm_kernel, (rows.shape[0],),
        rows, weight, out_rows, rows.stride(0), out_rows.stride(0), x.shape[-1], eps,
        UNIT_OFFSET=unit_offset, **_launch_config(x.shape[-1]), **pdl_args(x.device),
    )
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_norm(x + residual), x + residual), in one pass; inputs are not changed."""
    _check_weight(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"fused_add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match "
            f"x {tuple(x.shape)} {x.dtype}"
        )
    rows, residual_rows = _rows(x, "fused_add_rms_norm"), _rows(residual, "fused_add_rms_norm")
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight, unit_offset), device=x.device)
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out, new_residual
    out_rows = out.view(-1, x.shape[-1])
    launch(fused_add_rms_norm_kernel, (rows.shape[0],),
        rows, residual_rows, weight, out_rows, new_residual, rows.stride(0), residual_rows.stride(0),
        out_rows.stride(0), x.shape[-1], eps, UNIT_OFFSET=unit_offset, **_launch_config(x.shape[-1]),
        **pdl_args(x.device),
    )
    return out, new_residual
