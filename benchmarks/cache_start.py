"""Cold against warm start through kiln's compile cache (a benchmark, not a test): prints, writes JSON.

CPU:  OMP_NUM_THREADS=1 python benchmarks/cache_start.py --model smollm2 --out benchmarks/results
GPU:  python benchmarks/cache_start.py --device cuda --model llama-3-8b --out $OUT --pycache-prefix /tmp/kiln-pycache

Every start is a fresh process that builds the engine as `kiln serve` would (LLMEngine; -O2
unless -O<n> / -cc.<key>=<value> say otherwise) on one compile-cache root: the first start
is cold (an empty root), the next --warm-runs are warm. For each start it reports the compile
phase (the timeline's dynamo + split + inductor + cache_load: what the cache is for), the start-up
total (process start to ready, imports included), the counters, and the parts of a warm
start (CompiledModel._warm_start: preload_wait, key, open, program, split, pieces, ahead,
dispatch; a dotted name is a finer part of the one before it). Targets: SmolLM2 warm
compile phase <= 2 s on the development CPU, Llama-3-8B <= 1 s on the H200.

Python bytecode: an install made by pip has .pyc files for torch and triton; a machine
whose install has none (or cannot write them, or sets PYTHONDONTWRITEBYTECODE) compiles
the source of every module each process imports, some of it inside the warm start (an
artifact load imports much of Inductor). --pycache-prefix DIR gives every start
PYTHONPYCACHEPREFIX=DIR (bytecode written and read there, as on a normal install), after
one untimed priming start (a cold start on a throwaway cache root) that fills it; without
it the starts run with the environment as it is. The JSON says which: "bytecode".
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMPILE_PHASES = ("dynamo", "split", "inductor", "cache_load")


def bytecode_state() -> dict:
    """Whether this process finds cached bytecode for torch (checked before torch is imported)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")  # a top-level package: found, not imported
    probe = Path(spec.origin).parent / "_inductor" / "codecache.py" if spec and spec.origin else None
    cached = probe is not None and Path(importlib.util.cache_from_source(str(probe))).exists()
    return {"pycache_prefix": sys.pycache_prefix, "dont_write_bytecode": sys.dont_write_bytecode,
            "torch_bytecode_cached": cached}


def child(args: argparse.Namespace, config_argv: list[str]) -> None:
    """One start-up: engine built, then a line of JSON on stdout."""
    sys.path.insert(0, str(ROOT))  # run from a checkout, installed or not
    bytecode = bytecode_state()
    import torch

    from kiln.compile.config import parse_compilation_args
    from kiln.config import EngineConfig
    from kiln.engine import LLMEngine

    _, compilation = parse_compilation_args(config_argv)
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype or "auto",
                          max_num_batched_tokens=args.max_num_batched_tokens, compilation=compilation)
    engine = LLMEngine(config)
    ready = time.perf_counter() - PROCESS_START
    phases = engine.timeline.as_dict()["phases_s"]
    compiled = engine.runner.compiled
    print(json.dumps({
        "phases_s": phases, "compile_phase_s": sum(phases.get(p, 0.0) for p in COMPILE_PHASES),
        "engine_ready_s": engine.timeline.ready_seconds, "process_ready_s": ready,
        "bytecode": bytecode, "warm_phases_s": compiled.stats["warm_phases_s"], "stats": compiled.stats, "entry": compiled.entry.key if compiled.entry else None,
        "describe": compiled.describe(), "torch": torch.__version__,
        "device_name": (torch.cuda.get_device_name() if config.torch_device.type == "cuda"
                        else f"cpu ({platform.processor() or platform.machine()})"),
        "dtype": str(config.torch_dtype)}))


