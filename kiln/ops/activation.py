"""Gated activations: SiLU-and-mul (the Llama MLP) and GELU-tanh-and-mul (Gemma's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.custom_op import CustomOp, call, kernel, kiln_op


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@kiln_op("kiln::silu_and_mul", mutates_args=())
def silu_and_mul_op(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_native(x)


@silu_and_mul_op.register_fake
def _(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@kernel(silu_and_mul_op, "cuda")
def _(x):
    from kiln.ops.triton.activation import silu_and_mul

    return silu_and_mul(x)


class SiluAndMul(CustomOp):
    op_names = ("silu_and_mul",)

    def forward_native(self, x):
        return silu_and_mul_native(x)

    def forward_kernel(self, x):
        return call(silu_and_mul_op, x)


def gelu_tanh_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


@kiln_op("kiln::gelu_tanh_and_mul", mutates_args=())
def gelu_tanh_and_mul_op(x: torch.Tensor) -> torch.Tensor:
    return gelu_tanh_and_mul_native(x)


@gelu_tanh_and_mul_op.register_fake
def _(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@kernel(gelu_tanh_and_mul_op, "cuda")
def _(x):
    from kiln.ops.triton.activation import gelu_tanh_and_mul

    return gelu_tanh_and_mul(x)


class GeluTanhAndMul(CustomOp):
    op_names = ("gelu_tanh_and_mul",)

    def forward_native(self, x):
        return gelu_tanh_and_mul_native(x)

    def forward_kernel(self, x):
        return call(gelu_tanh_and_mul_op, x)


# A gated MLP's activation by name: its CustomOp (whose switch says whether its kernel is on) and
# its reference.
GATED_ACTIVATIONS = {"silu": (SiluAndMul, silu_and_mul_native),
                     "gelu_tanh": (GeluTanhAndMul, gelu_tanh_and_mul_native)}
