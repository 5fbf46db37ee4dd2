"""The stages of `kiln bisect`: where a compiled forward first parts from eager.

Stages, each a step further from the model as written:

    eager         the model's forward: the reference
    dynamo+eager  the forward captured by Dynamo (fullgraph) and run as captured
    aot_eager     every piece traced by AOTAutograd and run eagerly
    inductor      every piece compiled by Inductor

The forward is captured once and split at the split ops, as kiln's pipeline does. Running
the split graph on the prompt records every piece's real inputs and outputs. Each backend
then compiles each piece and runs it on the SAME inputs, so an error that a piece shows is
its own, not one carried in from the pieces before it. In the first piece that diverges,
a binary search over copies of the piece cut after one node finds the first op that does.

Numbers and tokens are separate verdicts: greedy decoding runs each stage's whole model
(the built-in stages through kiln's own compile_model), and fusion may change tokens while
staying within tolerance, or the reverse.

Extra backends are piece compilers, `compiler(gm, example_inputs) -> callable`, like
Dynamo's. `gm.meta["piece"]` names the piece it is handed (e.g. "submod_2"); it gets a
fresh copy of the graph each time, so it may rewrite it.
"""

from __future__ import annotations

import math
import re
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx

from kiln.compile import compile_model, dynamic_arg_dims, effective_split_ops
from kiln.compile.config import CompilationConfig
from kiln.compile.split import SplitGraph, split_graph

Compiler = Callable[[fx.GraphModule, list], Callable]

DEFAULT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
REFERENCE, CAPTURED = "eager", "dynamo+eager"


class BisectError(ValueError):
    pass


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖ in float64 (the absolute norm where want is all zeros)."""
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        return math.inf
    diff = torch.linalg.vector_norm(got - want).item()
    scale = torch.linalg.vector_norm(want).item()
    if math.isnan(diff):
        return math.inf
    return diff / scale if scale > 0 else diff


def inductor_piece(gm: fx.GraphModule, example_inputs: list) -> Callable:
    # Static shapes: the piece is compiled for the prompt it is checked on, like kiln's
    # compile_sizes; the token stage runs kiln's own range compile.
    return torch._inductor.standalone_compile(gm, example_inputs, dynamic_shapes="from_example_inputs")


def builtin_backends() -> dict[str, Compiler]:
    return {"aot_eager": torch._dynamo.lookup_backend("aot_eager"), "inductor": inductor_piece}


# How kiln's own pipeline runs each built-in stage, for the token check.
KILN_CONFIGS = {
    CAPTURED: lambda: CompilationConfig(mode=3, piece_compiler="eager"),
    "aot_eager": lambda: CompilationConfig(mode=2, backend="aot_eager"),
    "inductor": lambda: CompilationConfig.level(2),
}


class CapturedForward:
    """The model's forward captured once by Dynamo; whatever `executor` is runs its graph.

    The first call records the graph and its real inputs (weights included: Dynamo lifts
    them to graph inputs). Later calls with other token counts reuse the graph.
    """

    def __init__(self, model: torch.nn.Module):
        self.model, self.dims = model, dynamic_arg_dims(model)
        if self.dims is None:
            raise BisectError(f"{type(model).__name__} is not decorated with @compile_dynamic")
        forward = type(model).forward
        # A private code object: Dynamo caches per code object, and kiln's own captures of
        # the same class must not see this one's graph.
        code = forward.__code__.replace()
        fn = types.FunctionType(code, forward.__globals__, forward.__name__, forward.__defaults__,
                                forward.__closure__)
        self.compiled = torch.compile(types.MethodType(fn, model), fullgraph=True, backend=self._record)
        self.graph: fx.GraphModule | None = None
        self.inputs: list | None = None
        self.executor: Callable | None = None

    def _record(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        if self.graph is not None:
            raise BisectError("Dynamo captured the forward a second time; bisect needs one graph")
        self.graph = self.executor = gm

        def run(*args):
            if self.inputs is None:
                self.inputs = list(args)
            return self.executor(*args)

        return run

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.graph is None:
            arguments = {"input_ids": input_ids, "positions": positions}
            for name, dim in self.dims.items():
                torch._dynamo.mark_dynamic(arguments[name], dim)
        return self.compiled(input_ids, positions)


def graph_returning(gm: fx.GraphModule, outputs: list[fx.Node] | None, piece: str) -> fx.GraphModule:
    """A fresh copy of `gm`; returning `outputs` instead of its own, with dead code removed."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    result = graph.graph_copy(gm.graph, env)
    graph.output(result if outputs is None else tuple(env[n] for n in outputs))
    copy = fx.GraphModule(gm, graph)
    if outputs is not None:
        copy.graph.eliminate_dead_code()
        copy.recompile()
    copy.meta["piece"] = piece
    return copy


def _clone(x):
    if isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter):
        return x.clone()
    return x


