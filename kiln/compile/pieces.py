"""Compiled pieces: one artifact per unique piece and token shape, picked per call.

A token shape is a compile range [lo, hi] (the ranges partition [1, max_num_batched_tokens])
or an exact compile size n. A call with n tokens takes the exact size if there is one,
else the range that contains n.

Pieces with the same structure (the 30 middle layers of SmolLM2) share their artifacts:
every weight is an input of the piece, so one compiled function serves them all.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import os
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import sympy
import torch
from torch import fx
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from kiln.compile import trace
from kiln.compile.compile_workers import CompileWorkers, PieceJob
from kiln.compile.monitor import CompileMonitor, logger
from kiln.compile.passes.target import compiling


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


TOKENS = sympy.Symbol("T", integer=True, positive=True)  # the token count in a PieceInput


@dataclass(frozen=True)
class PieceInput:
    """One input of a piece, with sizes in terms of the token count T: what the piece is
    compiled for. It pickles, so a cache entry can compile a piece again without Dynamo."""

    kind: str  # "tensor", "symint" (the token count itself, or an expression of it) or "value"
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    sizes: tuple[sympy.Expr, ...] = ()  # for "symint": one expression
    strides: tuple[sympy.Expr, ...] = ()
    value: object = None  # for "value": a constant the graph passes along

    @classmethod
    def of(cls, x, tokens: frozenset[sympy.Symbol]) -> "PieceInput":
        def exprs(seq):
            return tuple(_expr(d).xreplace(dict.fromkeys(tokens, TOKENS)) for d in seq)

        if isinstance(x, torch.Tensor):
            return cls("tensor", x.dtype, x.device, exprs(x.shape), exprs(x.stride()))
        if isinstance(x, torch.SymInt):
            return cls("symint", sizes=exprs([x]))
        return cls("value", value=x)

    def __str__(self) -> str:
        if self.kind == "tensor":
            return f"tensor {self.dtype} {self.device} {list(self.sizes)} {list(self.strides)}"
        if self.kind == "symint":
            return f"symint {list(self.sizes)}"
        return f"{type(self.value).__name__} {self.value!r}"


def structural_hash(gm: fx.GraphModule, inputs: list[PieceInput]) -> str:
    """Equal for pieces that compute the same thing from inputs of the same shapes."""
    names: dict[fx.Node, str] = {}
    lines, placeholders = [], iter(inputs)
    for i, node in enumerate(gm.graph.nodes):
        names[node] = f"v{i}"
        what = str(next(placeholders)) if node.op == "placeholder" else ""
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


def _expr(value) -> sympy.Expr:
    return value.node.expr if isinstance(value, torch.SymInt) else sympy.Integer(value)


def size_hint(shape: TokenShape) -> int:
    """The token count Inductor tunes a shape for: a range's largest, the batches where speed
    matters most, whatever count the capture call had."""
    return shape.hi


def specialise(inputs: list[PieceInput], shape: TokenShape) -> tuple[FakeTensorMode, list]:
    """Fake inputs for compiling a piece for `shape`: T becomes the size, or a fresh symbol
    bounded to the range, in a shape env of the piece's own."""
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    hint = size_hint(shape)
    if shape.is_size:
        new = sympy.Integer(shape.lo)
    else:
        new = env.create_symbol(hint, ConstantSource("num_tokens"), dynamic_dim=DimDynamic.DYNAMIC)
        env.constrain_symbol_range(new, shape.lo, shape.hi)

    def value(expr):
        expr = expr.xreplace({TOKENS: new})
        if expr.is_number:
            return int(expr)
        return env.create_symintnode(expr, hint=int(expr.xreplace({new: hint})))

    fakes = []
    with mode:
        for x in inputs:
            if x.kind == "tensor":
                fakes.append(torch.empty_strided([value(d) for d in x.sizes], [value(d) for d in x.strides],
                                                 dtype=x.dtype, device=x.device))
            elif x.kind == "symint":
                fakes.append(value(x.sizes[0]))
            else:
                fakes.append(x.value)
    return mode, fakes


