"""Decode step time under tensor parallelism: TP=1 against TP=N, eager and compiled (a
benchmark, not a test): prints a table, writes JSON.

GPU (2 GPUs):  python benchmarks/tp_decode.py --out $OUT            # llama-3-8b bf16, TP 1 2, eager O2, batches 1 64
               python benchmarks/tp_decode.py --out $OUT --sp       # compiled runs with the sequence_parallel pass
CPU (a check): OMP_NUM_THREADS=1 python benchmarks/tp_decode.py --device cpu --model tiny-llama --out /tmp/tp

Each (TP size, mode) runs in a fresh process (its own CUDA context, NCCL group and memory),
so one that fails or hangs costs only its own numbers. In each, `batch` sequences of
`--context` random tokens are prefilled, then decoded; the median decode step (all of
LLMEngine.step: schedule, send the step to the other ranks, forward, sample) is timed with
kiln bench's decode_point. Compiled runs use -O2 with the batch sizes as exact compile
sizes (the sequence_parallel pass rewrites only exact sizes whose token count the TP size
divides); --compilation-config adds or overrides settings for them. JSON goes to
<out>/tp_decode_<model>_<device>.json after every run, so a timeout keeps what finished.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# eager: no compiler, no graphs; graphs: eager forward + full decode CUDA graphs (kiln's GPU
# default); O2: compiled pieces + FULL_AND_PIECEWISE graphs; O2+SP: -O2 with the sequence-
# parallel pass (whole-graph Inductor partitions) and full decode graphs, TP > 1 only.
MODES = ("eager", "graphs", "O2", "O2+SP")
# What --sp adds to the compiled runs: the pass rewrites across attention, so Inductor must
# see the whole graph and partition it itself; it matches the fused add + RMSNorm.
SEQUENCE_PARALLEL = {"passes": ["fuse_add_rms_norm", "sequence_parallel"], "splitting_mode": "inductor_partition"}


def compilation_for(mode: str, batches: list[int], sp: bool, overrides: dict):
    """The CompilationConfig of a run: -O0 for eager, else -O2 with the batches as exact sizes."""
    from kiln.compile.config import CompilationConfig, compilation_config_from_dict

    if mode == "eager":
        return CompilationConfig.level(0)
    if mode == "graphs":
        return CompilationConfig.level(0, cudagraph_mode="FULL_DECODE_ONLY")
    if mode == "O2+SP":
        sp, overrides = True, {"cudagraph_mode": "FULL_DECODE_ONLY", **overrides}
    settings = {"compile_sizes": sorted(set(batches)), **(SEQUENCE_PARALLEL if sp else {}), **overrides}
    return compilation_config_from_dict(settings, level=2)


def run_one(spec: dict) -> dict:
    """One engine (one TP size, one mode), every batch size: the result as a dict, also printed
    as the last line of stdout."""
    sys.path.insert(0, str(ROOT))  # run from a checkout, installed or not
    from dataclasses import asdict

    import torch

    from kiln import LLM
    from kiln.tools.bench import Workload, decode_point

    w = Workload(spec["model"], spec["device"], spec["dtype"], spec["batches"], context=spec["context"],
                 warmup_steps=5, timed_steps=spec["steps"], profiled_steps=2, modes=[spec["mode"]],
                 tensor_parallel_size=spec["tp"])
    compilation = compilation_for(spec["mode"], spec["batches"], spec["sp"], spec["overrides"])
    blocks_per_seq = -(-(w.context + w.max_tokens + 1) // 16)
    start = time.perf_counter()
    llm = LLM(w.model, device=w.device, dtype=w.dtype, max_num_seqs=max(w.batches),
              max_num_batched_tokens=max(2048, max(w.batches)), max_model_len=w.context + w.max_tokens + 16,
              num_kv_blocks=max(w.batches) * blocks_per_seq + 8, compilation=compilation,
              tensor_parallel_size=w.tensor_parallel_size)
    startup_s = time.perf_counter() - start
    try:
        points = []
        for batch in w.batches:
            points.append(asdict(decode_point(llm.engine, batch, w)))
            print(f"  TP={w.tensor_parallel_size} {spec['mode']}, batch {batch}: {points[-1]['step_ms']:.2f} ms "
                  f"a decode step", file=sys.stderr, flush=True)
        result = {"startup_s": startup_s, "points": points, "compilation": asdict(compilation),
                  "describe": llm.engine.runner.compiled.describe(), "compile_stats": llm.engine.runner.compiled.stats,
                  "torch": torch.__version__,
                  "device_name": torch.cuda.get_device_name() if w.device == "cuda" else "cpu"}
        print(json.dumps(result), flush=True)  # before the shutdown, which may hang
        return result
    finally:
        llm.shutdown()


def run_in_child(spec: dict, timeout_s: float) -> dict:
    cmd = [sys.executable, __file__, "--run-one", json.dumps(spec)]
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        # The child prints its result before it shuts the workers down; on 2xH200 that shutdown
        # has hung (NCCL teardown), which must not throw away what was measured.
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        lines = out.strip().splitlines()
        if lines and lines[-1].startswith("{"):
            return {**json.loads(lines[-1]), "shutdown": f"did not exit within {timeout_s:.0f} s"}
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": f"exit code {done.returncode} (its stderr is above)"}
    return json.loads(lines[-1])


def floors(args, batches_lens: dict[int, float]) -> dict:
    """kiln bench's floor (bytes at copy speed or FLOPs at matmul speed) per TP size and batch."""
    import torch

    from kiln.loader import load_source
    from kiln.tools.bench import Floor, floor_for, measure_copy, measure_matmul
    from kiln.tools.traffic import decode_weight_bytes

    dtype = getattr(torch, args.dtype)
    cfg = load_source(args.model).config
    elem = torch.empty(0, dtype=dtype).element_size()
    floor = Floor(measure_copy(args.device, dtype), measure_matmul(args.device, dtype), decode_weight_bytes(cfg, elem))
    return {f"tp{tp}": [floor_for(cfg, elem, floor, b, batches_lens.get(b, args.context), tp) for b in args.batches]
            for tp in args.tp}


