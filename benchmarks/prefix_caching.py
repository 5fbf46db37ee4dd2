"""Automatic prefix caching: requests that share a long system prompt, with caching off and on,
side by side in one run. Time to first token per request (from its arrival to its first
token, the engine's own RequestMetrics), p50 and p99, and the ratio off/on.

    python benchmarks/prefix_caching.py --model llama-3-8b --device cuda --out $OUT   (GPU: 64 requests)
    OMP_NUM_THREADS=1 python benchmarks/prefix_caching.py --model smollm2 --device cpu --requests 16 --out DIR

All requests arrive at once (a burst, cold cache): the first computes the system prompt and the
others find it cached from the next step on. Token ids are random (the work does not depend on
the text); every request produces --output-tokens tokens. Before the timed burst, each engine
runs a small one with another system prompt, so that kernel JIT and first-call costs are not
timed (they fell on the first prefix-hit step and made it ~300 ms slower on the H200).

Outputs are compared off against on: the share of requests whose tokens are equal, and the
largest difference of the first token's log probabilities (top 5). In bf16 a cached prefix's
KV was computed in another batch than the one that would recompute it (GEMM reductions depend
on the batch), so random weights' near-ties can flip a token; the log-probability difference
says whether the outputs are the same up to that noise.

--step-times records every step of the timed burst (its sequences, tokens and seconds, the device
synchronised after each) and prints the Python functions that took longest in the slowest step
(cProfile): on the H200 the prefix-hit step of 64 sequences took ~360-590 ms against ~50 ms for
a step of 2 sequences and the same 2,048 tokens, with only ~45 ms of it in kernels and torch ops.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from kiln import LLM, SamplingParams
from kiln.ops.cpu import extension
from kiln.engine.block_manager import PrefixCacheStats


def burst(gen: torch.Generator, requests: int, prefix_tokens: int, tail_tokens: int) -> list[list[int]]:
    system = torch.randint(100, 20000, (prefix_tokens,), generator=gen).tolist()
    return [system + torch.randint(100, 20000, (tail_tokens,), generator=gen).tolist() for _ in range(requests)]


def record_steps(llm: LLM, device: str) -> dict:
    """Time each step (synchronous scheduling, the device synchronised around it) and keep a
    cProfile of the slowest; {"steps": [...], "slowest_profile": text} fills as the burst runs."""
    import cProfile
    import io
    import pstats

    engine, record = llm.engine, {"steps": [], "slowest_profile": None}
    engine.async_scheduling = False
    execute, slowest = engine.runner.execute, [0.0]

    def timed(batch):
        if device == "cuda":
            torch.cuda.synchronize()
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        sampled = execute(batch)
        if device == "cuda":
            torch.cuda.synchronize()
        profile.disable()
        seconds = time.perf_counter() - start
        record["steps"].append({"seqs": len(batch.seqs), "tokens": batch.num_tokens, "seconds": seconds})
        if seconds > slowest[0]:
            slowest[0] = seconds
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
            record["slowest_profile"] = text.getvalue()
        return sampled

    engine.runner.execute = timed
    return record


def run(args, caching: bool) -> dict:
    llm = LLM(args.model, device=args.device, dtype=args.dtype, enable_prefix_caching=caching, seed=0,
              max_num_seqs=args.requests, max_model_len=args.prefix_tokens + args.tail_tokens + args.output_tokens + 16,
              load_format="dummy" if args.dummy else "auto")
    gen = torch.Generator().manual_seed(0)
    prompts = burst(gen, args.requests, args.prefix_tokens, args.tail_tokens)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True, logprobs=5)
    llm.generate(burst(gen, 4, args.prefix_tokens, args.tail_tokens), params, use_tqdm=False)
    llm.engine.scheduler.block_manager.stats = PrefixCacheStats()
    steps = record_steps(llm, args.device) if args.step_times else None  # synchronous scheduling then
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    ttft = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)
    stats = llm.engine.scheduler.block_manager.stats
    result = {"caching": caching, "requests": args.requests, "wall_s": wall,
              "ttft_p50_s": statistics.median(ttft), "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
              "ttft_mean_s": statistics.fmean(ttft), "prefix_cache_queries": stats.queries,
              "prefix_cache_hits": stats.hits, "hit_rate": stats.hit_rate,
              "steps": steps["steps"] if steps else None,
              "tokens": [o.outputs[0].token_ids for o in outs],
              "first_logprobs": [o.outputs[0].logprobs[0] for o in outs]}
    if steps:
        for step in steps["steps"]:
            print(f"  caching {'on ' if caching else 'off'} step: {step['seqs']:3d} sequences, {step['tokens']:5d} "
                  f"tokens, {step['seconds'] * 1e3:8.1f} ms", flush=True)
        print(steps["slowest_profile"], flush=True)
    llm.shutdown()
    del llm
    gc.collect()  # the step recorder's closure and the engine reference each other
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--tail-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--dummy", action="store_true", help="random weights (a preset without a checkpoint)")
    p.add_argument("--step-times", action="store_true",
                   help="time every step of the timed bursts (synchronous scheduling) and profile the slowest")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    if args.device == "cpu":
        extension.build()  # the C++ attention a deployment has (kiln prewarm builds it)
    off, on = run(args, caching=False), run(args, caching=True)
    off_tokens, on_tokens = off.pop("tokens"), on.pop("tokens")
    tokens_equal = sum(a == b for a, b in zip(off_tokens, on_tokens)) / len(off_tokens)
    # Over the tokens both runs list among the first position's top ones.
    logprob_diff = max(abs(a[t].logprob - b[t].logprob)
                       for a, b in zip(off.pop("first_logprobs"), on.pop("first_logprobs")) for t in a.keys() & b.keys())
    result = {"model": args.model, "device": args.device,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "torch": torch.__version__,
              "workload": {"requests": args.requests, "prefix_tokens": args.prefix_tokens,
                           "tail_tokens": args.tail_tokens, "output_tokens": args.output_tokens},
              "off": off, "on": on, "ttft_p50_ratio": off["ttft_p50_s"] / on["ttft_p50_s"],
              "wall_ratio": off["wall_s"] / on["wall_s"], "tokens_equal_fraction": tokens_equal,
              "first_token_logprob_max_diff": logprob_diff, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    for r in (off, on):
        print(f"caching {'on ' if r['caching'] else 'off'}: TTFT p50 {r['ttft_p50_s'] * 1000:8.1f} ms, "
              f"p99 {r['ttft_p99_s'] * 1000:8.1f} ms, all done in {r['wall_s']:.2f} s, "
              f"hit rate {r['hit_rate']:.2f}", flush=True)
    print(f"TTFT p50 {result['ttft_p50_ratio']:.1f}x lower with caching; requests with equal tokens "
          f"{tokens_equal:.0%}, first token's log probabilities differ by at most {logprob_diff:.2e}")
    out = Path(args.out) / f"prefix_caching_{args.model}_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
