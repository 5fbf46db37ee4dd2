"""Compiled pieces: one artifact per unique piece and token shape (kiln.compile.shapes),
picked per call.

Pieces with the same structure (the 30 middle layers of SmolLM2) share their artifacts:
every weight is an input of the piece, so one compiled function serves them all.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import fx

from kiln.compile import trace
from kiln.compile.aot_piece import PackagedPiece, PackageMismatch, check_package, load_package
from kiln.compile.compile_workers import CompileWorkers, PieceJob, op_modules
from kiln.compile.cache.preload import prepare_loading
from kiln.compile.cache.store import no_room, warn_no_room
from kiln.compile.monitor import CompileMonitor, logger
from kiln.compile.partitions import Partitions, inductor_scope
from kiln.compile.passes.target import compiling
from kiln.compile.piece_input import TOKENS, PieceInput
from kiln.compile.shapes import ShapePlan, TokenShape, size_hint


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
                 monitor: CompileMonitor, store=None, inductor_config: dict | None = None,
                 partitions: Partitions | None = None):
        # inductor_config: Inductor settings patched around every piece compile (the pass
        # manager, graph partitioning); partitions: where Inductor's partition functions go
        # (splitting_mode "inductor_partition").
        self.uniques = uniques
        self.inductor_config = inductor_config or {}
        self.partitions = partitions
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
        tables: dict[TokenShape, list[Callable | None]] = {}  # filled in place, kept if the cache fails
        if self.store is not None:
            try:
                return self._inductor_cached(shapes, tables)
            except Exception as e:
                full = no_room(e)
                if full is None:
                    raise
                # From here on this process compiles in Inductor's own directory and keeps
                # nothing; the pieces already built stay (a cut-short one is None, and compiles).
                warn_no_room(full, self.store.path)
                self.store, self.workers = None, None
        return [self._compile_all(shape, tables.get(shape) or [None] * len(self.uniques)) for shape in shapes]

    def _inductor_cached(self, shapes: list[TokenShape], by_shape: dict) -> list[list[Callable]]:
        # Held from the look-up to the write: a second process filling the same entry waits
        # here, then finds the artifacts the first one wrote.
        with self.store.lock():
            for shape in shapes:
                by_shape[shape] = self._load_all(shape)
            tables = [by_shape[shape] for shape in shapes]
            todo = [(shape, i) for shape, table in zip(shapes, tables) for i, a in enumerate(table) if a is None]
            if todo and self.store.warm:
                logger.warning("compile cache miss: %s of %s is not in cache entry %s; compiling %d "
                               "piece(s) now (kiln prewarm covers it ahead of time)",
                               ", ".join(str(s) for s, t in zip(shapes, tables) if not all(t)),
                               self.store.model_name, self.store.key, len(todo))
            if len(todo) > 1 and self.workers is not None and "post_grad_custom_post_pass" not in self.inductor_config:
                self._compile_in_workers(todo, by_shape)
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
            jobs.append(PieceJob(i, shape, pickle.dumps(piece.graph), op_modules(piece.graph), piece.inputs, store,
                                 self.inductor_config, str(out)))
        logger.info("compiling %d pieces in %d worker processes (%s)", len(jobs), self.workers.count,
                    self.workers.start_method)
        device = next((p.device for piece in self.uniques for p in piece.inputs if p.device is not None), None)
        # The first load below would import Inductor's loading path: it runs while the workers compile.
        meanwhile = functools.partial(prepare_loading, device.type, store.path.parent) if device is not None else None
        for job, result in self.workers.compile(jobs, meanwhile):
            name = self.uniques[job.index].name
            if result.error is not None:
                logger.warning("a compile worker failed on %s for %s (%s); compiling it here",
                               name, job.shape, result.error)
                continue
            store.adopt_piece(job.index, job.shape, Path(job.out))
            with inductor_scope(self.inductor_config, self.partitions):
                tables[job.shape][job.index] = store.load_piece(job.index, job.shape)
            self.monitor.piece_compiled_elsewhere(name, job.index, job.shape, result.seconds,
                                                  result.fx_cache_hit, self.captured)
        shapes = ", ".join(str(shape) for shape in dict.fromkeys(shape for shape, _ in todo))
        self.monitor.compiled_in_workers(f"{shapes} ({len(jobs)} pieces in {self.workers.count} worker processes)",
                                         time.perf_counter() - start, self.workers.timing)

    def _load_all(self, shape: TokenShape) -> list[Callable | None]:
        start = time.perf_counter()
        table = [self._load(i, shape) for i in range(len(self.uniques))]
        self.monitor.counters.packages_loaded += sum(isinstance(a, PackagedPiece) for a in table)
        self.monitor.pieces_loaded(sum(a is not None for a in table), time.perf_counter() - start)
        return table

    def _load(self, index: int, shape: TokenShape) -> Callable | None:
        """The piece's AOT package if the entry has one, else its Inductor artifact, else None."""
        start = time.perf_counter()
        artifact = self._load_package(index, shape)
        if artifact is None:
            # Loading runs Inductor's post-compile step, which reads graph_partition and hands out the partitions.
            with inductor_scope(self.inductor_config, self.partitions):
                artifact = self.store.load_piece(index, shape)
        trace.piece_loaded(self.uniques[index].name, index, shape, time.perf_counter() - start,
                           artifact is not None, self.store.key)
        return artifact

    def _load_package(self, index: int, shape: TokenShape) -> Callable | None:
        """The piece's AOT package for `shape` (kiln.compile.aot_piece), or None where the entry has none."""
        path = self.store.package_path(index, shape)
        if path is None:
            return None
        piece = self.uniques[index]
        try:
            return load_package(path, piece.inputs, piece.graph)
        except Exception as e:  # e.g. a package this torch cannot load: the Inductor artifact serves
            logger.warning("compile cache: AOT package %s could not be loaded (%s: %s); using the Inductor artifact",
                           path, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            self.store.forget_package(index, shape)
            return None

    def package(self, shapes: list[TokenShape]) -> dict:
        """Build an AOT package of every unique piece for each of `shapes` (their Inductor artifacts
        must be held: each package is checked against its artifact's output) into the cache entry.
        Returns what was built and, per piece and shape it could not package, why."""
        from kiln.compile.aot_piece import NotPackable, build_package

        built, refused, start = 0, {}, time.perf_counter()
        for shape in shapes:
            table = self.by_shape.get(shape) or self.compile(shape)
            for i, piece in enumerate(self.uniques):
                if isinstance(table[i], PackagedPiece):
                    built += 1
                    continue
                label = f"{piece.name} {shape}"
                try:
                    # In Inductor's own cache dir, not the entry's: what AOTInductor leaves there is not the entry's.
                    with (inductor_scope(self.inductor_config, self.partitions), compiling(piece.name, shape),
                          self.store.lock()):
                        path = self.store.save_package(i, shape, lambda out, p=piece: build_package(
                            p.graph, p.inputs, shape, self.inductor_config, out))
                    packaged = load_package(path, piece.inputs, piece.graph)
                    check_package(packaged, table[i], piece.graph, piece.inputs, shape)
                except Exception as e:  # what a package cannot express, or AOTInductor failing: the artifact serves
                    if no_room(e) is not None:
                        raise
                    refused[label] = str(e) if isinstance(e, (NotPackable, PackageMismatch)) else \
                        f"AOTInductor failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                    logger.warning("no AOT package for %s: %s", label, refused[label])
                    with self.store.lock():
                        self.store.forget_package(i, shape)
                    continue
                built += 1
        return {"packages": built, "refused": refused, "seconds": time.perf_counter() - start}

    def _compile_all(self, shape: TokenShape, table: list[Callable | None]) -> list[Callable]:
        from kiln.compile.inductor_piece import compile_piece, specialise

        start = time.perf_counter()
        todo = [i for i, artifact in enumerate(table) if artifact is None]
        with self.monitor.progress(len(todo), f"compiling {shape}") as bar, self._compiler_dirs():
            for i in todo:
                piece = self.uniques[i]
                mode, inputs = specialise(piece.inputs, shape)
                with (self.monitor.piece_compile(piece.name, i, shape, self.captured),
                      inductor_scope(self.inductor_config, self.partitions), compiling(piece.name, shape)):
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
