"""`kiln inspect`: what the compile pipeline makes of a model under given flags.

    kiln inspect --model smollm2 [-O2 | -O3 | -cc.<key>=<value> ...] [--no-compile] [--json]

Prints the effective split ops and where each was declared, the pieces and unique pieces,
the compile ranges and sizes, the CUDA graph mode and buckets of each phase (what a server
start captures on a GPU), the custom ops enabled, the compile-cache entry with its factor hashes, and the
path of the split graph as Python. The engine and compile flags are those of `kiln serve`
and `kiln prewarm`, and without an -O flag it inspects -O2 (-O0 is eager: nothing to show).

With a cache entry for these settings it starts warm (no Dynamo, no Inductor: about a
second). Without one it compiles, as a server start would, and keeps the entry;
`--no-compile` instead captures and splits with the pieces left uncompiled, and shows no
entry. Weights are not loaded: the compiled code depends on the architecture only.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch

from kiln.compile.config import DEFAULT_COMPILATION_LEVEL, CompilationConfig
from kiln.config import EngineConfig


def inspect_model(config: EngineConfig, compile_missing: bool = True) -> dict:
    """The report for `config`; compiles only when no cache entry has these settings and
    `compile_missing` is set."""
    from kiln.loader import load_source

    source = load_source(config.model)
    compilation = config.compilation_config
    custom_ops = config.resolved_custom_ops()
    report = {"model": source.name, "device": str(config.torch_device),
              "dtype": str(config.torch_dtype).removeprefix("torch."),
              "max_num_batched_tokens": config.max_num_batched_tokens,
              "compilation": dataclasses.asdict(compilation), "forward": forward_text(compilation),
              "custom_ops": custom_ops_report(config, custom_ops), "cuda_graphs": cuda_graphs_report(config),
              "run": None, "split_ops": [], "pieces": None, "partitions": None, "plan": None, "cache": None,
              "split_graph": None}
    if compilation.mode != 3:
        report["run"] = {"how": "none", "text": not_piecewise_text(compilation.mode)}
        return report
    report.update(piecewise_report(config, source, custom_ops, compile_missing))
    return report


def piecewise_report(config: EngineConfig, source, custom_ops: frozenset[str], compile_missing: bool) -> dict:
    from kiln.compile import compile_model
    from kiln.compile.layer_stamping import layer_kinds
    from kiln.engine.runner import compile_cache
    from kiln.models import build_model

    model = build_model(source.config, config.torch_dtype, config.torch_device, custom_ops, None)
    cache = compile_cache(source, config.torch_dtype, custom_ops)
    # A lazy strategy lets a warm start load what the entry holds and compile nothing; the
    # strategy is not part of the cache key, so the entry is the one the flags would use.
    lazy = dataclasses.replace(config.compilation_config, strategy="lazy")
    compiled = compile_model(model, lazy, config.max_num_batched_tokens, cache=cache)
    start = time.perf_counter()
    how, ran = start_forward(compiled, compile_missing)
    seconds = time.perf_counter() - start
    program, plan = ran.backend.program, compiled.backend.plan
    entry = compiled.entry if how != "captured" else None
    return {"run": {"how": how, "seconds": round(seconds, 2), "stats": ran.stats,
                    "text": run_text(how, seconds, ran.stats, cache is not None)},
            "split_ops": [{"name": op.name, "source": op.source} for op in compiled.split_ops],
            "pieces": pieces_report(program),
            "layer_kinds": layer_kinds(model),
            "partitions": partitions_report(ran, config.compilation_config.splitting_mode),
            "plan": {"ranges": [[s.lo, s.hi] for s in plan.ranges], "sizes": sorted(plan.sizes)},
            "cache": cache_report(cache, entry),
            "split_graph": split_graph_path(entry, program, source.name)}


def start_forward(compiled, compile_missing: bool) -> tuple[str, object]:
    """How the forward came to be ("loaded", "compiled" or "captured"), and the CompiledModel
    that made it."""
    from kiln.compile import compile_model
    from kiln.forward_context import set_forward_context, warm_up_metadata

    model, max_tokens = compiled.model, compiled.max_num_batched_tokens
    device = next(model.parameters()).device

    def inputs(n: int) -> tuple:
        return torch.zeros(n, dtype=torch.long, device=device), torch.zeros(n, dtype=torch.long, device=device)

    # No KV cache: the opaque ops run as in a profile step.
    with torch.inference_mode(), set_forward_context(None, {}):
        if compiled.start_from_cache():
            return "loaded", compiled
        if compile_missing:
            compiled.warm_up(inputs, context=lambda n: set_forward_context(warm_up_metadata(n, device), {}))
            return "compiled", compiled
        split_only = compile_model(model, dataclasses.replace(compiled.config, piece_compiler="eager"), max_tokens)
        split_only(*inputs(min(max_tokens, 16)))  # any count >= 2 captures; the split is the same
        return "captured", split_only


def forward_text(compilation: CompilationConfig) -> str:
    from kiln.compile.compiled_model import _MODE_NAMES

    text = f"mode {compilation.mode} ({_MODE_NAMES[compilation.mode]})"
    if compilation.mode == 2:
        text += f", backend {compilation.backend}"
    if compilation.mode == 3:
        text += f", {compilation.piece_compiler} pieces, {compilation.strategy} strategy"
    return text


def not_piecewise_text(mode: int) -> str:
    if mode == 0:
        return ("eager: the forward runs as the model's own Python, so nothing is captured, split or cached; "
                "kiln inspect shows the compiled pipeline of -O1..-O3 (the default is -O2)")
    return (f"mode {mode} compiles Dynamo's graph whole: nothing is split and kiln's compile cache is not used; "
            f"kiln inspect shows the piecewise pipeline of -O1..-O3 (mode 3, the default -O2)")


def run_text(how: str, seconds: float, stats: dict, cache_on: bool) -> str:
    if how == "loaded":
        return (f"started warm from the compile cache in {seconds:.1f} s ({stats['pieces_loaded']} artifacts "
                f"loaded): no Dynamo, no Inductor")
    if how == "captured":
        return (f"--no-compile: no cache entry had these settings, so Dynamo captured and split the forward "
                f"in {seconds:.1f} s; the pieces were not compiled and nothing was written to the cache")
    if stats["inductor_compiles"] == 0 and stats["pieces_loaded"]:
        return (f"the cache entry holds no replayable split graph: Dynamo captured again and "
                f"{stats['pieces_loaded']} artifacts were loaded, no Inductor ({seconds:.1f} s)")
    where = "kept in the cache entry below, so the next inspect or start loads it" if cache_on else \
        "in memory only (the compile cache is off)"
    return (f"no cache entry had these settings: captured and compiled now as a server start would, "
            f"{stats['inductor_compiles']} Inductor compiles in {seconds:.1f} s, {where}")


def custom_ops_report(config: EngineConfig, enabled: frozenset[str]) -> dict:
    from kiln.ops import known_ops

    return {"enabled": sorted(enabled), "known": known_ops(), "requested": list(config.custom_ops),
            "default": config.default_custom_ops}


def pieces_report(program) -> dict:
    uniques = []
    for i, piece in enumerate(program.uniques):
        used_by = [name for name, slot in program.slots.items() if slot[0] == i]
        uniques.append({"index": i, "name": piece.name, "used_by": used_by})
    return {**program.summary(), "uniques": uniques, "regions": list(program.regions)}


def partitions_report(compiled, splitting_mode: str) -> dict | None:
    """Inductor's partitions between the split ops (splitting_mode inductor_partition): how many
    each compiled artifact has. Each gets a CUDA graph per bucket of a piecewise phase."""
    if splitting_mode != "inductor_partition":
        return None
    partitions = compiled.backend.partitions
    slots = partitions.slots if partitions is not None else []
    return {"artifacts": sum(slot.index == 0 for slot in slots), "functions": len(slots),
            "per_artifact": sorted({slot.count for slot in slots})}


def cache_report(cache, entry) -> dict:
    from kiln.compile.cache import cache_root

    if cache is None:
        return {"root": str(cache_root()), "off": True, "entry": None}
    if entry is None:
        return {"root": str(cache.root.path), "off": False, "entry": None}
    factors = entry_factors(entry)
    return {"root": str(cache.root.path), "off": False, "entry": {
        "key": entry.key, "path": str(entry.path), "complete": entry.complete(), "coverage": entry.coverage(),
        "factor_hashes": factor_hashes(factors), "code_files": len(factors.get("code") or {}),
        "key_matches_factors": key_matches(entry.key, factors)}}


def entry_factors(entry) -> dict:
    from kiln.compile.cache.key import FACTORS

    factors = {}
    for name in FACTORS:
        try:
            factors[name] = json.loads((entry.path / f"{name}.json").read_text())
        except (OSError, ValueError):
            factors[name] = None
    return factors


def factor_hashes(factors: dict) -> dict:
    from kiln.compile.cache.key import digest

    return {name: digest(value)[:16] if value is not None else None for name, value in factors.items()}


def key_matches(key: str, factors: dict) -> bool:
    from kiln.compile.cache.key import key_of

    return all(v is not None for v in factors.values()) and key_of(factors) == key


def split_graph_path(entry, program, model_name: str) -> dict:
    """The entry's computation_graph.py, or (no entry, or none kept) a file written now."""
    from kiln.compile.cache.entry import READABLE_GRAPH

    if entry is not None and READABLE_GRAPH in entry.manifest.get("files", {}):
        return {"path": str(entry.path / READABLE_GRAPH), "where": "cache entry"}
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(model_name).name)
    with tempfile.NamedTemporaryFile("w", prefix=f"kiln-split-graph-{safe}-", suffix=".py", delete=False) as f:
        f.write(program.readable())
    return {"path": f.name, "where": "written for this run"}


