"""The piecewise backend: the callable Dynamo hands the captured graph to (mode 3).

It splits the graph at the split ops, runs the split graph once over fake tensors to learn
every piece's inputs (shapes in terms of the token count), compiles the unique pieces, and
returns the split graph with each piece replaced by a runner that dispatches on the token
count. The opaque regions stay as captured and run eagerly between the pieces. With
splitting_mode "inductor_partition" or "none" nothing is split here: the whole graph is
one piece, and Inductor partitions it at the split ops (or not at all).

Inductor runs kiln's graph passes (kiln.compile.passes) on every graph it compiles.

What it builds is a SplitProgram: it pickles, so the compile cache keeps it and a warm
start rebuilds the same runnable graph from disk without Dynamo.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor

from kiln.compile import trace
from kiln.compile.cache.key import traced_sources
from kiln.compile.cache.model_cache import ModelCache
from kiln.compile.cache.store import no_room, warn_no_room
from kiln.compile.compile_workers import CompileWorkers
from kiln.compile.config import CompilationConfig
from kiln.compile.direct_call import CallSpec
from kiln.compile.piece_input import PieceInput
from kiln.compile.monitor import CompileMonitor, logger
from kiln.compile.partitions import Partitions
from kiln.compile.pieces import PieceRunner, PieceSet, UniquePiece, structural_hash, token_locator
from kiln.compile.shapes import ShapePlan, TokenShape
from kiln.compile.split import split_graph


@dataclass
class SplitProgram:
    """The split graph and its unique pieces. Piece slots hold empty modules; `runnable`
    puts a PieceRunner in each."""

    graph: fx.GraphModule  # calls submod_<i> in order: pieces and opaque regions
    slots: dict[str, tuple[int, int, int | None]]  # piece -> (unique index, token arg, token dim)
    uniques: list[UniquePiece]
    regions: list[str]
    call: CallSpec | None = None  # how to call the graph without Dynamo, once known

    def summary(self) -> dict:
        return {"pieces": len(self.slots), "unique_pieces": len(self.uniques),
                "opaque_regions": len(self.regions), "direct_call": self.call is not None}

    def readable(self) -> str:
        """The split graph, then each unique piece, as Python."""
        parts = [self.graph.print_readable(print_output=False)]
        for i, piece in enumerate(self.uniques):
            users = [name for name, slot in self.slots.items() if slot[0] == i]
            parts.append(f"# unique piece {i}: {', '.join(users)}\n" + piece.graph.print_readable(print_output=False))
        return "\n\n".join(parts)


def runnable(program: SplitProgram, pieces: PieceSet,
             wrap: Callable[[Callable], Callable] | None = None) -> fx.GraphModule:
    """A copy of the split graph whose piece slots run `pieces` (each through `wrap`, if given)."""
    module = fx.GraphModule(program.graph, program.graph.graph, class_name="SplitGraph")
    for name, slot in program.slots.items():
        # The split graph calls self.<name>(...): a plain attribute answers it.
        del module._modules[name]
        runner = PieceRunner(pieces, *slot)
        module.__dict__[name] = wrap(runner) if wrap is not None else runner
    return module


def compile_ahead(pieces: PieceSet, plan: ShapePlan, strategy: str, first: TokenShape | None,
                  also: list[TokenShape] = ()) -> None:
    """What must be ready before serving: every shape (eager strategy), or the first call's
    and `also` (the shapes a warm-up is about to call: compiled together, side by side with
    compile workers)."""
    if strategy == "eager":
        wanted = plan.all_shapes()
    else:
        wanted = ([first] if first is not None else []) + list(also)
    todo = [s for s in dict.fromkeys(wanted) if s not in pieces.by_shape]
    if todo:
        pieces.compile_shapes(todo)
    pieces.frozen = strategy == "eager"
    pieces.captured = True


class OutputRecorder:
    """Stands between Dynamo's bytecode and the split graph: keeps the capture call's graph
    outputs, to match them against the forward's return value (see dispatch)."""

    def __init__(self, module: fx.GraphModule):
        self.module, self.outputs = module, None

    def __call__(self, *args):
        out = self.module(*args)
        if self.outputs is None:
            self.outputs = out
        return out