def compile_piece(gm: fx.GraphModule, mode: FakeTensorMode, inputs: list) -> Callable:
    # standalone_compile: its artifact can be saved to the compile cache and loaded back.
    restore_example_values(gm, mode, inputs)
    with torch._guards.tracing(torch._guards.TracingContext(mode)):
        return torch._inductor.standalone_compile(gm, inputs, dynamic_shapes="from_tracing_context")


def restore_example_values(gm: fx.GraphModule, mode: FakeTensorMode, inputs: list) -> None:
    """AOTAutograd saves an artifact only for graphs whose nodes carry Dynamo's example
    values; a piece read back from the compile cache lost them in pickling. Fake propagation
    puts them back (without them the rebuilt artifact could not be saved)."""
    if all("example_value" in n.meta for n in gm.graph.nodes if n.op != "output"):
        return

    class Recorder(fx.Interpreter):
        def run_node(self, node):
            value = super().run_node(node)
            node.meta["example_value"] = value
            return value

    with mode:
        Recorder(gm).run(*inputs)


@dataclass
class UniquePiece:
    name: str  # the first submodule with this structure
    graph: fx.GraphModule
    inputs: list[PieceInput]  # as traced, sizes in terms of the token count T


class PieceSet:
    """The unique pieces of one split graph and their artifacts per token shape.

    With a `store` (a compile-cache entry) every artifact is looked up there first, and
    what had to be compiled is written there.
    """

    def __init__(self, uniques: list[UniquePiece], plan: ShapePlan, compiler: str,
                 monitor: CompileMonitor, store=None, inductor_config: dict | None = None):
        # inductor_config: Inductor settings patched around every piece compile (the pass
        # manager, graph partitioning).
        self.uniques = uniques
        self.inductor_config = inductor_config or {}
        self.plan, self.compiler, self.monitor, self.store = plan, compiler, monitor, store
        self.by_shape: dict[TokenShape, list[Callable]] = {}
        self.by_tokens: dict[int, list[Callable]] = {}
        self.frozen = False  # eager strategy: everything is compiled, serving must not compile
        self.captured = False
        self.workers: CompileWorkers | None = None  # while set, misses compile side by side in them

    def table(self, num_tokens: int) -> list[Callable]:
        """The artifact of every unique piece for a call with `num_tokens` tokens."""
        table = self.by_tokens.get(num_tokens)
        if table is None:
            shape = self.plan.shape_for(num_tokens)
            table = self.by_tokens[num_tokens] = self.by_shape.get(shape) or self.compile(shape)
        return table

    def compile(self, shape: TokenShape) -> list[Callable]:
        return self.compile_shapes([shape])[0]

    def compile_shapes(self, shapes: list[TokenShape]) -> list[list[Callable]]:
        """Load or compile the artifacts of every unique piece for each shape (with workers,
        all the compiles run side by side)."""
        if self.frozen:
            raise RuntimeError(f"kiln would compile {', '.join(map(str, shapes))} while serving, but the eager "
                               f"strategy compiled every range and size at capture; this is a kiln bug")
        if self.compiler == "eager":  # the pieces run as captured: one callable serves every shape
            tables = [[piece.graph for piece in self.uniques] for _ in shapes]
        else:
            tables = self._inductor(shapes)
        self.by_shape.update(zip(shapes, tables))
        return tables

    def _inductor(self, shapes: list[TokenShape]) -> list[list[Callable]]:
        if self.store is None:
            return [self._compile_all(shape, [None] * len(self.uniques)) for shape in shapes]
        # Held from the look-up to the write: a second process filling the same entry waits
        # here, then finds the artifacts the first one wrote.
        with self.store.lock():
            tables = [self._load_all(shape) for shape in shapes]
            todo = [(shape, i) for shape, table in zip(shapes, tables) for i, a in enumerate(table) if a is None]
            if todo and self.store.warm:
                logger.warning("compile cache miss: %s of %s is not in cache entry %s; compiling %d "
                               "piece(s) now (kiln prewarm covers it ahead of time)",
                               ", ".join(str(s) for s, t in zip(shapes, tables) if not all(t)),
                               self.store.model_name, self.store.key, len(todo))
            if len(todo) > 1 and self.workers is not None and "post_grad_custom_post_pass" not in self.inductor_config:
                self._compile_in_workers(todo, dict(zip(shapes, tables)))
            for shape, table in zip(shapes, tables):
                if not all(table):
                    self._compile_all(shape, table)
                self.store.shape_done(shape, size_hint(shape), len(self.uniques))
            return tables

    def _compile_in_workers(self, todo: list[tuple[TokenShape, int]], tables: dict[TokenShape, list]) -> None:
        """Compile `todo` in the worker processes and load what they saved into `tables`. A
        piece a worker could not compile stays None there, for the caller to compile here.
        (Graph passes run in this process only: they report their matches to its monitor.)"""
        start = time.perf_counter()
        store, jobs = self.store, []
        for shape, i in todo:
            piece = self.uniques[i]
            out = store.path / f"{store.artifact(i, shape)}.{os.getpid()}.worker.tmp"
            jobs.append(PieceJob(i, shape, pickle.dumps(piece.graph), piece.inputs, store,
                                 self.inductor_config, str(out)))
        logger.info("compiling %d pieces in %d worker processes", len(jobs), self.workers.count)
        for job, result in self.workers.compile(jobs):
            name = self.uniques[job.index].name
            if result.error is not None:
                logger.warning("a compile worker failed on %s for %s (%s); compiling it here",
                               name, job.shape, result.error)
                continue
            store.adopt_piece(job.index, job.shape, Path(job.out))
            with torch._inductor.config.patch(self.inductor_config):
                tables[job.shape][job.index] = store.load_piece(job.index, job.shape)
            self.monitor.piece_compiled_elsewhere(name, job.index, job.shape, result.seconds,
                                                  result.fx_cache_hit, self.captured)
        shapes = ", ".join(str(shape) for shape in dict.fromkeys(shape for shape, _ in todo))
        self.monitor.compiled_in_workers(f"{shapes} ({len(jobs)} pieces in {self.workers.count} worker processes)",
                                         time.perf_counter() - start)

    def _load_all(self, shape: TokenShape) -> list[Callable | None]:
        start = time.perf_counter()
        # Loading runs Inductor's post-compile step, which reads graph_partition too.
        with torch._inductor.config.patch(self.inductor_config):
            table = [self._load(i, shape) for i in range(len(self.uniques))]
        self.monitor.pieces_loaded(sum(a is not None for a in table), time.perf_counter() - start)
        return table

    def _load(self, index: int, shape: TokenShape) -> Callable | None:
        start = time.perf_counter()
        artifact = self.store.load_piece(index, shape)
        trace.piece_loaded(self.uniques[index].name, index, shape, time.perf_counter() - start,
                           artifact is not None, self.store.key)
        return artifact

    def _compile_all(self, shape: TokenShape, table: list[Callable | None]) -> list[Callable]:
        start = time.perf_counter()
        todo = [i for i, artifact in enumerate(table) if artifact is None]
        with self.monitor.progress(len(todo), f"compiling {shape}") as bar, self._compiler_dirs():
            for i in todo:
                piece = self.uniques[i]
                mode, inputs = specialise(piece.inputs, shape)
                with (self.monitor.piece_compile(piece.name, i, shape, self.captured),
                      torch._inductor.config.patch(self.inductor_config), compiling(piece.name, shape)):
                    table[i] = compile_piece(piece.graph, mode, inputs)
                if self.store is not None:
                    self.store.save_piece(i, shape, table[i])
                bar.update()
        self.monitor.shape_compiled(str(shape), time.perf_counter() - start)
        return table

    def _compiler_dirs(self):
        return self.store.compiler_dirs() if self.store is not None else contextlib.nullcontext()


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


def token_locator(inputs: list[PieceInput]) -> tuple[int, int | None] | None:
    """Where a piece's inputs carry the token count: a SymInt input, else a tensor dim."""
    for i, x in enumerate(inputs):
        if x.kind == "symint" and x.sizes[0] == TOKENS:
            return i, None
    for i, x in enumerate(inputs):
        if x.kind == "tensor":
            for d, size in enumerate(x.sizes):
                if size == TOKENS:
                    return i, d
    return None
