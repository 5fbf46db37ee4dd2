"""Trace a repeated layer once and stamp its graph for every other call.

Dynamo's cost grows with the ops it traces: a 32-layer Llama is 32 traces of the same
layer code. While kiln captures, the forward of each class marked @repeated_layer is
wrapped so that Dynamo traces one call of each kind (same structure, None in the same
arguments) and records every other call as one opaque call. The backend then inlines a
copy of the traced layer at each such call, so the split, the passes and the compile cache
see exactly the graph a plain trace gives. Two mechanisms do the recording:

    nested_compile_region  torch >= 2.12: the forward is a nested compile region whose
                           reuse key (`reuse_hash_fn`) says which calls are alike; Dynamo
                           stamps the others as invoke_subgraph calls of one subgraph.
    kiln                   any torch (2.11 has no reuse_hash_fn): the traced call of a kind
                           is bracketed by two marker ops, and every other call is one
                           `kiln_stamp::call` op whose fake gives the traced call's output
                           shapes. Dynamo traces the wrapper's few lines, not the layer.

Why force the reuse rather than let Dynamo find it: each layer's attention op names its own
layer (`layer_name`), a string Dynamo would guard on, so no two layers would ever match.
The inline step renames the strings that name the traced layer's modules for each call.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import operator
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import fx, nn

from kiln.compile.monitor import logger
from kiln.compile.opt_in import is_repeated_layer
from kiln.compile.split import op_name

KEY_ATTR = "_kiln_stamp_key"  # set on each layer instance for the length of a capture
INDEX_ATTR = "_kiln_stamp_index"
# kiln mechanism: the layer's parameters and buffers, in _weights order. It stays after the
# capture: Dynamo's bytecode reads a stamped call's weights from it on every call where the
# forward keeps that bytecode (mode 2; mode 3 binds its inputs by identity, kiln.compile.direct_call).
WEIGHTS_ATTR = "_kiln_stamp_weights"
OFF = "set -cc.stamp_repeated_layers=false"
MECHANISMS = ("auto", "nested_compile_region", "kiln")


class StampError(RuntimeError):
    """The stamped calls cannot be made into the graph a plain trace gives."""


def supported() -> bool:
    """Whether this torch's nested_compile_region takes a reuse key (torch >= 2.12)."""
    fn = getattr(torch.compiler, "nested_compile_region", None)
    return fn is not None and "reuse_hash_fn" in inspect.signature(fn).parameters


def resolve(mechanism: str) -> str:
    """The mechanism "auto" means on this torch."""
    if mechanism == "auto":
        return "nested_compile_region" if supported() else "kiln"
    if mechanism == "nested_compile_region" and not supported():
        raise ValueError(f"compilation stamp_mechanism 'nested_compile_region' needs torch >= 2.12 "
                         f"(nested_compile_region(reuse_hash_fn=...)); this is {torch.__version__}: use 'auto' "
                         f"or 'kiln'")
    return mechanism


def _reuse_key(layer: nn.Module, *args, **kwargs) -> int:
    # Traced by Dynamo at every call; it folds to a constant.
    absent = 0
    for i, a in enumerate(args):
        if a is None:
            absent += 1 << i
    for i, name in enumerate(sorted(kwargs)):
        if kwargs[name] is None:
            absent += 1 << (16 + i)
    return getattr(layer, KEY_ATTR) * (1 << 32) + absent


def _path_pattern(path: str) -> re.Pattern:
    """`path` as a whole dotted prefix: model.layers.1 in model.layers.1.mlp, not in model.layers.10."""
    return re.compile(rf"(?<![\w]){re.escape(path)}(?![\w])")


