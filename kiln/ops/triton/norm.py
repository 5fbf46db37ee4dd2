"""RMSNorm and fused residual-add + RMSNorm as Triton kernels: one program per row.

The arithmetic follows `rms_norm_native`: the mean square and the scaling happen in fp32,
the normalised row is rounded to the input dtype, and only then multiplied by the weight
(in fp32, rounded once to the output dtype, as torch does for a bf16 * bf16 product).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A whole row lives in registers; past this the kernel would need a loop over the row.
MAX_HIDDEN_SIZE = 65536


@triton.jit
def _scaled_rms_norm(row, weight_ptr, cols, col_mask, hidden_size, eps, input_dtype: tl.constexpr):
    """weight * rms_norm(row) in fp32; `row` is fp32 holding values of `input_dtype`."""
    mean_square = tl.sum(row * row, axis=0) / hidden_size
    normed = (row * tl.math.rsqrt(mean_square + eps)).to(input_dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    return normed * weight


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, x_row_stride, out_row_stride, hidden_size, eps,
                     BLOCK: tl.constexpr):
    row_index = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < hidden_size
    row = tl.load(x_ptr + row_index * x_row_stride + cols, mask=col_mask, other=0.0)
    out = _scaled_rms_norm(row.to(tl.float32), weight_ptr, cols, col_mask, hidden_size, eps,
                           x_ptr.dtype.element_ty)
    out_ptrs = out_ptr + row_index * out_row_stride + cols
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _fused_add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr,
                               x_row_stride, residual_row_stride, out_row_stride, hidden_size, eps,
                               BLOCK: tl.constexpr):
    row_index = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < hidden_size
    x = tl.load(x_ptr + row_index * x_row_stride + cols, mask=col_mask, other=0.0)
    residual = tl.load(residual_ptr + row_index * residual_row_stride + cols, mask=col_mask, other=0.0)
    # Round the sum to the input dtype once, exactly as `x + residual` does in torch.
    summed = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
    tl.store(new_residual_ptr + row_index * hidden_size + cols, summed, mask=col_mask)
    out = _scaled_rms_norm(summed.to(tl.float32), weight_ptr, cols, col_mask, hidden_size, eps,
                           x_ptr.dtype.element_ty)
    tl.store(out_ptr + row_index * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=col_mask)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """x [..., H] as a [rows, H] view (a copy only if the leading dims cannot be merged)."""
    if x.stride(-1) != 1:
        raise ValueError(f"{name}: the last (hidden) dim must be contiguous, got strides {x.stride()}")
    return x.reshape(-1, x.shape[-1])


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rms_norm(x) over the last dim; a new tensor of dtype promote(x, weight)."""
    _check_weight(x, weight)
    rows = _rows(x, "rms_norm")
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.shape[0] == 0:
        return out
    out_rows = out.view(-1, x.shape[-1])
    _rms_norm_kernel[(rows.shape[0],)](
        rows, weight, out_rows, rows.stride(0), out_rows.stride(0), x.shape[-1], eps,
        **_launch_config(x.shape[-1]),
    )
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_norm(x + residual), x + residual), in one pass; inputs are not changed."""
    _check_weight(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"fused_add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match "
            f"x {tuple(x.shape)} {x.dtype}"
        )
    rows, residual_rows = _rows(x, "fused_add_rms_norm"), _rows(residual, "fused_add_rms_norm")
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out, new_residual
    out_rows = out.view(-1, x.shape[-1])
    _fused_add_rms_norm_kernel[(rows.shape[0],)](
        rows, residual_rows, weight, out_rows, new_residual, rows.stride(0), residual_rows.stride(0),
        out_rows.stride(0), x.shape[-1], eps, **_launch_config(x.shape[-1]),
    )
    return out, new_residual