def render(result: dict) -> str:
    lines = [f"{'TP':>3} {'mode':<6} {'batch':>5} {'step ms':>9} {'vs TP=1':>8} {'floor ms':>9} {'start-up s':>11}"]
    one = {(r["mode"], p["batch"]): p["step_ms"] for r in result["runs"] if r["tp"] == 1 for p in r.get("points", [])}
    floor = {(int(k[2:]), f["batch"]): f["step_ms"] for k, fs in result.get("floor", {}).items() for f in fs}
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"{r['tp']:>3} {r['mode']:<6} failed: {r['error']}")
            continue
        for p in r["points"]:
            base = one.get((r["mode"], p["batch"]))
            speedup = f"{base / p['step_ms']:.2f}x" if base else "-"
            fl = floor.get((r["tp"], p["batch"]))
            lines.append(f"{r['tp']:>3} {r['mode']:<6} {p['batch']:>5} {p['step_ms']:>9.2f} {speedup:>8} "
                         f"{(f'{fl:.2f}' if fl else '-'):>9} {r['startup_s']:>11.1f}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="folder for tp_decode_<model>_<device>.json (required)")
    p.add_argument("--model", default="llama-3-8b", help="a preset (random weights), .gguf or HF folder")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda if there is one")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes (default 1 2)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per batch (default 20 cuda, 10 cpu)")
    p.add_argument("--sp", action="store_true",
                   help=f"compiled runs with the sequence-parallel pass ({json.dumps(SEQUENCE_PARALLEL)})")
    p.add_argument("--compilation-config", default="{}",
                   help="JSON of compilation settings over -O2 for the compiled runs, e.g. '{\"cudagraph_mode\": \"NONE\"}'")
    p.add_argument("--timeout", type=float, default=900, help="seconds one (TP size, mode) run may take")
    p.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run_one is not None:
        run_one(json.loads(args.run_one))
        return 0
    if args.out is None:
        p.error("--out is required: the folder the JSON goes to")

    sys.path.insert(0, str(ROOT))
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(args.dtype, args.dtype) or (
        "bfloat16" if args.device == "cuda" else "float32")
    args.steps = args.steps or (20 if args.device == "cuda" else 10)
    overrides = json.loads(args.compilation_config)
    if not isinstance(overrides, dict):
        p.error(f"--compilation-config takes a JSON object, got {args.compilation_config!r}")
    # Fail here, not in every child, on settings kiln does not take (e.g. --sp before the
    # sequence_parallel pass exists).
    for mode in args.modes:
        try:
            compilation_for(mode, args.batches, args.sp, overrides)
        except ValueError as e:
            p.error(str(e))
    if args.device == "cuda" and max(args.tp) > torch.cuda.device_count():
        p.error(f"--tp {max(args.tp)} needs {max(args.tp)} GPUs, torch sees {torch.cuda.device_count()}")
    # NVLink multicast (NVLS) stays off on the lent machines; the children's NCCL reads this.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"tp_decode_{Path(args.model).name}_{args.device}.json"
    result = {"model": args.model, "device": args.device, "dtype": args.dtype, "context": args.context,
              "batches": args.batches, "steps": args.steps, "sequence_parallel": args.sp,
              "compilation_overrides": overrides, "date": time.strftime("%Y-%m-%d %H:%M"), "runs": []}
    for tp in args.tp:
        for mode in args.modes:
            if mode == "O2+SP" and tp == 1:
                continue  # nothing to scatter on one rank
            print(f"TP={tp} {mode}:", flush=True)
            spec = {"model": args.model, "device": args.device, "dtype": args.dtype, "batches": args.batches,
                    "context": args.context, "steps": args.steps, "mode": mode, "tp": tp, "sp": args.sp and mode == "O2",
                    "overrides": overrides if mode.startswith("O2") else {}}
            result["runs"].append({"tp": tp, "mode": mode, **run_in_child(spec, args.timeout)})
            path.write_text(json.dumps(result, indent=2))
    lens = {p["batch"]: p["mean_seq_len"] for r in result["runs"] for p in r.get("points", [])}
    result["floor"] = floors(args, lens)
    path.write_text(json.dumps(result, indent=2))
    print(render(result))
    print(f"wrote {path}")
    return 0 if all("error" not in r for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