def _structure(layer: nn.Module, path: str) -> str:
    """What makes two layers trace alike: classes, tensor shapes and dtypes, and plain
    attributes, with the layer's own module path taken out of strings."""
    own = _path_pattern(path) if path else None
    parts = []
    for name, module in layer.named_modules():
        parts.append(f"{name}:{type(module).__qualname__}")
        for tname, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            parts.append(f"{name}.{tname}:{tuple(t.shape)}:{t.dtype}:{t.device}")
        for attr, value in sorted(vars(module).items()):
            if attr.startswith("_") or not isinstance(value, (bool, int, float, str, type(None))):
                continue
            if isinstance(value, str) and own is not None:
                value = own.sub("<layer>", value)
            parts.append(f"{name}.{attr}={value!r}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def layer_kinds(model: nn.Module) -> list[list[str]]:
    """The model's repeated layers grouped by structure, in order of their first layer: Dynamo
    traces one call of each group (and of each pattern of None arguments) and stamps the rest."""
    groups: dict[str, list[str]] = {}
    for path, m in model.named_modules():
        if is_repeated_layer(m):
            groups.setdefault(_structure(m, path), []).append(path)
    return list(groups.values())


@contextlib.contextmanager
def stamping(model: nn.Module, mechanism: str = "auto") -> Iterator[None]:
    """While tracing, the forward of every @repeated_layer class in `model` records all but
    one call of each kind as a stamp (see the module's docstring)."""
    layers = [(path, m) for path, m in model.named_modules() if is_repeated_layer(m)]
    if not layers:
        yield
        return
    import torch._dynamo

    mechanism = resolve(mechanism)
    logger.info("layer stamping: %d repeated layers, %s mechanism", len(layers), mechanism)
    keys: dict[str, int] = {}
    for index, (path, layer) in enumerate(layers):
        setattr(layer, KEY_ATTR, keys.setdefault(_structure(layer, path), len(keys)))
        setattr(layer, INDEX_ATTR, index)
        if mechanism == "kiln":
            object.__setattr__(layer, WEIGHTS_ATTR, [t for _, t in _weights(layer)])  # a plain list, not registered
    # A class may inherit its forward: then the wrapper is removed again, not replaced.
    originals = {cls: cls.__dict__.get("forward") for cls in {type(m) for _, m in layers}}
    _capture.begin(layers)
    try:
        for cls in originals:
            if mechanism == "kiln":
                torch._dynamo.assume_constant_result(_claim)
                cls.forward = _kiln_stamped(cls.forward)
            else:
                cls.forward = torch.compiler.nested_compile_region(cls.forward, reuse_hash_fn=_reuse_key,
                                                                   max_reuse_entries=64)
        yield
    finally:
        _capture.end()
        for cls, forward in originals.items():
            if forward is None:
                del cls.forward
            else:
                cls.forward = forward
        for _, layer in layers:
            for attr in (KEY_ATTR, INDEX_ATTR):
                if attr in vars(layer):
                    delattr(layer, attr)


# -- kiln's own mechanism ---------------------------------------------------------------------

class _Capture:
    """What the kiln mechanism knows during one capture: the layers, which call of each kind
    Dynamo traces (its representative), and the representative's outputs as traced."""

    def __init__(self):
        self.layers: list[tuple[str, nn.Module]] = []
        self.representative: dict[int, int] = {}  # kind -> the layer index traced for it
        self.outputs: dict[int, list] = {}  # kind -> the traced call's output fakes

    def begin(self, layers):
        self.layers, self.representative, self.outputs = layers, {}, {}

    def end(self):
        self.begin([])

    def claim(self, kind: int, index: int) -> bool:
        # Idempotent for the same layer, so a Dynamo restart of the trace chooses the same one.
        return self.representative.setdefault(kind, index) == index


_capture = _Capture()


def _claim(kind: int, index: int) -> bool:
    """Run by Dynamo at trace time, not traced (`stamping` marks it so: Dynamo's import is a
    second an eager start does not pay): whether this call is its kind's representative."""
    return _capture.claim(kind, index)


@torch.library.custom_op("kiln_stamp::begin", mutates_args=())
def _begin(inputs: list[torch.Tensor], kind: int) -> list[torch.Tensor]:
    """Marks the traced call's tensor arguments (the backend removes it: an identity)."""
    return [x.clone() for x in inputs]


@_begin.register_fake
def _(inputs, kind):
    return [torch.empty_like(x) for x in inputs]


@torch.library.custom_op("kiln_stamp::end", mutates_args=())
def _end(outputs: list[torch.Tensor], kind: int) -> list[torch.Tensor]:
    """Marks the traced call's outputs (the backend removes it: an identity)."""
    return [x.clone() for x in outputs]


@_end.register_fake
def _(outputs, kind):
    _capture.outputs[kind] = list(outputs)  # what every stamped call of this kind returns
    return [torch.empty_like(x) for x in outputs]


@torch.library.custom_op("kiln_stamp::call", mutates_args=())
def _stamped_call(tensors: list[torch.Tensor], kind: int, index: int) -> list[torch.Tensor]:
    raise RuntimeError("kiln_stamp::call stands for a stamped layer only inside a capture; kiln's backend "
                       "replaces it by the layer's graph before anything runs")


@_stamped_call.register_fake
def _(tensors, kind, index):
    traced = _capture.outputs.get(kind)
    if traced is None:
        raise StampError(f"a stamped call of layer {index} came before the call Dynamo traced for its kind; {OFF}")
    return [torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device) for o in traced]


