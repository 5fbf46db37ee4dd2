"""The fuse_add_rms_norm graph pass: a traced residual add + RMSNorm becomes one
`kiln::fused_add_rms_norm` call.

Under Inductor kiln builds layers on their native paths (custom_ops base "none"), so the
graph holds the decomposition of fused_add_rms_norm_native. This pass puts the kernel op
back in its place: the hand-written kernel on CUDA, and the op the sequence-parallel pass
rewrites. It matches any model's add + RMSNorm of that form, not only kiln's RMSNorm
layer; with custom_ops "+fused_add_rms_norm" the model emits the op itself and there is
nothing to match.

The post-grad decomposition it matches (dtype conversions absent in fp32):

    r  = add(x, residual)         or addmm(residual, a, b): Inductor folds an add after a matmul
    xf = convert_element_type(r, f32)
    q  = rsqrt(add(mean(pow(xf, 2), [-1], keepdim), eps))
    y  = mul(weight, convert_element_type(mul(xf, q), r.dtype))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from kiln.compile.passes.fx_edit import call, erase, getitem, is_op, val
from kiln.compile.passes.graph_pass import GraphPass

aten, prims = torch.ops.aten, torch.ops.prims


@dataclass
class AddRMSNorm:
    """One matched site: r = x + residual, y = RMSNorm(r) * weight."""

    sum: fx.Node  # r: the add (or addmm) whose value is also the new residual
    x: fx.Node | None  # None for the addmm form: x is the matmul a @ b, made when rewriting
    residual: fx.Node
    weight: fx.Node
    eps: float
    normed: fx.Node  # y
    inner: list[fx.Node]  # the nodes between r and y, gone after the rewrite


class FuseAddRMSNorm(GraphPass):
    name = "fuse_add_rms_norm"
    order = 20

    def __call__(self, graph: fx.Graph) -> int:
        if not hasattr(torch.ops.kiln, "fused_add_rms_norm"):
            raise RuntimeError("the fuse_add_rms_norm pass rewrites into torch.ops.kiln.fused_add_rms_norm, which "
                               "this process has not registered; import kiln.ops before compiling")
        fused = 0
        # One site at a time: fusing rewires the residual that the next site adds to.
        for rsqrt in [n for n in graph.nodes if is_op(n, aten.rsqrt.default)]:
            site = match(rsqrt)
            if site is not None:
                fuse(graph, site)
                fused += 1
        return fused


def match(rsqrt: fx.Node) -> AddRMSNorm | None:
    """The add + RMSNorm around `rsqrt`, or None if it is not one."""
    add_eps = rsqrt.args[0]
    if not is_op(add_eps, aten.add.Tensor) or not isinstance(add_eps.args[1], float):
        return None
    mean = add_eps.args[0]
    if not is_op(mean, aten.mean.dim) or not _is_last_dim(mean) or not _kwarg(mean, 2, "keepdim"):
        return None
    square = mean.args[0]
    if not is_op(square, aten.pow.Tensor_Scalar) or square.args[1] != 2:
        return None
    xf = square.args[0]
    r = xf.args[0] if is_op(xf, prims.convert_element_type.default) else xf
    if val(xf).dtype != torch.float32 or not _single_users(add_eps, mean, square, rsqrt):
        return None
    scaled = _only_user(rsqrt)
    if scaled is None or not is_op(scaled, aten.mul.Tensor) or set(scaled.args) != {xf, rsqrt}:
        return None
    tail, inner = scaled, [square, mean, add_eps, rsqrt, scaled]
    back = _only_user(scaled)
    if is_op(back, prims.convert_element_type.default) and back.args[1] == val(r).dtype:
        tail = back
        inner.append(back)
    out = _only_user(tail)
    if not is_op(out, aten.mul.Tensor) or len(out.args) != 2 or tail not in out.args:
        return None
    weight = out.args[1] if out.args[0] is tail else out.args[0]
    if not _is_norm_weight(weight, r):
        return None
    if xf is not r:
        if set(xf.users) != {square, scaled}:
            return None
        inner.append(xf)
    summed = _sum_operands(r)
    if summed is None:
        return None
    x, residual = summed
    return AddRMSNorm(r, x, residual, weight, add_eps.args[1], out, inner)


def fuse(graph: fx.Graph, site: AddRMSNorm) -> None:
    with graph.inserting_before(site.sum.next):  # inserting_after would stack new nodes in reverse
        x = site.x
        if x is None:  # addmm(residual, a, b): the matmul alone, the add moves into the op
            x = call(graph, aten.mm.default, site.sum.args[1:3], like=site.sum)
        fused = call(graph, torch.ops.kiln.fused_add_rms_norm.default, (x, site.residual, site.weight, site.eps),
                     like=site.normed)
        normed, new_residual = getitem(graph, fused, 0), getitem(graph, fused, 1)
    site.normed.replace_all_uses_with(normed)
    site.sum.replace_all_uses_with(new_residual, delete_user_cb=lambda user: user not in site.inner)
    erase(graph, [site.normed, *site.inner, site.sum])


def _sum_operands(r: fx.Node) -> tuple[fx.Node | None, fx.Node] | None:
    """(x, residual) of r = x + residual, both of r's shape; (None, residual) for addmm."""
    if is_op(r, aten.add.Tensor) and len(r.args) == 2 and not r.kwargs:
        a, b = r.args
        if all(isinstance(t, fx.Node) and _same_shape(t, r) and val(t).dtype == val(r).dtype for t in (a, b)):
            return a, b
    if is_op(r, aten.addmm.default) and len(r.args) == 3 and not r.kwargs and _same_shape(r.args[0], r):
        return None, r.args[0]  # a bias addmm has a 1-d input: it does not get here
    return None


def _same_shape(a, b) -> bool:
    return isinstance(a, fx.Node) and statically_known_true(sym_eq(val(a).shape, val(b).shape))


def _is_norm_weight(weight, r: fx.Node) -> bool:
    return (isinstance(weight, fx.Node) and isinstance(val(weight), torch.Tensor) and val(weight).dim() == 1
            and statically_known_true(val(weight).shape[0] == val(r).shape[-1]))


def _is_last_dim(mean: fx.Node) -> bool:
    dims = mean.args[1]
    return list(dims) in ([-1], [val(mean.args[0]).dim() - 1])


def _kwarg(node: fx.Node, index: int, name: str):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, False)


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _single_users(*nodes: fx.Node) -> bool:
    return all(len(n.users) == 1 for n in nodes)
