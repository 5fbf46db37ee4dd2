"""Cold compile time through kiln's compile pipeline (a benchmark, not a test): prints, writes JSON.

CPU:  python benchmarks/compile_time.py --model smollm2 --out benchmarks/results
GPU:  python benchmarks/compile_time.py --model llama-3-8b --device cuda --out $OUT

Reports the first call's time split into Dynamo (bytecode analysis, capture) and Inductor
(piece compiles), the unique-piece count and the counters, with a fresh Inductor cache.
Options: --warm repeats the start in a new process on the same cache; --step-tokens times
eager against compiled forwards; --overhead measures per-call host time of every mode on
tiny-llama (plain torch.compile checks guards on every call, kiln's dispatch does not).
-O<n> and -cc.<key>=<value> pick the compilation config, as on kiln's command line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not
from kiln.compile import compile_model  # noqa: E402
from kiln.compile.config import CompilationConfig, parse_compilation_args  # noqa: E402
from kiln.config import default_custom_ops, resolve_custom_ops  # noqa: E402
from kiln.models import build_model  # noqa: E402
from kiln.models.presets import PRESETS  # noqa: E402


def build(name: str, device: torch.device, dtype: torch.dtype, config: CompilationConfig) -> torch.nn.Module:
    custom_ops = resolve_custom_ops(default_custom_ops(config, device.type), "none")
    if name in PRESETS:  # random weights
        return build_model(PRESETS[name], dtype, device, custom_ops, None)
    from kiln.loader import (
        load_source,  # needs the gguf reader, absent on the GPU machine
    )

    source = load_source(name)
    return build_model(source.config, dtype, device, custom_ops, source.weights())


def make_inputs(vocab: int, device: torch.device):
    def inputs(n: int):
        gen = torch.Generator().manual_seed(n)
        return torch.randint(0, vocab, (n,), generator=gen).to(device), torch.arange(n, device=device)

    return inputs


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_call(fn, args, device, reps: int) -> float:
    """Median seconds of fn(*args) over reps, after two untimed calls."""
    times = []
    for i in range(reps + 2):
        sync(device)
        start = time.perf_counter()
        fn(*args)
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def cold_compile(model, config: CompilationConfig, max_tokens: int, capture_tokens: int, inputs, device) -> dict:
    compiled = compile_model(model, config, max_tokens)
    sync(device)
    start = time.perf_counter()
    compiled(*inputs(capture_tokens))
    sync(device)
    first_call = time.perf_counter() - start
    stats = compiled.stats
    return {"first_call_s": first_call, "compile_s": stats["total_s"], "dynamo_s": stats["dynamo_s"],
            "inductor_s": stats["compile_s"],
            "other_backend_s": stats["backend_s"] - stats["compile_s"], "stats": stats,
            "describe": compiled.describe(), "compiled": compiled}


def step_times(model, compiled, counts: list[int], inputs, device, reps: int) -> list[dict]:
    rows = []
    for n in counts:
        args = inputs(n)
        want, got = model(*args).float(), compiled(*args).float()
        error = ((got - want).abs().max() / want.abs().max()).item()
        eager, comp = time_call(model, args, device, reps), time_call(compiled, args, device, reps)
        rows.append({"tokens": n, "eager_ms": eager * 1e3, "compiled_ms": comp * 1e3, "speedup": eager / comp,
                     "max_rel_diff": error})
    return rows


def host_overhead(num_tokens: int, rounds: int, calls: int) -> dict:
    """Per-call time of a 2-layer toy, where host work dominates, under each mode."""
    device = torch.device("cpu")
    inputs = make_inputs(512, device)
    contenders = {"eager": None,
                  "plain torch.compile (guards, mode 1)": CompilationConfig(mode=1),
                  "kiln Dynamo once + inductor (mode 2)": CompilationConfig(mode=2, backend="inductor"),
                  "kiln piecewise inductor (mode 3)": CompilationConfig(mode=3)}
    fns = {}
    for name, config in contenders.items():
        model = build("tiny-llama", device, torch.float32, config or CompilationConfig(mode=0))
        fns[name] = model if config is None else compile_model(model, config, 64)
        fns[name](*inputs(16))  # capture / compile
    args = inputs(num_tokens)
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):  # interleaved rounds, best of: other load on the machine only adds
        for name, fn in fns.items():
            for _ in range(20):
                fn(*args)
            start = time.perf_counter()
            for _ in range(calls):
                fn(*args)
            best[name] = min(best[name], (time.perf_counter() - start) / calls * 1e6)
    plain, once = best["plain torch.compile (guards, mode 1)"], best["kiln Dynamo once + inductor (mode 2)"]
    return {"tokens": num_tokens, "us_per_call": best, "saved_by_skipping_dynamo_us": plain - once}


def warm_start(config_argv: list[str], args: argparse.Namespace, cache_dir: str) -> dict:
    """The same start in a fresh process, on the cache the cold run filled."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, __file__, *config_argv, "--model", args.model, "--device", args.device,
               "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--capture-tokens", str(args.capture_tokens), "--no-warm", "--out", out,
               "--cache-dir", cache_dir] + (["--dtype", args.dtype] if args.dtype else [])
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        result = json.loads(next(Path(out).glob("*.json")).read_text())
    return {k: result[k] for k in ("first_call_s", "compile_s", "dynamo_s", "inductor_s", "stats")}


