"""No-op elimination: views that return their input unchanged, and conversions to the
dtype a tensor already has.

Inductor's own remove_noop_ops runs earlier, but it compares a view's target size with
the input's shape literally: `reshape(x, [s0, -1, 16])` on an `[s0, 4, 16]` input stays,
since -1 is not 4. Here a node is an identity when its output's fake value has the
input's shape, strides and storage offset (symbolic sizes compared by the shape env).
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from kiln.compile.passes.fx_edit import is_op
from kiln.compile.passes.graph_pass import GraphPass

aten, prims = torch.ops.aten, torch.ops.prims

VIEWS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.slice.Tensor,
         aten.expand.default, aten.alias.default)


class NoOpElimination(GraphPass):
    name = "noop_elimination"
    order = 10

    def __call__(self, graph: fx.Graph) -> int:
        outputs = set(next(iter(reversed(graph.nodes))).all_input_nodes)
        removed = 0
        for node in list(graph.nodes):
            # A graph output stays: dropping it could make an output alias an input.
            if node in outputs or not (is_identity_view(node) or is_noop_conversion(node)):
                continue
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            removed += 1
        return removed


def is_identity_view(node: fx.Node) -> bool:
    if not is_op(node, *VIEWS) or not isinstance(node.args[0], fx.Node):
        return False
    out, src = node.meta.get("val"), node.args[0].meta.get("val")
    return same_layout(out, src) and statically_known_true(out.storage_offset() == src.storage_offset())


def is_noop_conversion(node: fx.Node) -> bool:
    if is_op(node, prims.convert_element_type.default):
        changes = {}
    elif is_op(node, aten._to_copy.default):
        changes = dict(node.kwargs)
        changes.pop("dtype", None)
        if changes.pop("memory_format", None) not in (None, torch.preserve_format):
            return False
    else:
        return False
    if changes or not isinstance(node.args[0], fx.Node):
        return False  # a device, layout or pinning change is a real copy
    return same_layout(node.meta.get("val"), node.args[0].meta.get("val"))


def same_layout(a, b) -> bool:
    """Same dtype, device, shape and strides (symbolic sizes proved equal, not hoped)."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.device == b.device and statically_known_true(sym_eq(a.shape, b.shape))
            and statically_known_true(sym_eq(a.stride(), b.stride())))
