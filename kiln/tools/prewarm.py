"""`kiln prewarm`: fill the compile cache with everything a server would need, and say what
is in the entry.

    kiln prewarm --model smollm2 -O3 [--manifest shapes.json] [--aot] [--export FILE]

The engine settings and compile flags are those of `kiln serve`; start the server with the
same ones and it starts warm. With no -O flag it prewarms -O2. A manifest names the shapes:

    {"compile_ranges": [16, 256], "compile_sizes": [1, 2, 4, 8], "cudagraph_capture_sizes": [1, 2, 4]}

(every key optional; they override the compile flags, as -cc.compile_ranges=... would).
Weights are not loaded: the compiled code depends on the architecture, not on the values.
CUDA graphs cannot be stored on disk: the buckets are reported here and captured at each
server start on a GPU (a few seconds, benchmarks/results/cudagraphs_*.json).

With --aot every piece is also packaged by AOTInductor (kiln.compile.aot_piece; tens of seconds
a piece, for the C++ compiler): a start that finds packages for all its pieces imports neither
Dynamo nor Inductor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from pathlib import Path

import torch

from kiln.compile.aot_piece import refused_on
from kiln.compile.config import DEFAULT_COMPILATION_LEVEL, CompilationConfig
from kiln.config import EngineConfig

logger = logging.getLogger("kiln")

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


def with_shapes(compilation: CompilationConfig, shapes: dict, device: str) -> CompilationConfig:
    """The compile settings with the manifest's ranges and sizes, every one compiled ahead."""
    if compilation.mode != 3 and not (compilation.mode == 0 and device == "cuda"):
        raise ValueError(f"kiln prewarm fills the compile cache of piecewise compilation (mode 3, -O1..-O3), "
                         f"and on a GPU the kernel cache of any mode; mode {compilation.mode} on {device} keeps "
                         f"nothing")
    overrides = {k: shapes[k] for k in MANIFEST_KEYS if k in shapes}
    # Strategy is not part of the cache key: compiling everything now serves a lazy server too.
    return dataclasses.replace(compilation, strategy="eager", **overrides) if compilation.mode == 3 else \
        dataclasses.replace(compilation, **overrides)


def prewarm(config: EngineConfig, aot: bool = False) -> dict:
    """Start an engine as a server with `config` would, on random weights (compiled code and
    kernels depend on shapes, not values): every range and size compiles into the compile-cache
    entry, and on a GPU every kernel compiles into the cache root's Triton cache while the GEMV
    is tuned for each shape and the picks are kept; on the CPU kiln's C++ attention is built into
    the cache root. Returns what the entry and root now hold."""
    from kiln.compile.cache import cache_disabled
    from kiln.compile.cache.triton_kernels import counts
    from kiln.engine import LLMEngine
    from kiln.tools.inspect_cmd import cuda_graphs_report

    if cache_disabled():
        raise ValueError("the compile cache is off (KILN_DISABLE_COMPILE_CACHE is set): nothing to prewarm")
    config = dataclasses.replace(config, load_format="dummy")
    on_gpu = config.torch_device.type == "cuda"
    start = time.perf_counter()
    with _gemv_tuning(on_gpu):
        engine = LLMEngine(config)
    try:
        compiled = engine.runner.compiled
        entry = compiled.entry
        if compiled.mode == 3 and entry is None:
            raise RuntimeError("the forward was compiled but no cache entry was written; see the log")
        packages = compiled.package_pieces() if aot else None
        seconds = time.perf_counter() - start
        tuned = _keep_gemv_choices(config.torch_device) if on_gpu else 0
        cpu_attention = None
        if not on_gpu:  # kiln's C++ attention, built here so that no serving start pays the compiler
            from kiln.ops.cpu import extension

            try:
                cpu_attention = str(extension.build())
            except Exception as e:  # no compiler here: the entry is still good, starts use the reference
                cpu_attention = f"not built ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                logger.warning("CPU attention kernel %s; starts here run the Python reference", cpu_attention)
        report = {"key": entry.key if entry else None, "path": str(entry.path) if entry else None,
                  "model": engine.source.name, "device": str(config.torch_device),
                  "dtype": str(config.torch_dtype).removeprefix("torch."), "describe": compiled.describe(),
                  "coverage": entry.coverage() if entry else None, "complete": entry.complete() if entry else True,
                  "graph": entry.manifest.get("graph") if entry else None,
                  "cuda_graphs": cuda_graphs_report(config), "seconds": seconds, "stats": compiled.stats,
                  "triton": counts(), "gemv_tuned": tuned, "cpu_attention": cpu_attention, "aot": packages,
                  "packaged": entry.packaged() if entry else False}
    finally:
        engine.shutdown()
    return report