class PiecewiseBackend:
    def __init__(self, config: CompilationConfig, split_names: set[str], max_tokens: int,
                 monitor: CompileMonitor, cache: ModelCache | None = None):
        self.config, self.monitor, self.cache = config, monitor, cache
        # Only FX splitting cuts the graph here; otherwise Inductor sees it whole.
        self.split_names = split_names if config.splitting_mode == "fx" else set()
        self.passes = _pass_manager(config, monitor)
        self.inductor_config = inductor_settings(config, split_names, self.passes)
        # Inductor's partitions between the split ops, for a caller to wrap (CompiledModel.wrap_pieces).
        self.partitions = Partitions(monitor.counters) if config.splitting_mode == "inductor_partition" else None
        self.plan = ShapePlan(config.compile_ranges, config.compile_sizes, max_tokens)
        self.program: SplitProgram | None = None
        self.pieces: PieceSet | None = None
        self.capture_inputs: tuple[fx.GraphModule, list] | None = None  # for the CallSpec
        self.recorder: OutputRecorder | None = None
        self.ahead: list[TokenShape] = []  # shapes to compile at capture besides the first call's
        self.workers: CompileWorkers | None = None  # compile pieces side by side at capture

    def __call__(self, gm: fx.GraphModule, example_inputs: list):
        from kiln.compile.capture import token_symbols

        fake_mode = torch._guards.TracingContext.get().fake_mode
        fakes = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
        tokens = token_symbols(fakes, fake_mode.shape_env)
        split = split_graph(gm, self.split_names, self.config.merge_consecutive_split_ops)
        recorded = piece_inputs(split.module, split.pieces, fakes, fake_mode)
        inputs = {name: [PieceInput.of(x, tokens) for x in recorded[name]] for name in split.pieces}
        uniques, unique_index = dedup(split.module, split.pieces, inputs)
        slots = {}
        for name in split.pieces:
            where = token_locator(inputs[name])
            if where is None:
                raise NotImplementedError(f"piece {name} does not depend on the token count; "
                                          f"kiln does not compile such pieces yet")
            slots[name] = (unique_index[name], *where)
        graph = fx.GraphModule({name: nn.Module() if name in slots else getattr(split.module, name)
                                for name in split.pieces + split.regions}, split.module.graph, class_name="SplitGraph")
        traced = traced_count(fakes, example_inputs, tokens)
        self.program = SplitProgram(graph, slots, uniques, split.regions)
        trace.split_graph(self.program)
        store = self._entry(traced_files(gm)) if self.cache is not None else None
        self.start(self.program, store)
        compile_ahead(self.pieces, self.plan, self.config.strategy, self.plan.shape_for(traced), self.ahead)
        self.capture_inputs = (gm, list(example_inputs))
        self.recorder = OutputRecorder(runnable(self.program, self.pieces))
        return self.recorder

    def _entry(self, traced: list[str]):
        """The cache entry this capture fills, or None when the cache volume has no room."""
        try:
            return self.cache.entry_for(traced)
        except OSError as e:
            if no_room(e) is None:
                raise
            warn_no_room(e, f"a new entry under {self.cache.root.path}")
            self.cache.entry = None
            return None

    def start(self, program: SplitProgram, store=None) -> None:
        """The pieces of `program`, artifacts from `store` where it has them."""
        self.program = program
        self.pieces = PieceSet(program.uniques, self.plan, self.config.piece_compiler,
                               self.monitor, store, self.inductor_config, self.partitions)
        self.pieces.workers = self.workers
        c = self.monitor.counters
        c.pieces, c.unique_pieces, c.opaque_regions = len(program.slots), len(program.uniques), len(program.regions)
        logger.info("split the graph into %d pieces (%d unique) around %d opaque regions",
                    c.pieces, c.unique_pieces, c.opaque_regions)


def _pass_manager(config: CompilationConfig, monitor: CompileMonitor):
    """The graph passes Inductor runs on every piece, or None without any (the pass manager is an
    Inductor class: a warm start that loads only packages imports no Inductor)."""
    if not config.passes:
        return None
    from kiln.compile.passes.manager import PassManager

    return PassManager(config.passes, monitor, config.pass_dump_dir)