def _flat(out) -> list:
    return list(out) if isinstance(out, (list, tuple)) else [out]


@dataclass
class PieceRun:
    inputs: list
    outputs: list


def record_pieces(split: SplitGraph, inputs: list) -> dict[str, PieceRun]:
    """Run the split graph as captured; keep every piece's real inputs and outputs."""
    runs: dict[str, PieceRun] = {}
    wanted = set(split.pieces)

    class Recorder(fx.Interpreter):
        def call_module(self, target, args, kwargs):
            out = super().call_module(target, args, kwargs)
            if target in wanted:
                # Copies: an opaque region later writes into some of these tensors.
                runs[target] = PieceRun([_clone(a) for a in args], [_clone(o) for o in _flat(out)])
            return out

    Recorder(split.module).run(*inputs)
    return runs


def _target_name(node: fx.Node) -> str:
    """'Tensor.float', 'torch.rsqrt', 'operator.mul', 'torch._C._nn.linear', 'aten.mm.default'."""
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    name = getattr(node.target, "__name__", None)
    if name is None or isinstance(node.target, torch._ops.OpOverload):
        return str(node.target)
    module = (getattr(node.target, "__module__", None) or "").removeprefix("_")
    return f"{module}.{name}" if module else name


def _uninitialized(node: fx.Node) -> bool:
    """A tensor made by empty/empty_like: its values are garbage until an opaque op fills it."""
    return isinstance(node, fx.Node) and "empty" in _target_name(node)


def _checked_outputs(gm: fx.GraphModule) -> list[bool]:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return [not _uninitialized(n) for n in _flat(output.args[0])]


def output_error(got: list, want: list, checked: list[bool]) -> tuple[float, int]:
    """The largest relative error over the checked tensor outputs, and its output index."""
    worst, where = 0.0, -1
    for i, (g, w, c) in enumerate(zip(got, want, checked)):
        if c and isinstance(w, torch.Tensor) and w.is_floating_point():
            err = relative_error(g, w)
            if err > worst or where < 0:
                worst, where = err, i
    return worst, where


@dataclass
class Where:
    """A piece or an op, located in the model's modules and source."""

    modules: str  # e.g. "model.layers.3.mlp" or "model.layers.0.self_attn.o_proj .. model.layers.1.self_attn"
    source: str  # "file:line in fn: code", the innermost frame of the model code


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path.removeprefix("L['self'].").removeprefix("L['self']")


def _source_line(node: fx.Node) -> str:
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    frames = [i for i, line in enumerate(trace) if line.lstrip().startswith("File ")]
    if not frames:
        return ""
    head = trace[frames[-1]].strip()  # File "path", line N, in fn
    code = trace[frames[-1] + 1].strip() if frames[-1] + 1 < len(trace) else ""
    path, _, rest = head.removeprefix('File "').partition('", line ')
    line, _, fn = rest.partition(", in ")
    return f"{_short_path(path)}:{line} in {fn}: {code}"


def _short_path(path: str) -> str:
    marker = "/kiln/"
    return "kiln/" + path.rsplit(marker, 1)[1] if marker in path else path


def locate_piece(gm: fx.GraphModule) -> Where:
    nodes = [n for n in gm.graph.nodes if n.op.startswith("call_")]
    paths = [p for p in map(_module_path, nodes) if p]
    span = paths[0] if paths and paths[0] == paths[-1] else f"{paths[0]} .. {paths[-1]}" if paths else "?"
    return Where(span, _source_line(nodes[0]) if nodes else "")


@dataclass
class OpDivergence:
    node: str  # the FX node, e.g. "mul_3"
    op: str  # its target, e.g. "operator.mul"
    args: str
    where: Where
    error: float


@dataclass
class PieceDivergence:
    piece: str
    where: Where
    error: float
    op: OpDivergence | None


@dataclass
class StageResult:
    name: str
    scope: str  # what the error covers: "whole model" or "each piece on the reference inputs"
    error: float  # the worst relative error
    worst_piece: str | None = None
    model_error: float | None = None  # whole model, the pieces chained
    divergence: PieceDivergence | None = None
    tokens: list[int] | None = None
    token_route: str = ""  # how the whole model ran for the tokens
    failed: str | None = None  # the compiler's error, if it could not compile a piece


def node_values(gm: fx.GraphModule, inputs: list) -> dict[str, object]:
    """Every node's value when the piece runs as captured (tensors copied)."""
    values: dict[str, object] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            values[n.name] = _clone(out)
            return out

    Recorder(gm).run(*inputs)
    return values


def _candidates(gm: fx.GraphModule, values: dict, last: fx.Node) -> list[fx.Node]:
    """Nodes up to `last` whose value is a float tensor that is not uninitialized."""
    out = []
    for n in gm.graph.nodes:
        v = values.get(n.name)
        if n.op.startswith("call_") and isinstance(v, torch.Tensor) and v.is_floating_point() \
                and not _uninitialized(n):
            out.append(n)
        if n is last:
            break
    return out


