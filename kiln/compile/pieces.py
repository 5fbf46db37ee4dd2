"""Compiled pieces: one artifact per unique piece and token shape, picked per call.

A token shape is a compile range [lo, hi] (the ranges partition [1, max_num_batched_tokens])
or an exact compile size n. A call with n tokens takes the exact size if there is one,
else the range that contains n.

Pieces with the same structure (the 30 middle layers of SmolLM2) share their artifacts:
every weight is an input of the piece, so one compiled function serves them all.
"""

from __future__ import annotations

import bisect
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import sympy
import torch
from torch import fx
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from kiln.compile.monitor import CompileMonitor


@dataclass(frozen=True)
class TokenShape:
    lo: int
    hi: int

    @property
    def is_size(self) -> bool:
        return self.lo == self.hi

    def __str__(self) -> str:
        return f"size {self.lo}" if self.is_size else f"range [{self.lo}, {self.hi}]"


class ShapePlan:
    """The compile ranges and sizes for token counts in [1, max_tokens]."""

    def __init__(self, range_ends: list[int], sizes: list[int], max_tokens: int):
        self.ends = [e for e in range_ends if e < max_tokens] + [max_tokens]
        starts = [1] + [e + 1 for e in self.ends[:-1]]
        self.ranges = [TokenShape(lo, hi) for lo, hi in zip(starts, self.ends)]
        self.sizes = {n: TokenShape(n, n) for n in sizes if n <= max_tokens}
        self.max_tokens = max_tokens

    def shape_for(self, num_tokens: int) -> TokenShape:
        exact = self.sizes.get(num_tokens)
        if exact is not None:
            return exact
        if not 1 <= num_tokens <= self.max_tokens:
            raise ValueError(f"{num_tokens} tokens is outside [1, {self.max_tokens}] "
                             f"(max_num_batched_tokens) that the model was compiled for")
        return self.ranges[bisect.bisect_left(self.ends, num_tokens)]

    def all_shapes(self) -> list[TokenShape]:
        return self.ranges + list(self.sizes.values())


