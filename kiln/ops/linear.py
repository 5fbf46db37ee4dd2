"""The matmul of the linear layers: y = x W^T, with a Triton GEMV for decode-sized batches.

On CUDA the op takes the Triton skinny matmul (kiln/ops/triton/gemv.py) when x has at most
MAX_ROWS rows and the kernel is known to beat cuBLAS for the shape (always up to 16 rows),
cuBLASLt where that is known fastest, and cuBLAS (F.linear) otherwise. The row check is
inside the op, which Dynamo sees as one opaque call, so a traced forward holds no branch on
the batch size; inside a CUDA graph the branch was taken once, at capture, for that graph's
size. On the CPU the op multiplies by the weight
oneDNN-reordered at load (kiln/ops/cpu/packed_linear.py: bf16), and takes F.linear for a
weight that has no packed twin. The MLP's down
projection may take its activation along (kiln::act_and_mul_linear, the GEMV's gated loads).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kiln.ops.activation import GATED_ACTIVATIONS
from kiln.ops.cpu.packed_linear import packed_linear
from kiln.ops.custom_op import CustomOp, is_enabled, kernel, kiln_op

MAX_ROWS = 64  # kiln.ops.triton.gemv.MAX_ROWS; not imported here, so CPU never imports triton
# Row counts that cover every autotuning key of the GEMV (one row; 2 to 16 pad to 16, then 32, 64).
GEMV_ROW_BUCKETS = (1, 16, 32, 64)
_GEMV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@kiln_op("kiln::skinny_linear", mutates_args=())
def skinny_linear_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


@skinny_linear_op.register_fake
def _(x, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    rows = x.numel() // max(x.shape[-1], 1)
    return (0 < rows <= MAX_ROWS and x.dtype == weight.dtype and x.dtype in _GEMV_DTYPES
            and weight.dim() == 2 and weight.stride(-1) == 1)


@kernel(skinny_linear_op, "cuda")
def skinny_linear_cuda(x, weight):
    if not takes_gemv(x, weight):
        return F.linear(x, weight)
    from kiln.ops.triton import gemv

    return gemv.linear(x, weight)


@kernel(skinny_linear_op, "cpu")
def skinny_linear_cpu(x, weight):
    y = packed_linear(x, weight)
    return F.linear(x, weight) if y is None else y


@kiln_op("kiln::act_and_mul_linear", mutates_args=())
def act_and_mul_linear_op(x: torch.Tensor, weight: torch.Tensor, activation: str) -> torch.Tensor:
    """The gated MLP's down projection with its activation: act(gate) * up @ weight.T for x =
    [gate | up]; activation "silu" (Llama) or "gelu_tanh" (Gemma 2)."""
    return F.linear(GATED_ACTIVATIONS[activation][1](x), weight)


@act_and_mul_linear_op.register_fake
def _(x, weight, activation):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@kernel(act_and_mul_linear_op, "cuda")
def act_and_mul_linear_cuda(x, weight, activation):
    if takes_gemv(x, weight):
        from kiln.ops.triton import gemv

        return gemv.linear(x, weight, activation=activation)
    from kiln.ops.triton.activation import gated_activation

    return F.linear(gated_activation(x, activation), weight)


@kernel(act_and_mul_linear_op, "cpu")
def act_and_mul_linear_cpu(x, weight, activation):
    gated = GATED_ACTIVATIONS[activation][1](x)
    y = packed_linear(gated, weight)
    return F.linear(gated, weight) if y is None else y


class SkinnyLinear(CustomOp):
    """Makes `skinny_linear` a name `custom_ops` can switch; the layers take linear_matmul()."""

    op_names = ("skinny_linear",)


def linear_matmul() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The matmul a linear layer built now calls: kiln::skinny_linear when the op is on, else
    F.linear. A function rather than a SkinnyLinear submodule: Dynamo inlines a module call per
    linear layer otherwise (3 frames x 4 linears x 32 layers: ~9% of a Llama trace on the CPU)."""
    return skinny_linear_op if is_enabled(SkinnyLinear.op_names[0]) else F.linear


def kiln_linear_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights of `model`'s layers whose matmul is kiln's linear op (each once: tied ones share)."""
    weights = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        kiln_op = getattr(module, "matmul", None) in (skinny_linear_op, act_and_mul_linear_op)
        if kiln_op and isinstance(weight, torch.Tensor):
            weights[id(weight)] = weight
    return list(weights.values())


def fuses_activation(activation: str) -> bool:
    """Whether a down projection built now takes its activation ("silu" or "gelu_tanh") into the
    GEMV's loads (kiln::act_and_mul_linear): where both the GEMV and that activation's kernel are
    on. It saves the activation's launch and its output's trip through memory, and computes
    exactly what the pair does."""
    return is_enabled(SkinnyLinear.op_names[0]) and is_enabled(GATED_ACTIVATIONS[activation][0].op_names[0])