def main(argv: list[str]) -> None:
    rest, config = parse_compilation_args(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2 (embedded weights) or a preset name")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--capture-tokens", type=int, default=16, help="token count of the first call")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--cache-dir", default=None, help="Inductor cache (default: a fresh one: cold)")
    parser.add_argument("--warm", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--step-tokens", default="", help="e.g. 1,8,64,256: eager vs compiled step time")
    parser.add_argument("--step-reps", type=int, default=20)
    parser.add_argument("--overhead", action="store_true", help="per-call host overhead of every mode")
    args = parser.parse_args(rest)

    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="kiln-compile-bench-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = build(args.model, device, dtype, config)
    inputs = make_inputs(model.config.vocab_size, device)

    with torch.inference_mode():
        result = cold_compile(model, config, args.max_num_batched_tokens, args.capture_tokens, inputs, device)
        compiled = result.pop("compiled")
        counts = [int(n) for n in args.step_tokens.split(",") if n]
        steps = step_times(model, compiled, counts, inputs, device, args.step_reps) if counts else []
        overhead = host_overhead(4, rounds=5, calls=500) if args.overhead else None
    where = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    report = {"model": args.model, "device": where,
              "torch": torch.__version__, "dtype": str(dtype), "threads": torch.get_num_threads(),
              "max_num_batched_tokens": args.max_num_batched_tokens, "config": vars(config),
              "cache": "warm" if args.cache_dir else "cold", **result, "step_times": steps,
              "host_overhead": overhead}
    if args.warm and not args.cache_dir:
        report["warm_start"] = warm_start([a for a in argv if a not in rest], args, cache_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"compile_time_{args.model}_{args.device}.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    print_report(report, path)


def print_report(r: dict, path: Path) -> None:
    s = r["stats"]
    print(f"{r['model']} on {r['device']} ({r['dtype']}, torch {r['torch']}, {r['threads']} threads): {r['describe']}")
    print(f"  {r['cache']} compile {r['compile_s']:.2f} s = Dynamo {r['dynamo_s']:.2f} s + Inductor "
          f"{r['inductor_s']:.2f} s + split/fake propagation {r['other_backend_s']:.2f} s "
          f"(first call {r['first_call_s']:.2f} s)")
    print(f"  pieces {s['pieces']} ({s['unique_pieces']} unique), opaque regions {s['opaque_regions']}, "
          f"Inductor compiles {s['inductor_compiles']} ({s['cache_hits']} cache hits)")
    if "warm_start" in r:
        w = r["warm_start"]
        print(f"  warm compile {w['compile_s']:.2f} s = Dynamo {w['dynamo_s']:.2f} s + Inductor "
              f"{w['inductor_s']:.2f} s ({w['stats']['cache_hits']} cache hits; first call {w['first_call_s']:.2f} s)")
    for row in r["step_times"]:
        print(f"  {row['tokens']:5d} tokens: eager {row['eager_ms']:8.2f} ms, compiled {row['compiled_ms']:8.2f} ms "
              f"({row['speedup']:.2f}x, max rel diff {row['max_rel_diff']:.1e})")
    if r["host_overhead"]:
        o = r["host_overhead"]
        for name, us in o["us_per_call"].items():
            print(f"  tiny-llama, {o['tokens']} tokens, {name}: {us:.1f} us/call")
        print(f"  skipping Dynamo's frame evaluation and guards saves {o['saved_by_skipping_dynamo_us']:.1f} us/call")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