# -- rendering ----------------------------------------------------------------------------


def render(report: dict) -> str:
    lines = [f"kiln inspect: {report['model']} on {report['device']}, {report['dtype']}, "
             f"max {report['max_num_batched_tokens']} batched tokens",
             f"  forward: {report['forward']}",
             f"  this run: {report['run']['text']}"]
    if report["pieces"] is not None:
        lines += split_ops_lines(report["split_ops"]) + pieces_lines(report["pieces"])
        lines += layer_kind_lines(report["layer_kinds"])
        lines += partitions_lines(report["partitions"], report["cuda_graphs"])
        lines += [f"compile ranges: {', '.join(f'[{lo}, {hi}]' for lo, hi in report['plan']['ranges'])}",
                  f"compile sizes: {', '.join(map(str, report['plan']['sizes'])) or 'none'}"]
    lines += cuda_graph_lines(report["cuda_graphs"]) + [custom_ops_line(report["custom_ops"])]
    if report["cache"] is not None:
        lines += cache_lines(report["cache"], report["run"]["how"])
    if report["split_graph"] is not None:
        graph = report["split_graph"]
        lines.append(f"split graph as Python: {graph['path']}"
                     + (" (written for this run: no cache entry holds it)" if graph["where"] != "cache entry" else ""))
    return "\n".join(lines)


