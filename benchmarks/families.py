"""Every model family's preset on the GPU (#15's must-show): the bf16 decode step at batch 1 and
64 in the default mode beside its floor, and greedy tokens of the compiled mode (-O2) and of the
default mode (CUDA graphs) against eager (-O0, no graphs) and of -O2 against the default mode, on
the same random weights.

    python benchmarks/families.py --out $OUT                          (the H200, about 5 minutes)
    OMP_NUM_THREADS=1 python benchmarks/families.py --device cpu --presets tiny-llama --batches 1 4 \
        --steps 3 --warmup 1 --out /tmp/families                       (a smoke run)

The floor is kiln.tools.bench's (every weight read but the embedding gather, the KV cache, at
the measured copy rate; FLOPs at the measured matmul rate; of a mixture of experts only the
experts the batch is expected to reach). Each family's step/floor ratio is also given relative
to llama-3-8b's, measured in the same run (targets: dense families within 1.15x of it; MoE at
batch 64 within 2x of its own floor).
JSON to --out/families_<device>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from benchmarks.decode_vs_reference import measure_batch
from kiln import LLM, SamplingParams
from kiln.loader import load_source
from kiln.tools.bench import Floor, floor_for, measure_copy, measure_matmul
from kiln.tools.traffic import decode_weight_bytes

PRESETS = ["llama-3-8b", "mistral-7b", "qwen2.5-7b", "qwen3-8b", "gemma-2-9b", "mixtral-8x7b", "qwen3-30b-a3b"]


def release_memory(device: str) -> None:
    """Call after the caller dropped its last name of an engine: a function given the engine
    cannot free it, its caller's name keeps it alive (Mixtral's check ran out of memory so)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def greedy(llm: LLM, args) -> tuple[list[list[int]], list[dict]]:
    """Greedy tokens of 4 random prompts, and each prompt's first-token top-5 log probabilities."""
    gen = torch.Generator().manual_seed(3)
    vocab = llm.engine.source.config.vocab_size
    prompts = [torch.randint(0, vocab, (20 + 7 * i,), generator=gen).tolist() for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, logprobs=5),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs[0] for o in outs]


def sampled_in_graph_vs_eager(llm: LLM, args) -> str:
    """Seeded chat sampling of 4 random prompts with the decode steps' sampling CUDA graphs, then
    with the eager sampler (the runner's graphs switched off), in one engine: the same forward
    graphs, so the logits are the same bits and the tokens must be equal."""
    gen = torch.Generator().manual_seed(4)
    vocab = llm.engine.source.config.vocab_size
    prompts = [torch.randint(0, vocab, (20 + 7 * i,), generator=gen).tolist() for i in range(4)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.8, top_k=50, top_p=0.95, seed=11, ignore_eos=True)
    runner, runs = llm.engine.runner, []
    graphs = runner.sampling_graphs
    for use in (graphs, None):
        runner.sampling_graphs = use
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    runner.sampling_graphs = graphs
    same = sum(a == b for a, b in zip(*runs))
    return f"{'equal' if same == len(prompts) else 'DIFFER'} ({same}/{len(prompts)} requests; {len(graphs.graphs)} graphs)"


def logprob_diff(a: list[dict], b: list[dict]) -> float:
    """Largest difference of a first token's log probability, over the tokens both top-5s name."""
    return max(abs(x[t].logprob - y[t].logprob) for x, y in zip(a, b) for t in x.keys() & y.keys())


# The token checks' engines, alike but for the mode. A decode graph's attention splits each context
# into as many ranges as max_model_len and the batch call for, eager's as the context's length
# does: in bf16 the merge of the ranges rounds differently (Gemma 2's wide heads split from 64 keys).
TOKEN_ENGINES = {"eager": 0, "default": None, "O2": 2}  # name -> compilation_config (None: the default mode)


def greedy_tokens(preset: str, args, mode: str) -> tuple[tuple[list[list[int]], list[dict]], float]:
    """greedy() of an engine in a TOKEN_ENGINES mode, and its start-up seconds."""
    if args.device == "cuda":  # what the engines before this one left (Mixtral's check ran out of memory here)
        print(f"{preset:12s} {mode} engine: {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated before "
              f"its start", flush=True)
    start = time.perf_counter()
    llm = LLM(preset, device=args.device, dtype=args.dtype, max_num_seqs=8, max_model_len=256, num_kv_blocks=128,
              compilation_config=TOKEN_ENGINES[mode], sample_in_graph=mode == "default" and args.device == "cuda")
    startup = time.perf_counter() - start
    tokens = greedy(llm, args)
    if mode == "default" and llm.engine.runner.sampling_graphs is not None:
        print(f"{preset:12s} seeded sampled tokens, decode sampling in graphs against the eager sampler: "
              f"{sampled_in_graph_vs_eager(llm, args)}", flush=True)
    llm.shutdown()
    del llm
    release_memory(args.device)
    return tokens, startup


