"""Re-inplacing: turn functionalized calls of mutating ops back into the mutating call.

AOTAutograd hands Inductor a functional graph: `attention(..., out)`, which writes `out`,
arrives as `auto_functionalized_v2(attention, ..., _all_bases=[out])` whose result is a
new `out`. Taken literally that is a clone of `out`, the op on the clone, and (for a graph
input) a `copy_` of the result back into the input. When nothing reads the old value after
the call, the op can write the original tensor: no clone, and no copy back.

A base is written in place only if every node that aliases its storage (by fake-tensor
storage) is used before the call, or it is a graph input whose only later use is the copy
back. Otherwise, and for mutated args that are views of a base (Inductor's own reinplacing
handles those), the node is left as it is, all or nothing.
"""

from __future__ import annotations

import torch
from torch import fx
from torch._higher_order_ops.auto_functionalize import NotView, get_mutable_args, read_view_information_from_args

from kiln.compile.passes.fx_edit import call, erase, getitem, is_op, outputs_of
from kiln.compile.passes.graph_pass import GraphPass

hops = torch.ops.higher_order
FUNCTIONALIZED = (hops.auto_functionalized, hops.auto_functionalized_v2)


class Reinplace(GraphPass):
    name = "reinplace"
    order = 90

    def __call__(self, graph: fx.Graph) -> int:
        reinplaced = 0
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target in FUNCTIONALIZED:
                reinplaced += reinplace(graph, node)
        return reinplaced


def mutated_bases(node: fx.Node) -> dict[str, fx.Node] | None:
    """Mutable arg name -> the tensor node the op would write; None if one is a view
    (or a list) kiln does not rewrite."""
    op, kwargs = node.args[0], dict(node.kwargs)
    names, types = get_mutable_args(op)
    if node.target is hops.auto_functionalized:
        bases = {name: kwargs[name] for name in names}
    else:
        all_bases = kwargs.pop("_all_bases")
        views = read_view_information_from_args(names, types, kwargs, all_bases)
        if not all(isinstance(v, NotView) for v in views.values()):
            return None
        bases = {name: all_bases[v.base_index] for name, v in views.items()}
    return bases if all(isinstance(b, fx.Node) for b in bases.values()) else None


def reinplace(graph: fx.Graph, node: fx.Node) -> int:
    bases = mutated_bases(node)
    if bases is None:
        return 0
    # The result is (op's outputs..., new value of each base): v1's bases are the mutable
    # args themselves, v2's are listed in _all_bases.
    base_list = list(bases.values()) if node.target is hops.auto_functionalized else node.kwargs["_all_bases"]
    first_new = len(node.meta["val"]) - len(base_list)
    outputs = outputs_of(node)
    order = {n: i for i, n in enumerate(graph.nodes)}
    copy_backs = []
    for i, base in enumerate(base_list):
        ok, copy_back = writable(graph, base, node, outputs.get(first_new + i), order)
        if not ok:
            return 0
        copy_backs += copy_back
    op = node.args[0]
    args = {a.name: (bases[a.name] if a.name in bases else node.kwargs[a.name])
            for a in op._schema.arguments if a.name in bases or a.name in node.kwargs}
    with graph.inserting_before(node):
        mutating = call(graph, op, (), args, like=node)
        for index, item in outputs.items():
            if index >= first_new:
                item.replace_all_uses_with(base_list[index - first_new])
            elif len(op._schema.returns) > 1:
                item.replace_all_uses_with(getitem(graph, mutating, index))
            else:
                item.replace_all_uses_with(mutating)
    for copy in copy_backs:  # now copy_(x, x)
        copy.replace_all_uses_with(copy.args[0])
    erase(graph, [*outputs.values(), node, *copy_backs])
    return 1


def writable(graph: fx.Graph, base: fx.Node, node: fx.Node, new_value: fx.Node | None,
             order: dict[fx.Node, int]) -> tuple[bool, list[fx.Node]]:
    """Whether `node` may write `base` in place; and the copy-back nodes that then go away."""
    storage = storage_of(base)
    if storage is None:
        return False, []
    aliases = [n for n in graph.nodes if n is not node and storage_of(n) == storage]
    copy_backs = [u for u in (new_value.users if new_value is not None else ())
                  if is_op(u, torch.ops.aten.copy_.default) and u.args[0] in aliases]
    if any(a.op in ("placeholder", "get_attr") for a in aliases) and not copy_backs:
        return False, []  # the caller's tensor would change although the graph does not say so
    for alias in aliases:
        for user in alias.users:
            if user is not node and user not in copy_backs and order[user] > order[node]:
                return False, []  # the old value is read after the call
    return True, copy_backs


def storage_of(node: fx.Node) -> int | None:
    value = node.meta.get("val")
    return value.untyped_storage()._cdata if isinstance(value, torch.Tensor) else None