def _kiln_stamped(forward):
    """The capture's forward of a repeated layer: its kind's first call traced between two
    markers, every other one a single kiln_stamp::call op on its weights and arguments."""

    def stamped_forward(self, *args):
        if not torch.compiler.is_compiling():
            # An eager call while the capture is on (from another thread, say): the layer as written.
            return forward(self, *args)
        absent = 0
        for i, a in enumerate(args):
            if a is None:
                absent += 1 << i
        kind = getattr(self, KEY_ATTR) * (1 << 16) + absent
        index = getattr(self, INDEX_ATTR)
        tensors = [a for a in args if a is not None]
        if _claim(kind, index):
            marked = iter(torch.ops.kiln_stamp.begin(tensors, kind))
            out = forward(self, *[None if a is None else next(marked) for a in args])
            single = isinstance(out, torch.Tensor)
            ends = torch.ops.kiln_stamp.end([out] if single else list(out), kind)
            return ends[0] if single else tuple(ends)
        outs = torch.ops.kiln_stamp.call([*getattr(self, WEIGHTS_ATTR), *tensors], kind, index)
        return outs[0] if len(outs) == 1 else tuple(outs)

    stamped_forward.__wrapped__ = forward
    return stamped_forward


def _weights(layer: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*layer.named_parameters(remove_duplicate=False), *layer.named_buffers(remove_duplicate=False)]


def _tensor_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), name)
    return names


def _path_change(first: str, this: str) -> tuple[str, str] | None:
    """('model.layers.1', 'model.layers.5') from 'model.layers.1.mlp.w' and 'model.layers.5.mlp.w'."""
    a, b = first.split("."), this.split(".")
    while a and b and a[-1] == b[-1]:
        a.pop(), b.pop()
    return (".".join(a), ".".join(b)) if a and b else None


def inline_stamped(gm: fx.GraphModule, example_inputs: list, model: nn.Module) -> int:
    """Replace every invoke_subgraph call in `gm` by a copy of its subgraph, renaming the
    strings that name the traced layer's modules to the calling layer's. Returns the number
    of calls Dynamo stamped rather than traced."""
    if any(_is_stamp_op(n) for n in gm.graph.nodes):
        return _inline_kiln(gm, example_inputs, model)
    calls = [n for n in gm.graph.nodes
             if n.op == "call_function" and n.target is getattr(torch.ops.higher_order, "invoke_subgraph", None)]
    if not calls:
        return 0
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_id = _tensor_names(model)
    input_name = {p: by_id.get(id(x)) for p, x in zip(placeholders, example_inputs) if isinstance(x, torch.Tensor)}
    modules = {name for name, _ in model.named_modules()}
    traced: dict[str, tuple] = {}  # subgraph -> the operands of the call Dynamo traced it at
    for call in calls:
        body_name = call.args[0].target
        body: fx.GraphModule = getattr(gm, body_name)
        change = None
        if body_name not in traced:
            traced[body_name] = call.args[2:]
        else:
            changes = {_path_change(input_name[a], input_name[b]) for a, b in zip(traced[body_name], call.args[2:])
                       if a is not b and input_name.get(a) and input_name.get(b)}
            changes.discard(None)
            if len(changes) > 1:
                raise StampError(f"a stamped layer call reads weights of several layers ({sorted(changes)}); {OFF}")
            change = changes.pop() if changes else None
            named = _strings(body) & modules if change is None else set()
            if named:
                raise StampError(f"a stamped call of {body_name} passes no weights of its own, so kiln cannot tell "
                                 f"which layer's names ({sorted(named)}) it should get; {OFF}")
        _inline(gm, call, body, change, modules)
    for body_name in traced:
        gm.delete_submodule(body_name)
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and node.target in traced and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return len(calls) - len(traced)


