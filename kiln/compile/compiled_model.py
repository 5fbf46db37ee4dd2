"""A model's forward behind the configured compile mode: eager, stock, once, or piecewise."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from kiln.compile.backend import PiecewiseBackend
from kiln.compile.capture import Capture, checked_backend
from kiln.compile.monitor import CompileMonitor, logger
from kiln.compile.opt_in import dynamic_arg_dims
from kiln.compile.split import SplitOp, check_split_ops, effective_split_ops

if TYPE_CHECKING:  # kiln.config imports kiln.ops, whose attention imports kiln.compile
    from kiln.config import CompilationConfig

_MODE_NAMES = {0: "eager", 1: "stock torch.compile", 2: "Dynamo once + backend", 3: "kiln piecewise"}


class CompiledModel:
    """A model's forward behind the configured compile mode."""

    def __init__(self, model: nn.Module, config: CompilationConfig, max_num_batched_tokens: int):
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.model, self.config, self.max_num_batched_tokens = model, config, max_num_batched_tokens
        self.monitor = CompileMonitor()
        self.split_ops: list[SplitOp] = effective_split_ops(config.splitting_ops)
        check_split_ops(self.split_ops)
        dims = dynamic_arg_dims(model)
        self.mode = config.mode if dims is not None else 0
        if dims is None and config.mode != 0:
            logger.warning("%s is not decorated with @compile_dynamic: it runs eagerly", type(model).__name__)
        self.backend: PiecewiseBackend | None = None
        self.capture: Capture | None = None if self.mode == 0 else self._capture(dims)
        logger.info("model forward: %s", self.describe())

    def _capture(self, dims: dict[str, int]) -> Capture:
        config, max_tokens = self.config, self.max_num_batched_tokens
        owner = f"{type(self.model).__name__}.forward"
        if self.mode == 3:
            self.backend = PiecewiseBackend(config, {op.name for op in self.split_ops}, max_tokens, self.monitor)
            compiler = self.backend
        else:
            compiler = torch._dynamo.lookup_backend("inductor" if self.mode == 1 else config.backend)
        # Mode 1 is the stock baseline: Dynamo checks all its guards on every call.
        guards = "all" if self.mode == 1 else "shape" if config.debug_guards else "none"
        return Capture(self.model, dims, checked_backend(compiler, self.monitor, max_tokens, owner),
                       guards=guards, mark=config.dynamic_shapes_mark, max_tokens=max_tokens,
                       monitor=self.monitor)

    def __call__(self, *args, **kwargs):
        if self.capture is None:
            return self.model(*args, **kwargs)
        return self.capture(*args, **kwargs)

    def warm_up(self, make_inputs: Callable[[int], tuple]) -> None:
        """Run the forward once per compile range and size, so nothing compiles while serving.

        The first call, with the most tokens, is the capture (and, with the eager strategy,
        compiles every range and size).
        """
        if self.capture is None:
            return
        counts = [self.max_num_batched_tokens]
        if self.backend is not None:
            plan = self.backend.plan
            counts += [shape.hi for shape in plan.ranges] + sorted(plan.sizes)
        for n in dict.fromkeys(counts):
            self(*make_inputs(n))

    @property
    def stats(self) -> dict:
        return self.monitor.stats()

    def describe(self) -> str:
        """One line for logs and `kiln generate`: what runs the forward."""
        if self.mode == 0:
            why = "mode 0" if self.config.mode == 0 else "model not decorated with @compile_dynamic"
            return f"eager ({why})"
        text = f"compiled: mode {self.mode} ({_MODE_NAMES[self.mode]})"
        if self.mode == 2:
            text += f", backend {self.config.backend}"
        if self.mode == 3:
            c = self.config
            plan = self.backend.plan
            text += (f", {c.piece_compiler} pieces, {c.strategy} strategy, ranges "
                     f"{', '.join(f'[{r.lo}, {r.hi}]' for r in plan.ranges)}"
                     + (f", sizes {sorted(plan.sizes)}" if plan.sizes else ""))
        if self.config.debug_guards and self.mode in (2, 3):
            text += ", debug guards"
        return text


def compile_model(model: nn.Module, config: CompilationConfig, max_num_batched_tokens: int) -> CompiledModel:
    return CompiledModel(model, config, max_num_batched_tokens)
