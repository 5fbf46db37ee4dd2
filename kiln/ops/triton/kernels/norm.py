"""RMSNorm and fused residual-add + RMSNorm as Triton kernels (the device code; kiln.ops.triton.norm
launches them)."""

import triton
import triton.language as tl


@triton.jit
def _scaled_rms_norm(row, weight, hidden_size, eps, input_dtype: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """weight * rms_norm(row) in fp32; `row` is fp32 holding values of `input_dtype`, `weight`
    fp32. UNIT_OFFSET (Gemma): (1 + weight) * rms_norm(row), the normalised row not rounded first.
    The caller loads the weight with the row: a load after the sum's barriers would wait its
    own memory round trip (the sm_90 code issued it only then)."""
    mean_square = tl.sum(row * row, axis=0) / hidden_size
    normed = row * tl.math.rsqrt(mean_square + eps)
    if UNIT_OFFSET:
        return normed * (1.0 + weight)
    return normed.to(input_dtype).to(tl.float32) * weight


@triton.jit
def rms_norm_kernel(x_ptr, weight_ptr, out_ptr, x_row_stride, out_row_stride, hidden_size, eps,
                     BLOCK: tl.constexpr, UNIT_OFFSET: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # programmatic dependent launch: kiln.ops.triton.dependent_launch
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row_index = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < hidden_size
    row = tl.load(x_ptr + row_index * x_row_stride + cols, mask=col_mask, other=0.0)
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    out = _scaled_rms_norm(row.to(tl.float32), weight, hidden_size, eps, x_ptr.dtype.element_ty, UNIT_OFFSET)
    out_ptrs = out_ptr + row_index * out_row_stride + cols
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def fused_add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr,
                               x_row_stride, residual_row_stride, out_row_stride, hidden_size, eps,
                               BLOCK: tl.constexpr, UNIT_OFFSET: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # programmatic dependent launch: kiln.ops.triton.dependent_launch
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row_index = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < hidden_size
    x = tl.load(x_ptr + row_index * x_row_stride + cols, mask=col_mask, other=0.0)
    residual = tl.load(residual_ptr + row_index * residual_row_stride + cols, mask=col_mask, other=0.0)
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    # Round the sum to the input dtype once, exactly as `x + residual` does in torch.
    summed = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
    tl.store(new_residual_ptr + row_index * hidden_size + cols, summed, mask=col_mask)
    out = _scaled_rms_norm(summed.to(tl.float32), weight, hidden_size, eps, x_ptr.dtype.element_ty, UNIT_OFFSET)
    tl.store(out_ptr + row_index * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=col_mask)