def _strings(body: fx.GraphModule) -> set[str]:
    found: set[str] = set()
    for node in body.graph.nodes:
        fx.node.map_aggregate((node.args, node.kwargs), lambda v: found.add(v) if isinstance(v, str) else None)
    return found


def _inline(gm: fx.GraphModule, call: fx.Node, body: fx.GraphModule, change: tuple[str, str] | None,
            modules: set[str]) -> None:
    operands = call.args[2:]
    env: dict[fx.Node, object] = {}
    params = [n for n in body.graph.nodes if n.op == "placeholder"]
    for p, operand in zip(params, operands):
        want = p.meta.get("example_value")
        got = operand.meta.get("example_value") if isinstance(operand, fx.Node) else operand
        if isinstance(want, torch.Tensor) and (not isinstance(got, torch.Tensor) or want.dtype != got.dtype
                                               or want.dim() != got.dim()):
            raise StampError(f"the stamped layer graph {call.args[0].target} takes {p.name} as a "
                             f"{want.dim()}-d {want.dtype} tensor but this call passes {got!r}; the layers "
                             f"are not alike: {OFF}")
        env[p] = operand
    rename = _renamer(change, modules)
    result = None
    with gm.graph.inserting_before(call):
        for node in body.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                result = fx.node.map_arg(node.args[0], lambda n: env[n])
                break
            copy = gm.graph.node_copy(node, lambda n: env[n])
            if rename is not None:
                copy.args, copy.kwargs = fx.node.map_aggregate((copy.args, copy.kwargs), rename)
                stack = copy.meta.get("nn_module_stack")
                if stack:
                    copy.meta["nn_module_stack"] = {k: (rename(v[0]), *v[1:]) for k, v in stack.items()}
            env[node] = copy
    for user in list(call.users):
        if user.op != "call_function" or user.target is not operator.getitem:
            raise StampError(f"a stamped layer's result is used by {user.format_node()}, not unpacked; {OFF}")
        user.replace_all_uses_with(result[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(call)


def _renamer(change: tuple[str, str] | None, modules: set[str]):
    if change is None:
        return None
    old, new = change
    pattern = _path_pattern(old)

    def rename(value):
        if not isinstance(value, str) or pattern.search(value) is None:
            return value
        renamed = pattern.sub(new, value)
        if value in modules and renamed not in modules:
            raise StampError(f"stamping a layer renamed {value!r} to {renamed!r}, which is no module of the "
                             f"model; {OFF}")
        return renamed

    return rename


# -- inlining kiln's stamps -------------------------------------------------------------------

def _is_stamp_op(node: fx.Node, name: str | None = None) -> bool:
    if node.op != "call_function":
        return False
    op = op_name(node.target)  # the packet or the overload, as Dynamo recorded it
    return op.startswith("kiln_stamp::") and (name is None or op == f"kiln_stamp::{name}")


def _unpacked(node: fx.Node) -> dict[int, fx.Node]:
    """index -> the getitem reading that element of a list-returning op."""
    found = {}
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem:
            raise StampError(f"{node.format_node()}'s result is used by {user.format_node()}, not unpacked; {OFF}")
        found[user.args[1]] = user
    return found


def _drop_marker(gm: fx.GraphModule, marker: fx.Node) -> list:
    """Remove a begin/end marker (an identity): its readers read its inputs; returns them."""
    inputs = list(marker.args[0])
    for i, item in _unpacked(marker).items():
        item.replace_all_uses_with(inputs[i])
        gm.graph.erase_node(item)
    gm.graph.erase_node(marker)
    return inputs


@dataclass
class _Traced:
    """One kind's traced call: its body nodes, the argument nodes it was given, its outputs,
    and which layer it is."""

    nodes: list
    args: list
    outputs: list
    index: int


def _inline_kiln(gm: fx.GraphModule, example_inputs: list, model: nn.Module) -> int:
    layers = [(path, m) for path, m in model.named_modules() if is_repeated_layer(m)]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_id = _tensor_names(model)
    input_name = {p: by_id.get(id(x)) for p, x in zip(placeholders, example_inputs) if isinstance(x, torch.Tensor)}
    modules = {name for name, _ in model.named_modules()}
    traced: dict[int, _Traced] = {}
    nodes = list(gm.graph.nodes)
    for begin in [n for n in nodes if _is_stamp_op(n, "begin")]:
        kind = begin.args[1]
        end = next((n for n in nodes[nodes.index(begin) + 1:] if _is_stamp_op(n, "end") and n.args[1] == kind), None)
        if end is None:
            raise StampError(f"the traced call of layer kind {kind} has no end marker; {OFF}")
        markers = {begin, end, *begin.users}  # the markers and their unpacking getitems
        body = [n for n in nodes[nodes.index(begin) + 1:nodes.index(end)] if n not in markers and n.op != "placeholder"]
        traced[kind] = _Traced(body, _drop_marker(gm, begin), _drop_marker(gm, end), _index_of(body, layers))
    calls = [n for n in gm.graph.nodes if _is_stamp_op(n, "call")]
    for call in calls:
        tensors, kind, index = call.args
        rep = traced.get(kind)
        if rep is None:
            raise StampError(f"layer {layers[index][0]} was stamped from a kind Dynamo never traced; {OFF}")
        names = [name for name, _ in _weights(layers[index][1])]
        weights = dict(zip(names, tensors[:len(names)]))
        _inline_call(gm, call, rep, list(tensors[len(names):]), weights, layers, input_name, modules)
    gm.graph.lint()
    gm.recompile()
    return len(calls)


def _index_of(body: list, layers: list) -> int:
    """Which layer a traced body is: the layer whose module path its nodes carry."""
    paths = {path: i for i, (path, _) in enumerate(layers)}
    for node in body:
        for entry in (node.meta.get("nn_module_stack") or {}).values():
            path = entry[0] if isinstance(entry, tuple) else entry
            for candidate in _module_paths(path):
                if candidate in paths:
                    return paths[candidate]
    raise StampError(f"cannot tell which layer a traced call belongs to (no module stack); {OFF}")


def _module_paths(name: str) -> list[str]:
    """'model.layers.0.mlp' from Dynamo's module-stack names ("L['self'].model.layers[0].mlp" or
    the plain dotted path), and each of its prefixes."""
    plain = re.sub(r"\[(\d+)\]", r".\1", re.sub(r"^L\['self'\]\.?", "", name)).strip(".")
    parts = plain.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _inline_call(gm: fx.GraphModule, call: fx.Node, rep: _Traced, args: list, weights: dict[str, fx.Node],
                 layers: list, input_name: dict, modules: set[str]) -> None:
    rep_path, this_path = layers[rep.index][0], layers[call.args[2]][0]
    if len(args) != len(rep.args):
        raise StampError(f"layer {this_path} is called with {len(args)} tensors where the traced {rep_path} took "
                         f"{len(rep.args)}; the layers are not alike: {OFF}")
    from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

    env: dict[fx.Node, object] = {}
    for want, got in zip(rep.args, args):
        a, b = want.meta.get("example_value"), got.meta.get("example_value")
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.dim() == b.dim() and statically_known_true(sym_eq(a.shape, b.shape))):
            raise StampError(f"layer {this_path} is called with {b!r} where the traced {rep_path} took {a!r}; the "
                             f"layers are not alike: {OFF}")
        env[want] = got
    prefix = rep_path + "."
    rename = _renamer((rep_path, this_path), modules)
    with gm.graph.inserting_before(call):
        for node in rep.nodes:
            for used in node.all_input_nodes:
                if used in env:
                    continue
                name = input_name.get(used)
                if used.op == "placeholder" and name is not None and name.startswith(prefix):
                    env[used] = weights[name[len(prefix):]]  # the traced layer's weight -> this layer's
                elif used.op == "placeholder" or used in rep.nodes:
                    env.setdefault(used, used)  # shared (the token count, a model-level tensor) or its own
                else:
                    raise StampError(f"the traced {rep_path} reads {used.format_node()}, computed outside its "
                                     f"arguments; kiln cannot tell what layer {this_path} would read: {OFF}")
            copy = gm.graph.node_copy(node, lambda n: env[n])
            copy.args, copy.kwargs = fx.node.map_aggregate((copy.args, copy.kwargs), rename)
            stack = copy.meta.get("nn_module_stack")
            if stack:
                copy.meta["nn_module_stack"] = {k: (rename(v[0]), *v[1:]) for k, v in stack.items()}
            env[node] = copy
    for i, item in _unpacked(call).items():
        item.replace_all_uses_with(env[rep.outputs[i]])
        gm.graph.erase_node(item)
    gm.graph.erase_node(call)