def start(args: argparse.Namespace, config_argv: list[str], root: str, profile: Path | None = None) -> dict:
    """One start-up in a fresh process; under cProfile (stats written to `profile`) if given."""
    env = dict(os.environ, KILN_CACHE_ROOT=root)
    env.pop("KILN_DISABLE_COMPILE_CACHE", None)
    if args.pycache_prefix:
        env["PYTHONPYCACHEPREFIX"] = str(args.pycache_prefix)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    if args.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    profiler = ["-m", "cProfile", "-o", str(profile)] if profile else []
    cmd = [sys.executable, *profiler, __file__, "--child", "--model", args.model, "--device", args.device,
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), *config_argv]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if run.returncode != 0:
        raise RuntimeError(f"start-up failed:\n{run.stderr[-4000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def summary(runs: list[dict]) -> dict:
    medians = {k: statistics.median(r[k] for r in runs) for k in ("compile_phase_s", "engine_ready_s", "process_ready_s")}
    parts = dict.fromkeys(p for r in runs for p in r.get("warm_phases_s", {}))
    medians["warm_phases_s"] = {p: round(statistics.median(r.get("warm_phases_s", {}).get(p, 0.0) for r in runs), 4)
                                for p in parts}
    return medians


def main(argv: list[str]) -> None:
    sys.path.insert(0, str(ROOT))
    from kiln.compile.config import parse_compilation_args

    rest, _ = parse_compilation_args(argv)
    config_argv = [a for a in argv if a not in rest]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2 (embedded weights) or a preset name")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--warm-runs", type=int, default=3)
    parser.add_argument("--root", default=None, help="cache root (default: a fresh temporary one, so the first start is cold)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results")))
    parser.add_argument("--profile", type=Path, default=None,
                        help="after the timed starts, one more cold and one warm start under cProfile: "
                             "<dir>/cache_start_{cold,warm}.prof (view with python -m pstats)")
    parser.add_argument("--pycache-prefix", type=Path, default=None,
                        help="PYTHONPYCACHEPREFIX for every start, filled by one untimed priming start "
                             "(default: the environment as it is; see above)")
    parser.add_argument("--no-prime", action="store_true",
                        help="with --pycache-prefix: skip the priming start (the prefix is already filled)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(rest)
    if args.child:
        return child(args, config_argv)

    root = args.root or tempfile.mkdtemp(prefix="kiln-cache-bench-")
    primed = False
    if args.pycache_prefix and not args.no_prime:
        args.pycache_prefix.mkdir(parents=True, exist_ok=True)
        prime = start(args, config_argv, tempfile.mkdtemp(prefix="kiln-cache-prime-"))
        primed = True
        print(f"priming start (untimed, fills {args.pycache_prefix}): process ready {prime['process_ready_s']:.2f} s",
              flush=True)
    cold = start(args, config_argv, root)
    print(f"cold: compile phase {cold['compile_phase_s']:.2f} s {_phases(cold)}, ready {cold['engine_ready_s']:.2f} s "
          f"(process {cold['process_ready_s']:.2f} s); {cold['stats']['inductor_compiles']} Inductor compiles", flush=True)
    warm = []
    for i in range(args.warm_runs):
        warm.append(start(args, config_argv, root))
        w = warm[-1]
        print(f"warm {i + 1}: compile phase {w['compile_phase_s']:.2f} s {_phases(w)}, ready "
              f"{w['engine_ready_s']:.2f} s (process {w['process_ready_s']:.2f} s); "
              f"{w['stats']['inductor_compiles']} Inductor compiles, {w['stats']['graphs_seen']} Dynamo graphs, "
              f"{w['stats']['pieces_loaded']} artifacts loaded", flush=True)
        print(f"    warm start parts: {_parts(w)}", flush=True)
    target = 1.0 if args.device == "cuda" else 2.0
    report = {"model": args.model, "device": cold["device_name"], "torch": cold["torch"], "dtype": cold["dtype"],
              "threads": os.environ.get("OMP_NUM_THREADS"), "max_num_batched_tokens": args.max_num_batched_tokens,
              "config_argv": config_argv, "describe": cold["describe"], "entry": cold["entry"],
              "cold": cold, "warm": warm, "warm_median": summary(warm) if warm else None,
              "target_warm_compile_phase_s": target,
              "bytecode": {**cold["bytecode"], "primed": primed,
                           "cached_in_every_warm_start": all(w["bytecode"]["torch_bytecode_cached"] for w in warm)}}
    args.out.mkdir(parents=True, exist_ok=True)
    # Kept apart from a run on the environment as is, so that both can be reported.
    path = args.out / f"cache_start_{args.model}_{args.device}{'_pycache' if args.pycache_prefix else ''}.json"
    path.write_text(json.dumps(report, indent=2))
    if warm:
        m = report["warm_median"]
        verdict = "meets" if m["compile_phase_s"] <= target else "MISSES"
        print(f"{args.model} on {cold['device_name']}: compile phase cold {cold['compile_phase_s']:.2f} s -> warm "
              f"{m['compile_phase_s']:.2f} s (median; {verdict} the {target:.0f} s target); start-up to ready cold "
              f"{cold['engine_ready_s']:.2f} s -> warm {m['engine_ready_s']:.2f} s")
        print(f"warm start parts (median s): {_parts(m)}")
    b = report["bytecode"]
    print(f"bytecode: {'PYTHONPYCACHEPREFIX=' + b['pycache_prefix'] if b['pycache_prefix'] else 'environment as is'}; "
          f"torch bytecode cached in every warm start: {b['cached_in_every_warm_start']}")
    print(f"wrote {path}")
    if args.profile:
        # Separate starts, so that cProfile's overhead stays out of the timed numbers above.
        args.profile.mkdir(parents=True, exist_ok=True)
        profile_root = tempfile.mkdtemp(prefix="kiln-cache-profile-")
        for kind in ("cold", "warm"):
            run = start(args, config_argv, profile_root, args.profile / f"cache_start_{kind}.prof")
            print(f"profiled {kind} start: compile phase {run['compile_phase_s']:.2f} s {_phases(run)} "
                  f"-> {args.profile}/cache_start_{kind}.prof")


def _parts(run: dict) -> str:
    """The warm start's parts (CompiledModel._warm_start); a dotted name is a finer part of the one before."""
    return ", ".join(f"{k} {v:.3f}" for k, v in run.get("warm_phases_s", {}).items())


def _phases(run: dict) -> str:
    parts = [f"{p} {run['phases_s'][p]:.2f}" for p in COMPILE_PHASES if p in run["phases_s"]]
    return f"({', '.join(parts)})" if parts else ""


if __name__ == "__main__":
    main(sys.argv[1:])