def _arg_name(arg) -> str:
    """A lifted weight by its module path (model.layers.0.mlp.gate_up_proj.weight), else as FX prints it."""
    if isinstance(arg, fx.Node) and arg.op == "placeholder" and arg.name.lower().startswith("l_self_"):
        return re.sub(r"_?(modules|parameters|buffers)_", ".", arg.name[len("l_self_"):].rstrip("_")).lstrip(".")
    return str(arg)


def first_diverging_op(compiler: Compiler, piece: str, gm: fx.GraphModule, inputs: list,
                       bad_output: fx.Node, tol: float) -> OpDivergence | None:
    """Binary search for the first node whose value diverges when the piece is cut there.

    The graph cut after node k returns the values nothing before the cut uses (its
    frontier), so the compiler still fuses as it would, and a divergence anywhere before
    the cut shows at the frontier. "Something up to k diverges" grows with k, so log2(nodes)
    compiles find the first k where it does; node k is the op.
    """
    values = node_values(gm, inputs)
    nodes = _candidates(gm, values, bad_output)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    errors: dict[int, dict[fx.Node, float]] = {}

    def diverges(k: int) -> bool:
        if k not in errors:
            cut = order[nodes[k]]
            frontier = [n for n in nodes[: k + 1] if all(order[u] > cut for u in n.users)]
            got = _flat(compiler(graph_returning(gm, frontier, piece), inputs)(*inputs))
            errors[k] = {n: relative_error(g, values[n.name]) for n, g in zip(frontier, got)}
        return max(errors[k].values()) > tol

    if not nodes or not diverges(len(nodes) - 1):
        return None  # the piece diverges only as a whole (fusion across the nodes)
    lo, hi = 0, len(nodes) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if diverges(mid):
            hi = mid
        else:
            lo = mid + 1
    node = nodes[lo]
    args = ", ".join(_arg_name(a) for a in node.args)
    return OpDivergence(node.name, _target_name(node), args, Where(_module_path(node), _source_line(node)),
                        errors[lo][node])


def check_pieces(name: str, compiler: Compiler, split: SplitGraph, runs: dict[str, PieceRun],
                 tol: float) -> tuple[StageResult, dict[str, Callable]]:
    """Compile every piece with `compiler`, run it on its reference inputs, compare outputs."""
    result = StageResult(name, "each piece on the reference inputs", 0.0)
    compiled: dict[str, Callable] = {}
    for piece in split.pieces:
        gm, run = getattr(split.module, piece), runs[piece]
        try:
            compiled[piece] = compiler(graph_returning(gm, None, piece), run.inputs)
            got = _flat(compiled[piece](*run.inputs))
        except Exception as e:  # a compiler crash is a finding too; report it, do not hide it
            first_line = (str(e).strip().splitlines() or [""])[0]
            result.failed = f"{piece}: {type(e).__name__}: {first_line}"
            return result, compiled
        err, index = output_error(got, run.outputs, _checked_outputs(gm))
        if err > result.error or result.worst_piece is None:
            result.error, result.worst_piece = err, piece
        if err > tol and result.divergence is None:
            output = next(n for n in gm.graph.nodes if n.op == "output")
            bad = _flat(output.args[0])[index]
            op = first_diverging_op(compiler, piece, gm, run.inputs, bad, tol)
            result.divergence = PieceDivergence(piece, locate_piece(gm), err, op)
    return result, compiled


class ShapeCompiledPiece(torch.nn.Module):
    """A piece compiled by `compiler` once per input shape, on first use."""

    def __init__(self, name: str, gm: fx.GraphModule, compiler: Compiler, first: tuple | None = None):
        super().__init__()
        self.name, self.gm, self.compiler = name, gm, compiler
        self.by_shape: dict[tuple, Callable] = dict([first]) if first else {}

    def forward(self, *args):
        key = shape_key(args)
        if key not in self.by_shape:
            self.by_shape[key] = self.compiler(graph_returning(self.gm, None, self.name), list(args))
        return self.by_shape[key](*args)


def shape_key(args) -> tuple:
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)


def swapped_module(split: SplitGraph, compiler: Compiler, compiled: dict[str, Callable],
                   runs: dict[str, PieceRun]) -> fx.GraphModule:
    """The split graph with every piece run by `compiler` (reusing what is compiled)."""
    root = {}
    for name in split.pieces + split.regions:
        gm = getattr(split.module, name)
        if name in split.pieces:
            first = (shape_key(runs[name].inputs), compiled[name]) if name in compiled else None
            gm = ShapeCompiledPiece(name, gm, compiler, first)
        root[name] = gm
    return fx.GraphModule(root, graph_returning(split.module, None, "").graph)