def cuda_graphs_report(config: EngineConfig) -> dict:
    from kiln.cudagraph import CudagraphDispatcher

    return CudagraphDispatcher.from_config(config.compilation_config, config.max_num_seqs,
                                       config.max_num_batched_tokens,
                                       enabled=config.torch_device.type == "cuda").summary()


def cuda_graph_lines(graphs: dict) -> list[str]:
    lines = []
    for phase, batches in (("decode", "uniform decode batches"), ("prefill", "mixed batches")):
        p = graphs[phase]
        sizes = p["buckets"]
        buckets = f"{len(sizes)} buckets: {', '.join(map(str, sizes))}" if sizes else "no buckets"
        static = ", whole forward compiled per bucket" if p["static_compile"] else ""
        lines.append(f"CUDA graphs, {phase} ({batches}): {p['mode']} over the {p['compiler']} forward{static}; {buckets}")
    if not graphs["enabled"]:
        lines.append("  (no CUDA device: graphs pass through, nothing is captured or padded)")
    return lines


def split_ops_lines(ops: list[dict]) -> list[str]:
    width = max((len(op["name"]) for op in ops), default=0)
    return [f"split ops ({len(ops)}):"] + [f"  {op['name']:{width}}  {op['source']}" for op in ops]


def pieces_lines(pieces: dict) -> list[str]:
    lines = [f"pieces: {pieces['pieces']} ({pieces['unique_pieces']} unique) around {pieces['opaque_regions']} "
             f"opaque regions; " + ("warm starts skip Dynamo" if pieces["direct_call"]
                                    else "warm starts run Dynamo (no direct call)")]
    for unique in pieces["uniques"]:
        users = unique["used_by"]
        shown = ", ".join(users) if len(users) <= 4 else f"{users[0]}, {users[1]}, ..., {users[-1]}"
        lines.append(f"  unique piece {unique['index']}: {len(users)} piece(s): {shown}")
    return lines


