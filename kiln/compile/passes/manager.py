"""The pass manager: kiln's graph passes, run at Inductor's post-grad custom pass hook.

Inductor calls it on each graph it compiles, after its own post-grad patterns and before
it lowers the graph (`torch._inductor.config.post_grad_custom_post_pass`). The manager
runs the configured passes in their fixed order, skips those that opt out of the token
shape being compiled, counts their matches in the CompileMonitor, and with a dump dir
writes the graph before and after each pass.

Inductor's caches (FX graph, AOTAutograd) key on `uuid()`; so does kiln's compile cache.
A cache hit replays the artifact without running any pass: matches are counted only for
graphs Inductor actually compiled.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from kiln.compile.monitor import CompileMonitor, logger
from kiln.compile.passes.graph_pass import GraphPass
from kiln.compile.passes.registry import check_pass_names, pass_class
from kiln.compile.passes.target import current_target


class PassManager(CustomGraphPass):
    def __init__(self, names: list[str], monitor: CompileMonitor | None = None, dump_dir: str | None = None):
        check_pass_names(names)
        self.passes: list[GraphPass] = sorted((pass_class(name)() for name in names), key=lambda p: p.order)
        self.monitor = monitor if monitor is not None else CompileMonitor()
        self.dump_dir = Path(dump_dir) if dump_dir else None

    def __bool__(self) -> bool:
        return bool(self.passes)

    def __call__(self, graph: fx.Graph) -> None:
        target = current_target()
        shape = target.shape if target is not None else None
        label = target.label if target is not None else "graph"
        for step, graph_pass in enumerate(self.passes):
            if not graph_pass.applies_to(shape):
                logger.debug("pass %s: skipped for %s", graph_pass.name, label)
                continue
            self._dump(graph, label, step, graph_pass.name, "before")
            matches = graph_pass(graph)
            graph.lint()  # a bad rewrite fails here, naming the pass, not deep inside Inductor
            self._dump(graph, label, step, graph_pass.name, "after")
            self.monitor.pass_matched(graph_pass.name, matches, label)

    def uuid(self) -> str:
        """Every pass's uuid; inside a compile also which passes apply to its token shape,
        so artifacts of shapes a pass opted out of are never mixed up with the others."""
        target = current_target()
        parts = [[p.uuid(), p.applies_to(target.shape) if target is not None else None] for p in self.passes]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def _dump(self, graph: fx.Graph, label: str, step: int, name: str, when: str) -> None:
        if self.dump_dir is None:
            return
        folder = self.dump_dir / label
        folder.mkdir(parents=True, exist_ok=True)
        module = graph.owning_module
        text = (module.print_readable(print_output=False, include_stride=True, include_device=True)
                if module is not None else str(graph))
        (folder / f"{step:02d}-{name}-{when}.py").write_text(text)