def _gemv_tuning(on_gpu: bool):
    if not on_gpu:
        return contextlib.nullcontext()
    from kiln.ops.triton import gemv_configs

    return gemv_configs.tuning()


def _keep_gemv_choices(device) -> int:
    from kiln.ops.triton import gemv, gemv_configs

    return gemv_configs.keep(device, gemv.tuned_choices())


def render(report: dict) -> str:
    stats, graph = report["stats"], report["graph"] or {}
    graphs = report["cuda_graphs"]
    lines = []
    if report["key"] is None:
        lines.append(f"no compile-cache entry: the forward of {report['model']} is not compiled "
                     f"({report['describe']}); what a start compiles is kiln's kernels")
    else:
        cover = report["coverage"]
        lines += [
            f"cache entry {report['key']} ({report['path']})",
            f"  model {report['model']} on {report['device']}, {report['dtype']}: {report['describe']}",
            f"  graph: {graph.get('pieces', '?')} pieces ({graph.get('unique_pieces', '?')} unique), "
            f"{graph.get('opaque_regions', '?')} opaque regions; "
            + ("warm starts skip Dynamo" if graph.get("direct_call") else "warm starts run Dynamo (no direct call)"),
            f"  ranges: {', '.join(f'[{lo}, {hi}]' for lo, hi in cover['ranges']) or 'none'}",
            f"  sizes: {', '.join(map(str, cover['sizes'])) or 'none'}"]
    lines.append("  CUDA graph buckets (captured at each start on a GPU; graphs cannot be stored): " + "; ".join(
        f"{phase} {g['mode']} {', '.join(map(str, g['buckets'])) or '(none)'}"
        for phase, g in ((p, graphs[p]) for p in ("decode", "prefill")))
        + ("" if graphs["enabled"] else " (no CUDA device here: nothing is captured)"))
    if report["device"].startswith("cuda"):
        lines.append(f"  kernels: {report['triton']['compiled']} Triton kernels compiled, "
                     f"{report['triton']['cache_hits']} found in the cache; GEMV configs kept for "
                     f"{report['gemv_tuned']} shapes")
    if report.get("aot") is not None:
        aot = report["aot"]
        lines.append(f"  AOT packages: {aot['packages']} built in {aot['seconds']:.1f} s"
                     + ("; starts load them without Dynamo or Inductor" if report["packaged"] else "")
                     + "".join(f"\n    not packaged: {what}: {why}" for what, why in aot["refused"].items()))
    if report.get("cpu_attention"):
        lines.append(f"  CPU attention kernel: {report['cpu_attention']}")
    if report["key"] is not None:
        missing = report["coverage"]["missing"]
        lines.append(f"  missing: {', '.join(missing) or 'none'} -> {'complete' if report['complete'] else 'INCOMPLETE'}")
    lines.append(f"  this run: {stats['inductor_compiles']} Inductor compiles, {stats['pieces_loaded']} artifacts "
                 f"loaded, {report['seconds']:.1f} s")
    return "\n".join(lines)


def register(commands) -> None:
    p = commands.add_parser("prewarm", help="compile everything a server start needs into the cache root (the "
                                            "compile entry; on a GPU kiln's kernels and GEMV configs); print "
                                            "what it holds")
    p.add_argument("--manifest", default=None,
                   help="JSON with compile_ranges, compile_sizes, cudagraph_capture_sizes (each optional)")
    p.add_argument("--aot", action="store_true",
                   help="also package every piece with AOTInductor: starts that load the packages import neither "
                        "Dynamo nor Inductor (prewarm takes tens of seconds more a piece)")
    p.add_argument("--export", default=None, metavar="FILE",
                   help="then write the entry, the kernel cache and the tuning into FILE (kiln cache import FILE)")
    EngineConfig.add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    shapes = read_shapes(args.manifest) if args.manifest else {}
    compilation = CompilationConfig.from_args(args) or CompilationConfig.level(DEFAULT_COMPILATION_LEVEL)
    if args.aot and compilation.mode != 3:
        raise ValueError(f"--aot packages the pieces of a piecewise compile (-O1..-O3); mode {compilation.mode} "
                         f"has none")
    config = EngineConfig.from_args(args)
    if args.aot and (why := refused_on(config.torch_device.type)):
        raise ValueError(why)
    config = dataclasses.replace(config, compilation=with_shapes(compilation, shapes, config.torch_device.type))
    with torch.inference_mode():
        report = prewarm(config, aot=args.aot)
    print(render(report))
    if not report["complete"]:
        return 1
    if args.export:
        from kiln.compile.cache import CacheRoot
        from kiln.compile.cache.archive import export
        from kiln.tools.cache_cli import describe_archive

        manifest = export(CacheRoot(), [report["key"]] if report["key"] else [], Path(args.export))
        print(describe_archive(args.export, manifest, "wrote"))
    return 0