def greedy(forward: Callable, model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens; every call has the same length, so a static compile serves them all.

    Attention without a forward context is causal within the call, so the padding after
    the last real token cannot change the logits of the tokens before it.
    """
    device = next(model.parameters()).device
    length = len(prompt) + n - 1
    ids = torch.zeros(length, dtype=torch.long, device=device)
    ids[: len(prompt)] = torch.tensor(prompt, device=device)
    positions = torch.arange(length, device=device)
    out = []
    for i in range(n):
        row = len(prompt) + i - 1
        hidden = forward(ids, positions)
        token = int(model.compute_logits(hidden[row: row + 1]).argmax(-1))
        out.append(token)
        if row + 1 < length:
            ids[row + 1] = token
    return out


@dataclass
class BisectReport:
    model: str
    prompt: str
    dtype: str
    device: str
    prompt_tokens: int
    tolerance: float
    pieces: int
    regions: int
    split_ops: list[str]
    new_tokens: int
    stages: list[StageResult] = field(default_factory=list)
    decode: Callable[[list[int]], str] | None = None

    @property
    def first_divergence(self) -> StageResult | None:
        return next((s for s in self.stages if s.failed or s.error > self.tolerance), None)


def bisect(model: torch.nn.Module, prompt: list[int], *, tolerance: float | None = None, new_tokens: int = 16,
           extra_backends: dict[str, Compiler] | None = None, stages: list[str] | None = None,
           model_name: str = "model", prompt_text: str | None = None) -> BisectReport:
    """Check every stage on `prompt` (token ids); see the module docstring."""
    if len(prompt) < 2:
        raise BisectError("the prompt needs at least 2 tokens (Dynamo specialises a 1-token call)")
    dtype = next(model.parameters()).dtype
    tol = DEFAULT_TOLERANCE.get(dtype, 1e-4) if tolerance is None else tolerance
    backends = {**builtin_backends(), **(extra_backends or {})}
    if stages is not None:
        unknown = sorted(set(stages) - set(backends) - {CAPTURED})
        if unknown:
            raise BisectError(f"unknown stage(s) {', '.join(unknown)}; known: {CAPTURED}, {', '.join(backends)}")
        backends = {k: v for k, v in backends.items() if k in stages}
    device = next(model.parameters()).device
    ids, positions = torch.tensor(prompt, device=device), torch.arange(len(prompt), device=device)
    names = {op.name for op in effective_split_ops()}
    with torch.inference_mode():
        want = model(ids, positions)
        captured = CapturedForward(model)
        got = captured(ids.clone(), positions.clone())
        split = split_graph(captured.graph, names)
        runs = record_pieces(split, captured.inputs)
        report = BisectReport(model_name, str(prompt) if prompt_text is None else prompt_text,
                              str(dtype).removeprefix("torch."), str(device), len(prompt), tol,
                              len(split.pieces), len(split.regions), sorted(names), new_tokens)
        reference = greedy(model, model, prompt, new_tokens)
        report.stages.append(StageResult(REFERENCE, "reference", 0.0, tokens=reference, token_route="the model"))
        report.stages.append(_captured_stage(model, prompt, new_tokens, relative_error(got, want)))
        for name, compiler in backends.items():
            report.stages.append(_backend_stage(name, compiler, model, prompt, new_tokens, split, runs,
                                                captured, want, tol))
    return report


def _kiln_forward(model: torch.nn.Module, name: str, length: int) -> Callable:
    return compile_model(model, KILN_CONFIGS[name](), max_num_batched_tokens=max(length, 2))


def _captured_stage(model, prompt, n, error) -> StageResult:
    stage = StageResult(CAPTURED, "whole model", error, model_error=error)
    stage.tokens = greedy(_kiln_forward(model, CAPTURED, len(prompt) + n), model, prompt, n)
    stage.token_route = "kiln -O1 (mode 3, pieces as captured)"
    return stage


def _backend_stage(name, compiler, model, prompt, n, split, runs, captured, want, tol) -> StageResult:
    stage, compiled = check_pieces(name, compiler, split, runs, tol)
    if stage.failed:
        return stage
    chained = swapped_module(split, compiler, compiled, runs)
    captured.executor = chained
    try:
        stage.model_error = relative_error(_flat(chained(*captured.inputs))[0], want)
        if name in KILN_CONFIGS:
            forward = _kiln_forward(model, name, len(prompt) + n)
            stage.token_route = {"aot_eager": "kiln mode 2, backend aot_eager",
                                 "inductor": "kiln -O2 (mode 3, Inductor pieces)"}[name]
        else:
            forward = captured
            stage.token_route = f"the split graph, pieces by {name}"
        stage.tokens = greedy(forward, model, prompt, n)
    finally:
        captured.executor = captured.graph
    return stage
