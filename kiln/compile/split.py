"""Split points: ops the FX graph is cut at, so they run eagerly between compiled pieces.

An op becomes a split point in one of two ways, merged into one effective list:
- at its definition, with `@split_op(reason=...)` on the `torch.library` op, so the list
  can be audited next to the code that needs it;
- by name in the compilation config's `splitting_ops`.

The scan walks the graph once in order. Consecutive split ops form one opaque region: the
KV-cache write and the attention that reads it must run back to back, and a compiled
piece between them would be a launch with nothing in it.
"""

from __future__ import annotations

import inspect
import operator
import sys
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

_DECLARED: dict[str, str] = {}  # "ns::op" -> "decorator at file:line: reason"


@dataclass(frozen=True)
class SplitOp:
    name: str  # "ns::op"
    source: str  # "decorator at file:line: reason" or "config"


def op_name(op) -> str:
    """'ns::op' for a torch.library custom op, an OpOverloadPacket, an OpOverload or a string."""
    if isinstance(op, str):
        return op.replace(".", "::", 1) if "::" not in op else op
    name = getattr(op, "_qualname", None) or getattr(op, "_qualified_op_name", None)
    if name is None:
        schema = getattr(op, "_schema", None)
        name = schema.name if schema is not None else str(op)
    return name


def split_op(*, reason: str):
    """Declare the decorated `torch.library` op a split point, with the reason why."""

    def register(op):
        # The caller's frame alone: inspect.stack() would read the source of every frame.
        frame = sys._getframe(1)
        _DECLARED[op_name(op)] = f"decorator at {frame.f_code.co_filename}:{frame.f_lineno}: {reason}"
        return op

    return register


def effective_split_ops(configured: list[str] | tuple[str, ...] = ()) -> list[SplitOp]:
    ops = [SplitOp(name, where) for name, where in _DECLARED.items()]
    seen = {op.name for op in ops}
    ops += [SplitOp(op_name(n), "config") for n in configured if op_name(n) not in seen]
    return ops


def check_split_ops(ops: list[SplitOp]) -> None:
    """Fail at start-up on a configured name that no registered op answers to."""
    for op in ops:
        namespace, _, name = op.name.partition("::")
        if not name or not hasattr(getattr(torch.ops, namespace), name):
            raise ValueError(f"split op {op.name!r} (from {op.source}) is not a registered torch op; "
                             f"write it as 'namespace::name', e.g. 'kiln::attention'")


def is_split_node(node: fx.Node, names: set[str]) -> bool:
    # Dynamo records a custom op either as the packet (torch.ops.ns.op) or as an overload
    # (torch.ops.ns.op.default); op_name maps both to 'ns::op'.
    return node.op == "call_function" and op_name(node.target) in names


def _unpacks_split_result(node: fx.Node, names: set[str]) -> bool:
    return (node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node)
            and is_split_node(node.args[0], names))


@dataclass
class SplitGraph:
    module: fx.GraphModule  # calls submod_<i> in order
    pieces: list[str]  # names of the submodules to compile
    regions: list[str]  # names of the opaque submodules (split ops), run as captured


def subgraph_ids(graph: fx.Graph, names: set[str], merge: bool = True) -> tuple[dict[fx.Node, int], set[int]]:
    """Node -> subgraph id, bumped wherever the scan enters or leaves a run of split ops. With
    `merge` a run of consecutive split ops (the KV write right before attention) is one
    opaque region; without it each split op is its own (SGLang's scan)."""
    ids: dict[fx.Node, int] = {}
    opaque: set[int] = set()
    current, in_region = 0, None
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if in_region and _unpacks_split_result(node, names):
            # The items of a split op's tuple stay in its region: a piece would take the tuple
            # itself as an input, which it cannot be compiled for.
            ids[node] = current
            continue
        split = is_split_node(node, names)
        if in_region is not None and (split != in_region or (split and not merge)):
            current += 1
        in_region = split
        ids[node] = current
        if split:
            opaque.add(current)
    return ids, opaque


def split_graph(gm: fx.GraphModule, names: set[str], merge: bool = True) -> SplitGraph:
    ids, opaque = subgraph_ids(gm.graph, names, merge)
    # Every piece returns a tuple, even of one value: a compiled artifact loaded from disk
    # returns a list either way, so a bare-tensor piece would come back as [tensor].
    if "tuple_return" in inspect.signature(split_module).parameters:
        module = split_module(gm, gm, lambda node: ids[node], keep_original_order=True, tuple_return=True)
    else:  # torch < 2.12
        module = _return_tuples(split_module(gm, gm, lambda node: ids[node], keep_original_order=True))
    pieces, regions = [], []
    for i in sorted(set(ids.values())):
        (regions if i in opaque else pieces).append(f"submod_{i}")
    return SplitGraph(module, pieces, regions)


def _return_tuples(module: fx.GraphModule) -> fx.GraphModule:
    """What split_module(tuple_return=True) does: a one-value submodule returns (value,)."""
    for node in list(module.graph.nodes):
        if node.op != "call_module":
            continue
        sub = getattr(module, node.target)
        output = next(n for n in sub.graph.nodes if n.op == "output")
        if isinstance(output.args[0], (tuple, list)):
            continue
        output.args = ((output.args[0],),)
        sub.recompile()
        with module.graph.inserting_after(node):
            first = module.graph.call_function(operator.getitem, (node, 0))
        node.replace_all_uses_with(first, delete_user_cb=lambda user: user is not first)
    module.recompile()
    return module