def layer_kind_lines(kinds: list[list[str]]) -> list[str]:
    if not kinds:
        return []
    lines = [f"repeated layers: {sum(map(len, kinds))} of {len(kinds)} kind(s); Dynamo traces one call of each "
             f"(and of each pattern of None arguments) and stamps the rest"]
    for i, paths in enumerate(kinds):
        indices = [p.rpartition(".")[2] for p in paths]
        shown = ", ".join(indices[:8]) + (f", ... ({len(indices)} in all)" if len(indices) > 8 else "")
        lines.append(f"  kind {i}: {paths[0].rpartition('.')[0]}.{{{shown}}}")
    return lines


def partitions_lines(partitions: dict | None, graphs: dict) -> list[str]:
    if partitions is None:
        return []
    if not partitions["functions"]:
        return ["Inductor partitions: none here (Inductor partitions device code only: on a CPU each compiled "
                "artifact runs as one function; on a GPU it is cut at every split op)"]
    buckets = sum(len(graphs[phase]["buckets"]) for phase in ("prefill", "decode")
                  if graphs[phase]["mode"] == "piecewise")
    per = " or ".join(map(str, partitions["per_artifact"]))
    return [f"Inductor partitions: {per} per compiled artifact ({partitions['artifacts']} artifacts, "
            f"{partitions['functions']} functions), the split ops run between them; piecewise CUDA graphs: one "
            f"per partition and bucket ({buckets} piecewise buckets)"]


def custom_ops_line(ops: dict) -> str:
    enabled = ", ".join(ops["enabled"]) or "none"
    how = (f"--custom-ops {','.join(ops['requested'])}" if ops["requested"] else
           f"default {','.join(ops['default'])}"
           + (": without Inductor the kernels are the only fusion" if ops["default"] == ["all"]
              else ": Inductor fuses the native paths better, the norms stay kernels to round as eager does"))
    return f"custom ops enabled: {enabled} (of {', '.join(ops['known'])}; {how})"


def cache_lines(cache: dict, how: str) -> list[str]:
    if cache["off"]:
        return ["cache entry: none (the compile cache is off: KILN_DISABLE_COMPILE_CACHE)"]
    entry = cache["entry"]
    if entry is None:
        return [f"cache entry: no entry yet under {cache['root']} (kiln prewarm, or kiln inspect without "
                f"--no-compile, makes one with these flags)"]
    cover = entry["coverage"]
    hashes = entry["factor_hashes"]
    held = ([f"[{lo}, {hi}]" for lo, hi in cover["ranges"]] + [f"size {n}" for n in cover["sizes"]])
    return [f"cache entry: {entry['key']}",
            f"  path: {entry['path']}",
            f"  factor hashes: env {hashes['env']}, config {hashes['config']}, code {hashes['code']} "
            f"({entry['code_files']} files), compiler {hashes['compiler']}",
            f"  key from the factors: {'matches' if entry['key_matches_factors'] else 'DIFFERS (edited by hand?)'}",
            f"  holds: {', '.join(held) or 'nothing yet'}; missing: {', '.join(cover['missing']) or 'none'}"
            f" -> {'complete' if entry['complete'] else 'incomplete (a start with these flags compiles the rest)'}"]


def register(commands) -> None:
    about = ("split ops, pieces, ranges and sizes, custom ops, cache entry and split graph of a model under "
             "the compile flags (default -O2); starts warm from the compile cache, or, with no entry for these "
             "flags, compiles as a server start would (--no-compile: capture and split only)")
    p = commands.add_parser("inspect", help=about, description=about)
    p.add_argument("--no-compile", action="store_true",
                   help="with no cache entry, capture and split only: pieces uncompiled, no entry shown")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    EngineConfig.add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    compilation = CompilationConfig.from_args(args) or CompilationConfig.level(DEFAULT_COMPILATION_LEVEL)
    config = EngineConfig.from_args(args, compilation=compilation)  # -O2 unless a flag said otherwise
    report = inspect_model(config, compile_missing=not args.no_compile)
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0
