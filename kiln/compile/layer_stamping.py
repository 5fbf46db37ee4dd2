"""Trace a repeated layer once and stamp its graph for every other call.

Dynamo's cost grows with the ops it traces: a 32-layer Llama is 32 traces of the same
layer code. While kiln captures, the forward of each class marked @repeated_layer becomes
a nested compile region whose reuse key says which calls are alike, so Dynamo traces one
call of each kind and stamps the others out as calls of the same subgraph
(invoke_subgraph). The backend then inlines every call back into one flat graph, so the
split, the passes and the compile cache see exactly what a plain trace gives.

Why force the reuse with a key rather than let Dynamo guard it: each layer's attention op
names its own layer (`layer_name`), a string Dynamo would guard on, so no two layers
would ever match. The key leaves out strings that name the layer's own modules; the inline
step renames them for each call, reading which layer a call is from its weights.

Needs torch >= 2.12 (`reuse_hash_fn`); older torch traces every layer, as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import operator
import re
from collections.abc import Iterator

import torch
from torch import fx, nn

from kiln.compile.monitor import logger
from kiln.compile.opt_in import is_repeated_layer

KEY_ATTR = "_kiln_stamp_key"  # set on each layer instance for the length of a capture
OFF = "set -cc.stamp_repeated_layers=false"


class StampError(RuntimeError):
    """The stamped calls cannot be made into the graph a plain trace gives."""


def supported() -> bool:
    fn = getattr(torch.compiler, "nested_compile_region", None)
    return fn is not None and "reuse_hash_fn" in inspect.signature(fn).parameters


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


@contextlib.contextmanager
def stamping(model: nn.Module) -> Iterator[None]:
    """While tracing, the forward of every @repeated_layer class in `model` is a nested
    compile region keyed by the layer's structure."""
    layers = [(path, m) for path, m in model.named_modules() if is_repeated_layer(m)]
    if layers and not supported():
        logger.info("layer stamping needs torch.compiler.nested_compile_region(reuse_hash_fn=...) "
                    "(torch >= 2.12; this is %s): Dynamo traces all %d layers", torch.__version__, len(layers))
    if not layers or not supported():
        yield
        return
    keys: dict[str, int] = {}
    for path, layer in layers:
        setattr(layer, KEY_ATTR, keys.setdefault(_structure(layer, path), len(keys)))
    # A class may inherit its forward: then the wrapper is removed again, not replaced.
    originals = {cls: cls.__dict__.get("forward") for cls in {type(m) for _, m in layers}}
    try:
        for cls in originals:
            cls.forward = torch.compiler.nested_compile_region(cls.forward, reuse_hash_fn=_reuse_key,
                                                               max_reuse_entries=64)
        yield
    finally:
        for cls, forward in originals.items():
            if forward is None:
                del cls.forward
            else:
                cls.forward = forward
        for _, layer in layers:
            delattr(layer, KEY_ATTR)


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