def run_preset(preset: str, args, rates: tuple[float, float], out: dict) -> None:
    """Fills `out` as it measures, so a preset that fails later keeps its numbers."""
    cfg = load_source(preset).config
    elem = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    floor = Floor(rates[0], rates[1], decode_weight_bytes(cfg, elem))
    blocks = max(args.batches) * -(-(args.context + 2 * (args.warmup + args.steps) + 32) // 16) + 16
    start = time.perf_counter()
    llm = LLM(preset, device=args.device, dtype=args.dtype, max_num_seqs=max(args.batches),
              max_num_batched_tokens=2048, max_model_len=args.context + 2 * (args.warmup + args.steps) + 32,
              num_kv_blocks=blocks)
    out.update({"architecture": cfg.architecture, "default_startup_s": time.perf_counter() - start,
                "weight_bytes": floor.weight_bytes, "points": []})
    for batch in args.batches:
        point = measure_batch(llm, batch, args)
        point["floor_ms"] = floor_for(cfg, elem, floor, batch, point["mean_context"])["step_ms"]
        point["vs_floor"] = point["engine_step_ms"] / point["floor_ms"]
        out["points"].append(point)
        print(f"{preset:12s} b{batch:<4d} engine step {point['engine_step_ms']:6.2f} ms, floor "
              f"{point['floor_ms']:6.2f} ms ({point['vs_floor']:.2f}x)", flush=True)
    llm.shutdown()
    del llm
    release_memory(args.device)
    tokens = {}
    for mode in TOKEN_ENGINES:
        tokens[mode], out[f"{mode}_startup_s"] = greedy_tokens(preset, args, mode)
    # -O2 against the default mode isolates the compiler: both decode in graphs.
    for mode, base in (("default", "eager"), ("O2", "eager"), ("O2", "default")):
        ours, theirs = tokens[mode], tokens[base]
        out[f"{mode}_tokens_equal_{base}"] = ours[0] == theirs[0]
        out[f"{mode}_requests_equal_{base}"] = sum(a == b for a, b in zip(ours[0], theirs[0])) / len(theirs[0])
        out[f"{mode}_first_logprob_max_diff_{base}"] = logprob_diff(ours[1], theirs[1])
        print(f"{preset:12s} tokens of {mode} against {base}: "
              f"{'equal' if out[f'{mode}_tokens_equal_{base}'] else 'DIFFER'} "
              f"({out[f'{mode}_requests_equal_{base}']:.0%} of requests; first-token log probabilities within "
              f"{out[f'{mode}_first_logprob_max_diff_{base}']:.2e})", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--presets", nargs="+", default=PRESETS)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt for the token checks")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    dtype = getattr(torch, args.dtype)
    rates = (measure_copy(args.device, dtype), measure_matmul(args.device, dtype))
    results = []
    for preset in args.presets:
        results.append({"preset": preset})
        try:
            run_preset(preset, args, rates, results[-1])
        except Exception as e:  # one family that fails must not lose the others' numbers
            results[-1]["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
            print(f"{preset}: {results[-1]['error']}", flush=True)
        if "error" in results[-1]:  # out of the except clause, whose traceback's frames held the engines
            release_memory(args.device)
        write_report(results, rates, args)  # after each preset: a run cut short keeps what it measured
    print(f"\n{'preset':12s} {'batch':>5s} {'step ms':>8s} {'floor ms':>8s} {'vs floor':>8s} {'vs llama':>8s}  tokens")
    for r in results:
        for point in r.get("points", []):
            print(f"{r['preset']:12s} {point['batch']:>5d} {point['engine_step_ms']:>8.2f} {point['floor_ms']:>8.2f} "
                  f"{point['vs_floor']:>7.2f}x {point.get('floor_ratio_vs_llama', float('nan')):>7.2f}x  "
                  f"default {r.get('default_tokens_equal_eager')}, O2 {r.get('O2_tokens_equal_eager')}, "
                  f"O2=default {r.get('O2_tokens_equal_default')}")
    print(f"wrote {Path(args.out) / f'families_{args.device}.json'}")


def write_report(results: list[dict], rates: tuple[float, float], args) -> None:
    base = next((r for r in results if r["preset"] == "llama-3-8b" and "error" not in r), None)
    if base is not None:
        for r in results:
            for point, ref in zip(r.get("points", []), base["points"]):
                point["floor_ratio_vs_llama"] = point["vs_floor"] / ref["vs_floor"]
    report = {"device": args.device, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              "torch": torch.__version__, "dtype": args.dtype, "copy_bytes_per_s": rates[0],
              "matmul_flops_per_s": rates[1], "context": args.context, "results": results,
              "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = Path(args.out) / f"families_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
