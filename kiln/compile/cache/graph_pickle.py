"""Pickling the split program with its fx graphs as node lists, so that loading it skips torch.fx's re-trace.

torch pickles a GraphModule as its generated code, and unpickling traces that code again with
a fresh Tracer to rebuild the graph (not always node for node: F.embedding comes back with its
defaults spelled out). For SmolLM2's program (the split graph, 3 unique pieces and 30 attention
regions of two ops each) that took 0.12-0.13 s of a warm start on the 2-core CPU, most of it the
regions' fixed cost, and 0.12-0.24 s of a warm -O2 start on the GPU hosts. Here each graph
travels as its nodes (op, name, target, arguments, type) and is rebuilt with Graph.create_node,
then wrapped as torch's own loader wraps it, lazily (its code is generated at its first call):
0.011-0.012 s on that CPU (benchmarks/results/program_pickle_ab_cpu/). torch does not promise a
graph's layout across versions, and neither does this: an entry is keyed by the exact torch
build (kiln.compile.cache.key), and a program that fails to load is captured again
(CacheEntry.load_program).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch import fx
from torch.fx.node import map_aggregate


class _Ref:
    """A node's argument that is another node, by name."""

    def __init__(self, name: str):
        self.name = name


class _GraphPickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, fx.GraphModule):
            body = obj.__dict__.copy()
            del body["_graph"]
            graph = obj.graph
            nodes = [(n.op, n.name, n.target, fx.map_arg(n.args, _ref), fx.map_arg(n.kwargs, _ref), n.type)
                     for n in graph.nodes]
            return _rebuild, (body, nodes, graph._codegen, getattr(graph, "_tracer_cls", None))
        if isinstance(obj, torch._ops.OpOverload):  # a custom op's does not pickle: by name, as the code names it
            return _op, (obj.namespace, obj._opname, obj._overloadname)
        return NotImplemented


def _op(namespace: str, name: str, overload: str) -> torch._ops.OpOverload:
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _ref(node: fx.Node) -> _Ref:
    return _Ref(node.name)


def dumps(obj: Any) -> bytes:
    """pickle.dumps(obj), each GraphModule in it as its nodes."""
    out = io.BytesIO()
    _GraphPickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return out.getvalue()


def _rebuild(body: dict, nodes: list, codegen, tracer_cls) -> fx.GraphModule:
    # torch's private names, imported here: a torch without them fails this load (and the program
    # is captured again), not kiln's import.
    from torch.fx._lazy_graph_module import _LazyGraphModule
    from torch.fx.graph_module import _CodeOnlyModule

    graph = fx.Graph(tracer_cls=tracer_cls)
    graph._codegen = codegen
    made: dict[str, fx.Node] = {}

    def resolve(a):
        return made[a.name] if isinstance(a, _Ref) else a

    for op, name, target, args, kwargs, type_expr in nodes:
        node = graph.create_node(op, target, map_aggregate(args, resolve), map_aggregate(kwargs, resolve),
                                 name=name, type_expr=type_expr)
        if node.name != name:  # the names are the code's variables: a rename would change it
            raise pickle.UnpicklingError(f"graph node {name!r} came back as {node.name!r}")
        made[name] = node
    # As torch's loader does: the module answers the graph's attributes and submodules, then
    # keeps the rest of what it had. Lazy: its code is generated at its first call (the split
    # graph and the regions: once each), never for a piece's graph that is not compiled again.
    module = _LazyGraphModule(_CodeOnlyModule(body), graph)
    for key, value in body.items():
        if not hasattr(module, key):
            setattr(module, key, value)
    return module
