"""kiln's own artifacts in torch's structured trace (TORCH_TRACE=<dir>), beside Dynamo's and
Inductor's, so `tlparse` shows them in the same report:

    kiln_compilation_config   json    the compile settings, effective split ops and shape plan
    kiln_split_graph          string  the split graph and each unique piece, as Python
    kiln_piece_compile        json    one per piece compile: piece, shape, seconds, Inductor cache hit/miss
    kiln_piece_load           json    one per piece looked up in kiln's compile cache: hit or miss, seconds

Events inside Dynamo's compile (the capture) carry its compile id, so tlparse files them under
that frame; a warm start or a later lazy compile has none, and tlparse lists them apart.

Without TORCH_TRACE, torch drops an event before calling metadata_fn or payload_fn (about
half a microsecond a call), so nothing here builds a payload eagerly. The one exception is a
process's first event, which torch's lazy handler needs to find out that there is no trace
dir: kiln's first is always the small config, and on a capture Dynamo's own events come first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch._logging import trace_structured

CONFIG = "kiln_compilation_config"
SPLIT_GRAPH = "kiln_split_graph"
PIECE_COMPILE = "kiln_piece_compile"
PIECE_LOAD = "kiln_piece_load"


def artifact(name: str, encoding: str, payload_fn: Callable[[], object]) -> None:
    # expect_trace_id=False: outside Dynamo's compile there is no id, and torch would
    # otherwise record a stack with every event to explain its absence.
    trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": encoding},
                     payload_fn=payload_fn, expect_trace_id=False)


def announcing(backend: Callable, announce: Callable[[], None]) -> Callable:
    """`backend`, calling `announce` first: inside Dynamo's compile, so its events get the
    frame's compile id."""

    def compile_graph(gm, example_inputs):
        announce()
        return backend(gm, example_inputs)

    compile_graph.__name__ = getattr(backend, "__name__", "kiln_backend")
    return compile_graph


def compilation_config(config, split_ops, plan, **more) -> None:
    """The settings a capture or warm start runs with. `more`: what else the caller knows."""
    artifact(CONFIG, "json", lambda: {
        "compilation_config": dataclasses.asdict(config),
        "split_ops": [{"name": op.name, "source": op.source} for op in split_ops],
        "plan": {"ranges": [[s.lo, s.hi] for s in plan.ranges], "sizes": sorted(plan.sizes)} if plan else None,
        **more})


def split_graph(program) -> None:
    artifact(SPLIT_GRAPH, "string", program.readable)


def piece_compiled(piece: str, index: int, shape, seconds: float, fx_cache_hit: bool, after_capture: bool) -> None:
    artifact(PIECE_COMPILE, "json", lambda: {
        "piece": piece, "unique_piece": index, "shape": str(shape), "lo": shape.lo, "hi": shape.hi,
        "seconds": round(seconds, 4), "cache": "hit" if fx_cache_hit else "miss",
        "cache_kind": "Inductor FX-graph cache", "after_capture": after_capture})


def piece_loaded(piece: str, index: int, shape, seconds: float, found: bool, entry: str) -> None:
    artifact(PIECE_LOAD, "json", lambda: {
        "piece": piece, "unique_piece": index, "shape": str(shape), "lo": shape.lo, "hi": shape.hi,
        "seconds": round(seconds, 4), "cache": "hit" if found else "miss",
        "cache_kind": "kiln compile cache", "entry": entry})
