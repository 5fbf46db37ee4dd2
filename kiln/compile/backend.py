"""The piecewise backend: the callable Dynamo hands the captured graph to (mode 3).

Graph passes will run first, on the whole graph (there are none yet). Then it splits the
graph at the split ops, runs the split graph once over fake tensors to learn
every piece's inputs (shapes in terms of the token symbol), compiles the unique pieces, and
returns the split graph with each piece replaced by a runner that dispatches on the token
count. The opaque regions stay as captured and run eagerly between the pieces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import fx

from kiln.compile.capture import token_symbols
from kiln.compile.monitor import CompileMonitor, logger
from kiln.compile.pieces import PieceRunner, PieceSet, ShapePlan, UniquePiece, structural_hash, token_locator
from kiln.compile.split import split_graph

if TYPE_CHECKING:  # kiln.config imports kiln.ops, whose attention imports kiln.compile
    from kiln.config import CompilationConfig


class PiecewiseBackend:
    def __init__(self, config: CompilationConfig, split_names: set[str], max_tokens: int,
                 monitor: CompileMonitor):
        self.config, self.split_names, self.monitor = config, split_names, monitor
        self.plan = ShapePlan(config.compile_ranges, config.compile_sizes, max_tokens)
        self.pieces: PieceSet | None = None

    def __call__(self, gm: fx.GraphModule, example_inputs: list):
        fake_mode = torch._guards.TracingContext.get().fake_mode
        fakes = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
        tokens = token_symbols(fakes, fake_mode.shape_env)
        split = split_graph(gm, self.split_names)
        templates = piece_inputs(split.module, split.pieces, fakes, fake_mode)
        uniques, unique_index = dedup(split.module, split.pieces, templates, tokens)
        self.pieces = PieceSet(uniques, tokens, traced_count(fakes, example_inputs, tokens), self.plan,
                               self.config.piece_compiler, self.monitor)
        for name in split.pieces:
            where = token_locator(templates[name], tokens)
            if where is None:
                raise NotImplementedError(f"piece {name} does not depend on the token count; "
                                          f"kiln does not compile such pieces yet")
            # The split graph calls self.<name>(...): a plain attribute now answers it.
            del split.module._modules[name]
            split.module.__dict__[name] = PieceRunner(self.pieces, unique_index[name], *where)
        c = self.monitor.counters
        c.pieces, c.unique_pieces, c.opaque_regions = len(split.pieces), len(uniques), len(split.regions)
        logger.info("split the graph into %d pieces (%d unique) around %d opaque regions",
                    c.pieces, c.unique_pieces, c.opaque_regions)
        self._compile_at_capture()
        return split.module

    def _compile_at_capture(self) -> None:
        pieces = self.pieces
        if self.config.strategy == "eager":
            for shape in self.plan.all_shapes():
                pieces.compile(shape)
            pieces.frozen = True
        else:
            pieces.compile(self.plan.shape_for(pieces.traced_tokens))
        pieces.captured = True


def dedup(module: fx.GraphModule, names: list[str], templates: dict[str, list],
          tokens) -> tuple[list[UniquePiece], dict[str, int]]:
    """The structurally unique pieces, and each piece's index among them."""
    uniques: list[UniquePiece] = []
    by_hash: dict[str, int] = {}
    index: dict[str, int] = {}
    for name in names:
        graph = getattr(module, name)
        key = structural_hash(graph, templates[name], tokens)
        if key not in by_hash:
            by_hash[key] = len(uniques)
            uniques.append(UniquePiece(name, graph, templates[name]))
        index[name] = by_hash[key]
    return uniques, index


def piece_inputs(module: fx.GraphModule, names: list[str], fakes: list, fake_mode) -> dict[str, list]:
    """Run the split graph over fake tensors and record each piece's (symbolic) inputs."""
    recorded: dict[str, list] = {}
    wanted = set(names)

    class Recorder(fx.Interpreter):
        def call_module(self, target, args, kwargs):
            if target in wanted:
                recorded[target] = list(args)
            return super().call_module(target, args, kwargs)

    with fake_mode:
        Recorder(module).run(*fakes)
    return recorded


def traced_count(fakes: list, example_inputs: list, tokens) -> int:
    """The token count of the capture call, read from a real input."""
    for fake, real in zip(fakes, example_inputs):
        if isinstance(fake, torch.Tensor):
            for d, size in enumerate(fake.shape):
                if isinstance(size, torch.SymInt) and size.node.expr in tokens:
                    return real.shape[d]
    raise RuntimeError("no graph input has the token dim")
