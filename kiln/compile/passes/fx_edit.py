"""Small tools for rewriting a post-grad FX graph: matching ops, and adding nodes that
carry the fake values ("val") Inductor reads every node's shape and dtype from."""

from __future__ import annotations

import contextlib
import operator

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.utils import _pytree as pytree


def is_op(node, *ops) -> bool:
    """Whether `node` calls one of `ops`, each an OpOverload or a whole OpOverloadPacket."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    packet = getattr(node.target, "overloadpacket", None)
    return any(node.target is op or packet is op for op in ops)


def val(node):
    """The fake value a node produces (a constant stands for itself)."""
    return node.meta["val"] if isinstance(node, fx.Node) else node


def call(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None, like: fx.Node | None = None) -> fx.Node:
    """Insert `target(*args, **kwargs)` at the graph's insertion point, with its fake value
    computed from its inputs'. `like`: a node whose source location the new one keeps."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    fake_args, fake_kwargs = fx.node.map_arg((args, kwargs), val)
    tensors = [x for x in pytree.tree_leaves((fake_args, fake_kwargs)) if isinstance(x, torch.Tensor)]
    with detect_fake_mode(tensors) or contextlib.nullcontext():
        node.meta["val"] = target(*fake_args, **fake_kwargs)
    if like is not None and "stack_trace" in like.meta:
        node.meta["stack_trace"] = like.meta["stack_trace"]
    return node


def getitem(graph: fx.Graph, node: fx.Node, index: int) -> fx.Node:
    item = graph.call_function(operator.getitem, (node, index))
    item.meta["val"] = node.meta["val"][index]
    return item


def outputs_of(node: fx.Node) -> dict[int, fx.Node]:
    """index -> the getitem node reading that element of `node`'s tuple result."""
    return {user.args[1]: user for user in node.users if user.target is operator.getitem}


def erase(graph: fx.Graph, nodes) -> None:
    """Erase `nodes` (no longer used), users before the nodes they use."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(set(nodes), key=order.__getitem__, reverse=True):
        graph.erase_node(node)