def structural_hash(gm: fx.GraphModule, inputs: list, tokens: frozenset[sympy.Symbol]) -> str:
    """Equal for pieces that compute the same thing from inputs of the same shapes."""
    names: dict[fx.Node, str] = {}
    lines, placeholders = [], iter(inputs)
    for i, node in enumerate(gm.graph.nodes):
        names[node] = f"v{i}"
        what = _describe(next(placeholders), tokens) if node.op == "placeholder" else ""
        target = node.target
        if node.op == "placeholder":
            target = ""  # its name is the parameter's, which differs from layer to layer
        elif node.op == "call_function":
            target = getattr(target, "__module__", "") + "." + getattr(target, "__name__", str(target))
        elif node.op == "get_attr":
            target = f"{target}@{id(getattr(gm, target))}"  # a constant: never shared
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: names[n])
        lines.append(f"{node.op} {target} {args!r} {what}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _describe(value, tokens: frozenset[sympy.Symbol]) -> str:
    def dims(seq):
        return [str(_expr(d).xreplace(dict.fromkeys(tokens, sympy.Symbol("T")))) for d in seq]

    if isinstance(value, torch.Tensor):
        return f"tensor {value.dtype} {value.device} {dims(value.shape)} {dims(value.stride())}"
    if isinstance(value, torch.SymInt):
        return f"symint {dims([value])}"
    return f"{type(value).__name__} {value!r}"


def _expr(value) -> sympy.Expr:
    return value.node.expr if isinstance(value, torch.SymInt) else sympy.Integer(value)


def specialise(template: list, tokens: frozenset[sympy.Symbol], shape: TokenShape,
               hint: int) -> tuple[FakeTensorMode, list]:
    """Fake inputs for compiling a piece for `shape`: the token symbol becomes the size, or a
    fresh symbol bounded to the range, in a shape env of the piece's own."""
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    if shape.is_size:
        new, hint = sympy.Integer(shape.lo), shape.lo
    else:
        hint = min(max(hint, shape.lo, 2), shape.hi)
        new = env.create_symbol(hint, ConstantSource("num_tokens"), dynamic_dim=DimDynamic.DYNAMIC)
        env.constrain_symbol_range(new, shape.lo, shape.hi)

    def value(x):
        expr = _expr(x).xreplace(dict.fromkeys(tokens, new))
        if expr.is_number:
            return int(expr)
        return env.create_symintnode(expr, hint=int(expr.xreplace({new: hint})))

    inputs = []
    with mode:
        for x in template:
            if isinstance(x, torch.Tensor):
                x = torch.empty_strided([value(d) for d in x.shape], [value(d) for d in x.stride()],
                                        dtype=x.dtype, device=x.device)
            elif isinstance(x, torch.SymInt):
                x = value(x)
            inputs.append(x)
    return mode, inputs


def compile_piece(gm: fx.GraphModule, mode: FakeTensorMode, inputs: list) -> Callable:
    # standalone_compile: its artifact can be saved, which the on-disk cache will need.
    with torch._guards.tracing(torch._guards.TracingContext(mode)):
        return torch._inductor.standalone_compile(gm, inputs, dynamic_shapes="from_tracing_context")


@dataclass
class UniquePiece:
    name: str  # the first submodule with this structure
    graph: fx.GraphModule
    template: list  # its fake inputs as traced, sizes in terms of the token symbol


class PieceSet:
    """The unique pieces of one split graph and their artifacts per token shape."""

    def __init__(self, uniques: list[UniquePiece], tokens: frozenset[sympy.Symbol], traced_tokens: int,
                 plan: ShapePlan, compiler: str, monitor: CompileMonitor):
        # tokens: the token symbol and its aliases; traced_tokens: the capture call's count,
        # the size hint Inductor tunes a range for when it holds that count.
        self.uniques, self.tokens, self.traced_tokens = uniques, tokens, traced_tokens
        self.plan, self.compiler, self.monitor = plan, compiler, monitor
        self.by_shape: dict[TokenShape, list[Callable]] = {}
        self.by_tokens: dict[int, list[Callable]] = {}
        self.frozen = False  # eager strategy: everything is compiled, serving must not compile
        self.captured = False

    def table(self, num_tokens: int) -> list[Callable]:
        """The artifact of every unique piece for a call with `num_tokens` tokens."""
        table = self.by_tokens.get(num_tokens)
        if table is None:
            shape = self.plan.shape_for(num_tokens)
            table = self.by_tokens[num_tokens] = self.by_shape.get(shape) or self.compile(shape)
        return table

    def compile(self, shape: TokenShape) -> list[Callable]:
        if self.frozen:
            raise RuntimeError(f"kiln would compile {shape} while serving, but the eager strategy "
                               f"compiled every range and size at capture; this is a kiln bug")
        if self.compiler == "eager":  # the pieces run as captured: one callable serves every shape
            table = [piece.graph for piece in self.uniques]
        else:
            table = self._inductor(shape)
        self.by_shape[shape] = table
        return table

    def _inductor(self, shape: TokenShape) -> list[Callable]:
        start = time.perf_counter()
        table = []
        with self.monitor.progress(len(self.uniques), f"compiling {shape}") as bar:
            for piece in self.uniques:
                mode, inputs = specialise(piece.template, self.tokens, shape, self.traced_tokens)
                with self.monitor.piece_compile(f"{piece.name} for {shape}", self.captured):
                    table.append(compile_piece(piece.graph, mode, inputs))
                bar.update()
        self.monitor.shape_compiled(str(shape), time.perf_counter() - start)
        return table


class PieceRunner:
    """Stands in for one piece of the split graph: runs its unique piece's artifact for the
    token count of this call."""

    def __init__(self, pieces: PieceSet, index: int, token_arg: int, token_dim: int | None):
        self.pieces, self.index = pieces, index
        self.token_arg, self.token_dim = token_arg, token_dim  # token_dim None: the arg is the count

    def __call__(self, *args):
        count = args[self.token_arg]
        if self.token_dim is not None:
            count = count.shape[self.token_dim]
        return self.pieces.table(count)[self.index](*args)


def token_locator(template: list, tokens: frozenset[sympy.Symbol]) -> tuple[int, int | None] | None:
    """Where a piece's inputs carry the token count: a SymInt input, else a tensor dim."""
    for i, x in enumerate(template):
        if isinstance(x, torch.SymInt) and _expr(x) in tokens:
            return i, None
    for i, x in enumerate(template):
        if isinstance(x, torch.Tensor):
            for d, size in enumerate(x.shape):
                if _expr(size) in tokens:
                    return i, d
    return None
