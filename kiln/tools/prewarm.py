"""`kiln prewarm`: fill the compile cache with everything a server would need, and say what
is in the entry.

    kiln prewarm --model smollm2 -O3 [--manifest shapes.json]

The engine settings and compile flags are those of `kiln serve`; start the server with the
same ones and it starts warm. With no -O flag it prewarms -O2. A manifest names the shapes:

    {"compile_ranges": [16, 256], "compile_sizes": [1, 2, 4, 8], "cudagraph_capture_sizes": [1, 2, 4]}

(every key optional; they override the compile flags, as -cc.compile_ranges=... would).
Weights are not loaded: the compiled code depends on the architecture, not on the values.
CUDA graphs cannot be stored on disk: the buckets are reported here and captured at each
server start on a GPU (a few seconds, benchmarks/results/cudagraphs_*.json).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from kiln.compile.config import DEFAULT_COMPILATION_LEVEL, CompilationConfig
from kiln.config import EngineConfig

MANIFEST_KEYS = ("compile_ranges", "compile_sizes", "cudagraph_capture_sizes")


def read_shapes(path: str | Path) -> dict:
    try:
        shapes = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--manifest {path}: {e}") from None
    if not isinstance(shapes, dict):
        raise ValueError(f"--manifest {path} must hold a JSON object with keys {', '.join(MANIFEST_KEYS)}")
    unknown = sorted(set(shapes) - set(MANIFEST_KEYS))
    if unknown:
        raise ValueError(f"--manifest {path}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(MANIFEST_KEYS)}")
    return shapes


def with_shapes(compilation: CompilationConfig, shapes: dict) -> CompilationConfig:
    """The compile settings with the manifest's ranges and sizes, every one compiled ahead."""
    if compilation.mode != 3:
        raise ValueError(f"kiln prewarm fills the cache of piecewise compilation (mode 3, -O1..-O3); "
                         f"mode {compilation.mode} keeps no cache")
    overrides = {k: shapes[k] for k in MANIFEST_KEYS if k in shapes}
    # Strategy is not part of the cache key: compiling everything now serves a lazy server too.
    return dataclasses.replace(compilation, strategy="eager", **overrides)


def prewarm(config: EngineConfig) -> dict:
    """Compile (or load) every range and size of `config` into its cache entry; the coverage."""
    from kiln.engine.runner import compile_cache, compile_forward
    from kiln.engine.timeline import StartupTimeline
    from kiln.loader import load_source
    from kiln.models import build_model
    from kiln.tools.inspect_cmd import cuda_graphs_report

    source = load_source(config.model)
    dtype, device = config.torch_dtype, config.torch_device
    custom_ops = config.resolved_custom_ops()
    cache = compile_cache(source, dtype, custom_ops)
    if cache is None:
        raise ValueError("the compile cache is off (KILN_DISABLE_COMPILE_CACHE is set): nothing to prewarm")
    model = build_model(source.config, dtype, device, custom_ops, None)
    start = time.perf_counter()
    compiled = compile_forward(model, config, cache, StartupTimeline())
    seconds = time.perf_counter() - start
    entry = compiled.entry
    if entry is None:
        raise RuntimeError("the forward was compiled but no cache entry was written; see the log")
    return {"key": entry.key, "path": str(entry.path), "model": source.name, "device": str(device),
            "dtype": str(dtype).removeprefix("torch."), "describe": compiled.describe(),
            "coverage": entry.coverage(), "complete": entry.complete(), "graph": entry.manifest.get("graph"),
            "cuda_graphs": cuda_graphs_report(config), "seconds": seconds, "stats": compiled.stats}


def render(report: dict) -> str:
    cover, stats, graph = report["coverage"], report["stats"], report["graph"] or {}
    ranges = ", ".join(f"[{lo}, {hi}]" for lo, hi in cover["ranges"]) or "none"
    sizes = ", ".join(map(str, cover["sizes"])) or "none"
    lines = [
        f"cache entry {report['key']} ({report['path']})",
        f"  model {report['model']} on {report['device']}, {report['dtype']}: {report['describe']}",
        f"  graph: {graph.get('pieces', '?')} pieces ({graph.get('unique_pieces', '?')} unique), "
        f"{graph.get('opaque_regions', '?')} opaque regions; "
        + ("warm starts skip Dynamo" if graph.get("direct_call") else "warm starts run Dynamo (no direct call)"),
        f"  ranges: {ranges}",
        f"  sizes: {sizes}",
        "  CUDA graph buckets (captured at each start on a GPU; graphs cannot be stored): " + "; ".join(
            f"{phase} {g['mode']} {', '.join(map(str, g['buckets'])) or '(none)'}"
            for phase, g in ((p, report["cuda_graphs"][p]) for p in ("decode", "prefill")))
        + ("" if report["cuda_graphs"]["enabled"] else " (no CUDA device here: nothing is captured)"),
        f"  missing: {', '.join(cover['missing']) or 'none'} -> {'complete' if report['complete'] else 'INCOMPLETE'}",
        f"  this run: {stats['inductor_compiles']} Inductor compiles, {stats['pieces_loaded']} artifacts loaded, "
        f"{report['seconds']:.1f} s",
    ]
    return "\n".join(lines)


def register(commands) -> None:
    p = commands.add_parser("prewarm", help="compile everything a server needs into the compile cache; "
                                            "print what the entry covers")
    p.add_argument("--manifest", default=None,
                   help="JSON with compile_ranges, compile_sizes, cudagraph_capture_sizes (each optional)")
    EngineConfig.add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    shapes = read_shapes(args.manifest) if args.manifest else {}
    compilation = CompilationConfig.from_args(args) or CompilationConfig.level(DEFAULT_COMPILATION_LEVEL)
    config = EngineConfig.from_args(args, compilation=with_shapes(compilation, shapes))
    with torch.inference_mode():
        report = prewarm(config)
    print(render(report))
    return 0 if report["complete"] else 1
