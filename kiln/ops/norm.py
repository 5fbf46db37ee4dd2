"""RMSNorm and fused residual-add + RMSNorm.

unit_offset (Gemma): the checkpoint stores w - 1, so the row is scaled by 1 + w, in fp32, and
rounded to the input dtype once, as HF's Gemma2RMSNorm does; without it, the normalised row is
rounded first and then multiplied by w (HF's LlamaRMSNorm). On the CPU the ops run kiln's C++
kernels where they are built (kiln/ops/cpu/rms_norm.cpp: one call instead of nine ATen ones)."""

from __future__ import annotations

import torch
from torch import nn

from kiln.ops.cpu.extension import kernel as cpu_kernel
from kiln.ops.custom_op import CustomOp, call, is_enabled, kernel, kiln_op


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    # Normalise in fp32, scale in the model dtype: the order HF's LlamaRMSNorm uses, so
    # fp32 and bf16 results match it bit for bit where the kernels allow.
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (xf * (1.0 + weight.float())).to(dtype)
    return weight * xf.to(dtype)


def fused_add_rms_norm_native(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rms_norm_native(residual, weight, eps, unit_offset), residual


@kiln_op("kiln::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    return rms_norm_native(x, weight, eps, unit_offset)


def _normed_like(x: torch.Tensor, weight: torch.Tensor, unit_offset: bool) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=x.dtype if unit_offset else torch.promote_types(x.dtype, weight.dtype))


@rms_norm_op.register_fake
def _(x, weight, eps, unit_offset=False):
    return _normed_like(x, weight, unit_offset)


@kernel(rms_norm_op, "cuda")
def _(x, weight, eps, unit_offset=False):
    from kiln.ops.triton.norm import rms_norm

    return rms_norm(x, weight, eps, unit_offset)


def _cpu_kernel_for(*tensors: torch.Tensor):
    """kiln's built C++ kernels where they take these tensors (one dtype, contiguous), else None."""
    kernel = cpu_kernel()
    if kernel is None or any(t.dtype != tensors[0].dtype or not t.is_contiguous() for t in tensors):
        return None
    return kernel


@kernel(rms_norm_op, "cpu")
def _(x, weight, eps, unit_offset=False):
    kernel = _cpu_kernel_for(x, weight)
    if kernel is None:
        return rms_norm_native(x, weight, eps, unit_offset)
    return kernel.rms_norm(x, weight, eps, unit_offset)


@kiln_op("kiln::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    return fused_add_rms_norm_native(x, residual, weight, eps, unit_offset)


@fused_add_rms_norm_op.register_fake
def _(x, residual, weight, eps, unit_offset=False):
    return _normed_like(x, weight, unit_offset), torch.empty_like(x)


@kernel(fused_add_rms_norm_op, "cuda")
def _(x, residual, weight, eps, unit_offset=False):
    from kiln.ops.triton.norm import fused_add_rms_norm

    return fused_add_rms_norm(x, residual, weight, eps, unit_offset)


@kernel(fused_add_rms_norm_op, "cpu")
def _(x, residual, weight, eps, unit_offset=False):
    kernel = _cpu_kernel_for(x, residual, weight)
    if kernel is None:
        return fused_add_rms_norm_native(x, residual, weight, eps, unit_offset)
    return kernel.fused_add_rms_norm(x, residual, weight, eps, unit_offset)


class RMSNorm(CustomOp):
    """RMSNorm; called with a residual it adds first and returns (normed, new residual)."""

    op_names = ("rms_norm", "fused_add_rms_norm")

    def __init__(self, hidden_size: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.unit_offset = unit_offset
        self.fused_uses_kernel = is_enabled("fused_add_rms_norm")

    def forward(self, x, residual=None):
        if residual is None:
            return super().forward(x)
        if self.fused_uses_kernel:
            return call(fused_add_rms_norm_op, x, residual, self.weight, self.eps, self.unit_offset)
        return fused_add_rms_norm_native(x, residual, self.weight, self.eps, self.unit_offset)

    def forward_native(self, x):
        return rms_norm_native(x, self.weight, self.eps, self.unit_offset)

    def forward_kernel(self, x):
        return call(rms_norm_op, x, self.weight, self.eps, self.unit_offset)