def inductor_settings(config: CompilationConfig, split_names: set[str], passes) -> dict:
    """Inductor config patched around every piece compile."""
    settings = config.inductor_settings()
    splitting_mode = config.splitting_mode
    if passes:
        settings["post_grad_custom_post_pass"] = passes
    if splitting_mode == "inductor_partition":
        # Inductor cuts its own graph at the split ops, after the passes ran on all of it, and
        # hands each partition to kiln.compile.partitions.
        settings["graph_partition"] = True
        settings["custom_should_partition_ops"] = sorted(split_names)
    elif splitting_mode == "none":
        settings["graph_partition"] = False
    return settings


def dedup(module: fx.GraphModule, names: list[str],
          inputs: dict[str, list[PieceInput]]) -> tuple[list[UniquePiece], dict[str, int]]:
    """The structurally unique pieces, and each piece's index among them."""
    uniques: list[UniquePiece] = []
    by_hash: dict[str, int] = {}
    index: dict[str, int] = {}
    for name in names:
        graph = getattr(module, name)
        key = structural_hash(graph, inputs[name])
        if key not in by_hash:
            by_hash[key] = len(uniques)
            uniques.append(UniquePiece(name, graph, inputs[name]))
        index[name] = by_hash[key]
    return uniques, index


def piece_inputs(module: fx.GraphModule, names: list[str], fakes: list, fake_mode) -> dict[str, list]:
    """Run the split graph over fake tensors and record each piece's (symbolic) inputs.

    A piece's outputs are read from the fake values Dynamo left on its nodes rather than
    computed again: propagating fakes through every op of every piece took 0.8 s of a
    SmolLM2 capture. The opaque regions still run (on fakes), and a piece whose outputs
    carry no fake value runs too.
    """
    recorded: dict[str, list] = {}
    wanted = set(names)
    # Dynamo's fake values live in its own fake mode: run in that one, from its inputs.
    traced_inputs = [n.meta.get("example_value") for n in module.graph.nodes if n.op == "placeholder"]
    shortcut = all(v is not None for v in traced_inputs)
    if shortcut:
        fakes = traced_inputs
        fake_mode = next((v.fake_mode for v in traced_inputs if isinstance(v, FakeTensor)), fake_mode)

    class Recorder(fx.Interpreter):
        def call_module(self, target, args, kwargs):
            if target in wanted:
                recorded[target] = list(args)
                traced = traced_outputs(getattr(self.module, target)) if shortcut else None
                if traced is not None:
                    return traced
            return super().call_module(target, args, kwargs)

    with fake_mode:
        Recorder(module).run(*fakes)
    return recorded


def traced_outputs(piece: fx.GraphModule):
    """The piece's outputs as the fake values Dynamo traced them with, or None if any is missing."""
    output = next(n for n in reversed(piece.graph.nodes) if n.op == "output")
    missing = object()
    values = fx.node.map_arg(output.args[0], lambda n: n.meta.get("example_value", missing))
    leaves = values if isinstance(values, (tuple, list)) else [values]
    return None if any(v is missing for v in leaves) else values


def traced_count(fakes: list, example_inputs: list, tokens) -> int:
    """The token count of the capture call, read from a real input."""
    for fake, real in zip(fakes, example_inputs):
        if isinstance(fake, torch.Tensor):
            for d, size in enumerate(fake.shape):
                if isinstance(size, torch.SymInt) and size.node.expr in tokens:
                    return real.shape[d]
    raise RuntimeError("no graph input has the token dim")


def traced_files(gm: fx.GraphModule) -> list[str]:
    """The source files Dynamo traced for this graph: the code factor of the cache key."""
    codes = getattr(torch._guards.TracingContext.get(), "traced_code", None) or []
    files = {code.co_filename for code in codes}
    for node in gm.graph.nodes:  # the stack traces name them too, on any torch version
        files.update(re.findall(r'File "([^"]+)"', node.meta.get("stack_trace") or ""))
    return traced_sources(files)
