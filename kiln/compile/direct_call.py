"""Calling the captured graph directly, without Dynamo: the forward's arguments in, its value out.

Around the graph it captured, Dynamo's bytecode does two jobs on every call: it gathers the
graph's inputs (each parameter and buffer, the arguments, the token count as an int) and
turns the graph's outputs into the forward's return value. A CallSpec records both once, at
capture, by matching the real inputs Dynamo handed the backend against the model's tensors
and the call's arguments (by identity), and the real return value against the graph's
outputs. A DirectCall replays it. The spec pickles, so a warm start from the compile cache
needs neither Dynamo nor its bytecode; and the parameters are looked up once, not per call.

Parameters are bound when the DirectCall is made: copying new weights into them in place
is seen, replacing a Parameter object afterwards is not.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from kiln.compile.monitor import logger

_CONSTANTS = (bool, int, float, str, type(None))


@dataclass
class CallSpec:
    arg_names: list[str]  # the forward's parameters, without self
    inputs: list[tuple]  # per graph input: ("tensor", model name) | ("arg", i) | ("size", arg i, dim)
    output_spec: str  # pytree spec of the return value (treespec_dumps)
    output_leaves: list[tuple]  # per leaf: ("out", i) | ("arg", i) | ("const", value)


def call_spec(graph: fx.GraphModule, example_inputs: list, model: nn.Module, signature: inspect.Signature,
              arguments: dict, result, graph_outputs) -> CallSpec | None:
    """How to call `graph` for `model`'s forward; None (logged) if an input or output has
    no source kiln knows, and the forward keeps running Dynamo's bytecode."""
    arg_names = list(signature.parameters)[1:]
    args = [arguments.get(name) for name in arg_names]
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    inputs = _input_sources(placeholders, example_inputs, model, args)
    leaves, spec = pytree.tree_flatten(result)
    outputs = _output_sources(leaves, graph_outputs, args)
    problem = ("a graph input" if inputs is None else "the return value" if outputs is None else None)
    if problem is None:
        try:
            return CallSpec(arg_names, inputs, pytree.treespec_dumps(spec), outputs)
        except Exception as e:  # a return type pytree cannot write down
            problem = f"the return value's structure ({e})"
    logger.info("%s.forward: %s has no source kiln can replay; later calls run Dynamo's bytecode "
                "and a warm start runs Dynamo", type(model).__name__, problem)
    return None


def _input_sources(placeholders: list[fx.Node], example_inputs: list, model: nn.Module,
                   args: list) -> list[tuple] | None:
    named = {id(t): ("tensor", name) for name, t in [*model.named_parameters(remove_duplicate=False),
                                                     *model.named_buffers(remove_duplicate=False)]}
    named.update({id(a): ("arg", i) for i, a in enumerate(args) if isinstance(a, torch.Tensor)})
    sources = [named.get(id(x)) if isinstance(x, torch.Tensor) else None for x in example_inputs]
    # An int input is a size of an argument: find the argument dim with the same symbol.
    dims = {}
    for node, source in zip(placeholders, sources):
        fake = node.meta.get("example_value")
        if source is not None and source[0] == "arg" and isinstance(fake, torch.Tensor):
            for d, size in enumerate(fake.shape):
                if isinstance(size, torch.SymInt):
                    dims.setdefault(size.node.expr, ("size", source[1], d))
    for i, (node, x) in enumerate(zip(placeholders, example_inputs)):
        fake = node.meta.get("example_value")
        if sources[i] is None and isinstance(x, (int, torch.SymInt)) and isinstance(fake, torch.SymInt):
            sources[i] = dims.get(fake.node.expr)
    return None if None in sources or len(placeholders) != len(example_inputs) else sources


def _output_sources(leaves: list, graph_outputs, args: list) -> list[tuple] | None:
    if graph_outputs is None:
        return None
    outs = {id(t): i for i, t in enumerate(graph_outputs) if isinstance(t, torch.Tensor)}
    arg_ids = {id(a): i for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    sources = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            source = ("out", outs[id(leaf)]) if id(leaf) in outs else \
                ("arg", arg_ids[id(leaf)]) if id(leaf) in arg_ids else None
        else:
            source = ("const", leaf) if isinstance(leaf, _CONSTANTS) else None
        if source is None:
            return None
        sources.append(source)
    return sources


class DirectCall:
    """The forward, as the captured graph called directly with a CallSpec."""

    def __init__(self, graph: fx.GraphModule, spec: CallSpec, model: nn.Module, signature: inspect.Signature):
        self.graph_forward = graph.forward  # skips nn.Module.__call__'s hook handling
        self.arg_names = spec.arg_names
        self.defaults = {n: p.default for n, p in signature.parameters.items()
                         if p.default is not inspect.Parameter.empty}
        tensors = {**dict(model.named_parameters(remove_duplicate=False)),
                   **dict(model.named_buffers(remove_duplicate=False))}
        self.template = [tensors[s[1]] if s[0] == "tensor" else None for s in spec.inputs]
        self.arg_slots = [(slot, s[1]) for slot, s in enumerate(spec.inputs) if s[0] == "arg"]
        self.size_slots = [(slot, s[1], s[2]) for slot, s in enumerate(spec.inputs) if s[0] == "size"]
        self.leaves = spec.output_leaves
        self.treespec = pytree.treespec_loads(spec.output_spec)
        # The common case, one tensor out of the graph, skips the pytree rebuild.
        single = self.treespec.is_leaf() and self.leaves[0][0] == "out"
        self.single_out = self.leaves[0][1] if single else None

    def __call__(self, *args, **kwargs):
        if kwargs or len(args) != len(self.arg_names):
            args = self._positional(args, kwargs)
        inputs = self.template.copy()
        for slot, i in self.arg_slots:
            inputs[slot] = args[i]
        for slot, i, d in self.size_slots:
            inputs[slot] = args[i].shape[d]
        outs = self.graph_forward(*inputs)
        if self.single_out is not None:
            return outs[self.single_out]
        values = [outs[s[1]] if s[0] == "out" else args[s[1]] if s[0] == "arg" else s[1] for s in self.leaves]
        return pytree.tree_unflatten(values, self.treespec)

    def _positional(self, args: tuple, kwargs: dict) -> tuple:
        if len(args) > len(self.arg_names):
            raise TypeError(f"forward takes {len(self.arg_names)} arguments, got {len(args)}")
        missing = object()
        values = list(args)
        for name in self.arg_names[len(args):]:
            value = kwargs.get(name, self.defaults.get(name, missing))
            if value is missing:
                raise TypeError(f"forward is missing the argument {name!r}")
            values.append(value)
        unknown = set(kwargs) - set(self.arg_names[len(args):])
        if unknown:
            raise TypeError(f"forward got unexpected or repeated argument(s) {', '.join(sorted(unknown))}")
        return tuple(values)
