"""Every engine step under Poisson arrivals, offline: what the scheduler packed and what it cost.

    python benchmarks/step_trace.py --model llama-3-8b --device cuda --rate 32 --max-step-seconds inf 0.016 --out $OUT
    python benchmarks/step_trace.py --rate 4 --num-prompts 8 --input-len 64 --output-len 8 --max-step-seconds 1   (CPU)

serving.py measures what a client sees through `kiln serve`; this drives LLMEngine.step() in one
process, with the same workload (--num-prompts random-token prompts of --input-len, exactly
--output-len tokens each, exponential arrival gaps of mean 1/rate, seeded), and records each
step as the scheduler learnt it (Scheduler.observe): its decodes, its prefill tokens, the prefill
tokens the time budget allowed, its seconds (on a GPU the device's), and the budget's estimates
after it (the fixed part of a step, the cost of a prefill token). One engine per
--max-step-seconds value (inf: no time budget), one after the other.

Prints a sample of the steps and the median step time by (decodes, prefill tokens) bucket;
writes --out/step_trace_<model>_<device>.json with every step, each a row of STEP_COLUMNS.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kiln import LLM, SamplingParams  # noqa: E402
from throughput import random_prompts  # noqa: E402


STEP_COLUMNS = ("t", "decodes", "prefill", "allowed", "seconds", "fixed_s", "per_token_s", "waiting")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a preset, .gguf or HF folder; default: the embedded SmolLM2")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rate", type=float, default=32.0, help="requests per second")
    p.add_argument("--num-prompts", type=int, default=400)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-step-seconds", type=float, nargs="+", default=[math.inf],
                   help="one engine per value; inf: no time budget")
    p.add_argument("--time-limit", type=float, default=120.0, help="seconds a run may take before it is cut short")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results")
    return p.parse_args()


def trace(args, budget: float) -> dict:
    llm = LLM(args.model, device=args.device, max_step_seconds=budget)
    engine, scheduler = llm.engine, llm.engine.scheduler
    steps: list[dict] = []
    observe = scheduler.observe

    def recording(batch, seconds):
        observe(batch, seconds)
        steps.append({"t": time.perf_counter() - start, "decodes": sum(n == 1 for n in batch.num_new_tokens),
                      "prefill": sum(n for n in batch.num_new_tokens if n > 1), "allowed": batch.prefill_allowance,
                      "seconds": seconds, "fixed_s": scheduler.fixed_seconds,
                      "per_token_s": scheduler.seconds_per_token, "waiting": len(scheduler.waiting)})

    scheduler.observe = recording
    prompts = random_prompts(args.num_prompts, args.input_len, engine.source.config.vocab_size, args.seed)
    gaps = random.Random(args.seed)
    arrivals = []
    t = 0.0
    for _ in prompts:
        arrivals.append(t)
        t += gaps.expovariate(args.rate)
    params = SamplingParams(max_tokens=args.output_len, temperature=1.0, ignore_eos=True)
    if args.device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    sent, cut_short = 0, False
    while True:
        now = time.perf_counter() - start
        while sent < len(prompts) and arrivals[sent] <= now:
            engine.add_request(prompts[sent], params)
            sent += 1
        if sent == len(prompts) and not engine.has_unfinished():
            break
        if now > args.time_limit:
            cut_short = True
            break
        if engine.has_unfinished():
            engine.step()
        else:
            time.sleep(min(0.001, max(arrivals[sent] - now, 0.0)))
    wall = time.perf_counter() - start
    llm.shutdown()
    del llm
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return {"max_step_seconds": None if math.isinf(budget) else budget, "wall_s": wall, "sent": sent,
            "cut_short": cut_short, "steps": steps}


def by_bucket(steps: list[dict]) -> list[dict]:
    """Median step seconds by (decodes // 16 * 16, prefill tokens // 128 * 128)."""
    groups = collections.defaultdict(list)
    for s in steps:
        groups[(s["decodes"] // 16 * 16, s["prefill"] // 128 * 128)].append(s["seconds"])
    return [{"decodes_from": d, "prefill_from": p, "steps": len(v), "median_s": sorted(v)[len(v) // 2]}
            for (d, p), v in sorted(groups.items())]


def _rounded(x):
    """Seconds to the tenth of a microsecond (the file is every step of a run)."""
    return round(x, 7) if isinstance(x, float) else x


def main() -> int:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for budget in args.max_step_seconds:
        run = trace(args, budget)
        run["buckets"] = by_bucket(run["steps"])
        runs.append(run)
        steps = run["steps"]
        print(f"max_step_seconds {budget}: {len(steps)} steps in {run['wall_s']:.1f} s"
              + (f", CUT SHORT at {args.time_limit:.0f} s with {run['sent']} sent" if run["cut_short"] else ""))
        for s in steps[::max(1, len(steps) // 25)]:
            print(f"  t {s['t']:6.2f} s  decodes {s['decodes']:3d}  prefill {s['prefill']:4d} (allowed "
                  f"{s['allowed']})  {s['seconds'] * 1e3:6.2f} ms  fixed {(s['fixed_s'] or 0) * 1e3:5.2f} ms  "
                  f"per token {(s['per_token_s'] or 0) * 1e6:6.2f} us  waiting {s['waiting']}")
        for b in run["buckets"]:
            print(f"  decodes {b['decodes_from']:3d}+  prefill {b['prefill_from']:4d}+: {b['steps']:4d} steps, "
                  f"median {b['median_s'] * 1e3:6.2f} ms")
        path = out / f"step_trace_{args.model or 'smollm2'}_{args.device}.json"
        path.write_text(json.dumps({
            "model": args.model or "smollm2", "device": args.device, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
            "workload": {k: getattr(args, k) for k in ("rate", "num_prompts", "input_len", "output_len", "seed")},
            "step_columns": STEP_COLUMNS,
            "runs": [{**r, "steps": [[_rounded(s[c]) for c in STEP_COLUMNS] for s in r["steps"]]} for r in runs]}))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
