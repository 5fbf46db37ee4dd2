"""CUDA graph modes: every mode checked against eager, then decode and prefill benchmarked
side by side with eager and with the floor measured in the same run (a benchmark, not a test).

    python benchmarks/cudagraphs.py --out $OUT                 (on the GPU)
    python benchmarks/cudagraphs.py --device cpu --check-model tiny-llama --bench-model tiny-llama \
        --batches 1 4 --prefill 2x64 --out /tmp/x                (the same code paths, graphs passed through)

Check: a tiny fp32 Llama generates greedily from 12 random prompts (continuous batching:
prefill chunks beside decodes) in every mode, twice (the second time after the graphs left
for first use are all captured); its tokens must equal eager's both times and its top-5 log
probabilities agree within --check-tol. Benchmark: a Llama-3-8B-shaped random bf16 model; per mode the
decode step at each batch size with ~128-token contexts (device time of forward + logits
from CUDA events, and the engine's whole step), capture time and graph memory, and the
prefill of 8 x 2048-token prompts. The floor of a decode step is the larger of its bytes
(every weight but the embedding table, plus the KV cache it reads) over the measured copy
bandwidth and its FLOPs over the measured bf16 matmul rate.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from kiln import LLM, SamplingParams
from kiln.compile.config import CompilationConfig
from kiln.config import DEFAULT_GPU_GRAPHS
from kiln.forward_context import set_forward_context

# name -> (-O level, compilation overrides)
MODES = {
    "eager": (0, {}),
    "O2 no graphs": (2, {"cudagraph_mode": "NONE"}),
    "O2 PIECEWISE": (2, {"cudagraph_mode": "PIECEWISE"}),
    "O2 FULL": (2, {"cudagraph_mode": "FULL"}),
    "O2 FULL_DECODE_ONLY": (2, {"cudagraph_mode": "FULL_DECODE_ONLY"}),
    "O2 FULL_AND_PIECEWISE": (2, {"cudagraph_mode": "FULL_AND_PIECEWISE"}),
    # Mixed-batch graphs before ready instead of on first use (the default).
    "O2 FULL_AND_PIECEWISE at start": (2, {"cudagraph_mode": "FULL_AND_PIECEWISE",
                                           "cudagraph_prefill": {"capture": "start"}}),
    # Inductor partitions at the split ops instead of the FX split; piecewise graphs per partition.
    "O2 partition PIECEWISE": (2, {"splitting_mode": "inductor_partition", "cudagraph_mode": "PIECEWISE"}),
    "O2 partition FULL_AND_PIECEWISE": (2, {"splitting_mode": "inductor_partition",
                                            "cudagraph_mode": "FULL_AND_PIECEWISE"}),
    "eager FULL_DECODE_ONLY": (0, {"cudagraph_mode": "FULL_DECODE_ONLY"}),
    "eager breakable": (0, {"cudagraph_prefill": {"mode": "breakable"}, "cudagraph_decode": {"mode": "breakable"}}),
    "static compile decode": (0, {"cudagraph_decode": {"mode": "full", "static_compile": True, "sizes": [1, 8]}}),
    "eager breakable + full": (0, {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_prefill": {"mode": "breakable"}}),
    "default": (0, DEFAULT_GPU_GRAPHS),
}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def build(model: str, device: str, dtype: str, mode: str, max_num_seqs: int, debug: bool = False,
          max_capture: int | None = None, **engine) -> LLM:
    level, overrides = MODES[mode]
    overrides = dict(overrides, cudagraph_debug=debug)
    if max_capture is not None:
        overrides["max_cudagraph_capture_size"] = max_capture
    return LLM(model, device=device, dtype=dtype, max_num_seqs=max_num_seqs, seed=0,
               compilation=CompilationConfig.level(level, **overrides), **engine)


# ---------------------------------------------------------------------------- check


def chosen_logprobs(outputs) -> list[list[dict[int, float]]]:
    """Per request, per generated token: the top log probabilities the engine reported. They
    come from the step's logits wherever those were computed (inside a decode graph too, padding
    rows aside), so they line up across modes where recorded compute_logits calls did not."""
    return [[{t: lp.logprob for t, lp in entry.items()} for entry in o.outputs[0].logprobs] for o in outputs]


def logprob_diff(a: list[list[dict[int, float]]], b: list[list[dict[int, float]]]) -> float:
    """The largest difference of a log probability both runs reported for the same token."""
    return max((abs(x[t] - y[t]) for ra, rb in zip(a, b) for x, y in zip(ra, rb) for t in x.keys() & y.keys()),
               default=0.0)


def check(args) -> dict:
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (int(n),), generator=gen).tolist()
               for n in torch.randint(5, 90, (12,), generator=gen)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5)
    results, reference = {}, None
    for mode in args.check_modes:
        try:
            results[mode] = check_mode(args, mode, prompts, params, reference)
        except Exception as e:  # one broken mode must not hide the others' results
            import traceback

            traceback.print_exc()
            results[mode] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        if reference is None:
            reference = results[mode].pop("_reference")
        print(f"check {mode:24s} {results[mode]}", flush=True)
        free(args.device)
    return results


def check_mode(args, mode, prompts, params, reference) -> dict:
    start = time.perf_counter()
    # Graphs check on every replay that their inputs sit where they were captured (--check-debug).
    # Buckets up to 64 tokens: the mixed steps (prompt chunks beside decodes) get graphs too.
    llm = build(args.check_model, args.device, "float32", mode, max_num_seqs=8, debug=args.check_debug,
                max_num_batched_tokens=64, num_kv_blocks=512, block_size=16, max_capture=64)
    outputs = llm.generate(prompts, params)
    tokens, logprobs = [o.token_ids for o in outputs], chosen_logprobs(outputs)
    graphs = dict(llm.engine.runner.cudagraphs.stats)
    # Then what the first generate left for first use, captured as an idle server would, and the
    # same prompts again through those graphs.
    while llm.engine.capture_deferred_graph():
        pass
    again = [o.token_ids for o in llm.generate(prompts, params)]
    if reference is None:
        entry = {"tokens_equal": True, "max_logprob_diff": 0.0, "_reference": (tokens, logprobs)}
    else:
        entry = {"tokens_equal": tokens == reference[0], "max_logprob_diff": logprob_diff(logprobs, reference[1])}
    entry["tokens_equal_again"] = again == tokens
    entry["ok"] = entry["tokens_equal"] and entry["tokens_equal_again"] and entry["max_logprob_diff"] <= args.check_tol
    entry.update(graphs_after_generate=graphs["num_graphs"], captured_on_first_use=graphs["captured_after_start"],
                 graphs=llm.engine.runner.cudagraphs.stats["num_graphs"], seconds=time.perf_counter() - start)
    return entry


# ---------------------------------------------------------------------------- floor


def measure_rates(device: str) -> dict:
    if device != "cuda":
        return {"copy_bytes_per_s": None, "bf16_flops_per_s": None}
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    sync(device)
    copy_bw = 2 * src.numel() * 20 / (start.elapsed_time(end) / 1e3)  # bytes read + written
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    sync(device)
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    sync(device)
    flops = 2 * 8192**3 * 20 / (start.elapsed_time(end) / 1e3)
    return {"copy_bytes_per_s": copy_bw, "bf16_flops_per_s": flops}


def step_floor(llm: LLM, batch: int, context: int, rates: dict) -> dict:
    model = llm.engine.runner.model
    embed = model.model.embed_tokens.weight
    weights = [p for p in model.parameters() if p is not embed or model.config.tie_word_embeddings]
    weight_bytes = sum(p.numel() * p.element_size() for p in weights)
    params = sum(p.numel() for p in weights)
    runner = llm.engine.runner
    kv_bytes = batch * context * runner.bytes_per_block // runner.block_size
    flops = 2 * params * batch
    out = {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "flops": flops}
    if rates["copy_bytes_per_s"]:
        out["floor_ms"] = 1e3 * max((weight_bytes + kv_bytes) / rates["copy_bytes_per_s"],
                                    flops / rates["bf16_flops_per_s"])
    return out


# ---------------------------------------------------------------------------- benchmark


GEMM_NAMES = ("gemm", "gemv", "cutlass", "nvjet", "sm90_xmma", "cublas", "splitk")


def kernel_profile(once, device: str, steps: int = 5) -> dict | None:
    """Where the device time of one forward goes: kernels by category, and the top ones."""
    if device != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            once()
        sync(device)
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    cats: dict[str, list[float]] = {}
    for e in events:
        name = e.key.lower()
        cat = ("gemm" if any(g in name for g in GEMM_NAMES) else "attention" if "attention" in name
               else "kv_write" if "write_kv" in name else "other")
        entry = cats.setdefault(cat, [0.0, 0])
        entry[0] += e.self_device_time_total / steps / 1e3
        entry[1] += e.count / steps
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:12]
    return {"kernel_ms": sum(c[0] for c in cats.values()), "kernels": sum(c[1] for c in cats.values()),
            "by_category": {k: {"ms": v[0], "count": v[1]} for k, v in cats.items()},
            "top": [{"name": e.key[:100], "ms": e.self_device_time_total / steps / 1e3, "count": e.count / steps}
                    for e in top]}


def decode(llm: LLM, batch: int, context: int, device: str, iters: int, profile_steps: bool = False) -> dict:
    engine = llm.engine
    vocab = engine.source.config.vocab_size
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    ids = [engine.add_request(torch.randint(0, vocab, (context,), generator=gen).tolist(), params)
           for _ in range(batch)]
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.seqs.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        engine.step()
    sync(device)
    step_ms = (time.perf_counter() - start) / iters * 1e3
    # Device time of forward + logits alone, on one prepared decode batch.
    runner = engine.runner
    scheduled = engine.scheduler.schedule()  # allocates the next slot; never executed, then aborted
    step = runner.prepare(scheduled)
    forward_ms = None
    with torch.inference_mode(), set_forward_context(step.attn_metadata, runner.kv_caches):
        def once():
            hidden, head = runner.cudagraphs.run(step.cudagraph, step.input_ids, step.positions)
            return head[0] if head is not None else runner.model.compute_logits(hidden[step.sample_rows])
        for _ in range(3):
            once()
        sync(device)
        if device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(iters):
                once()
            end.record()
            sync(device)
            forward_ms = begin.elapsed_time(end) / iters
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                once()
            forward_ms = (time.perf_counter() - t0) / iters * 1e3
        profile = kernel_profile(once, device) if profile_steps else None
    for request_id in ids:
        engine.abort_request(request_id)
    return {"batch": batch, "graph": f"{step.cudagraph.phase} {step.cudagraph.mode} bucket {step.cudagraph.bucket}",
            "forward_ms": forward_ms, "engine_step_ms": step_ms, "tokens_per_s": batch / step_ms * 1e3,
            "profile": profile}


def prefill(llm: LLM, prompts: int, length: int, device: str) -> dict:
    engine = llm.engine
    vocab = engine.source.config.vocab_size
    gen = torch.Generator().manual_seed(7)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for _ in range(prompts):
        engine.add_request(torch.randint(0, vocab, (length,), generator=gen).tolist(), params)
    sync(device)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    sync(device)
    seconds = time.perf_counter() - start
    return {"prompts": prompts, "length": length, "seconds": seconds, "tokens_per_s": prompts * length / seconds}


def bench(args, rates: dict, result: dict) -> dict:
    results = result["bench"] = {}
    prompts, length = (int(x) for x in args.prefill.split("x"))
    for mode in args.bench_modes:
        free(args.device)
        try:
            results[mode] = bench_mode(args, mode, rates, prompts, length)
        except Exception as e:  # one broken mode must not hide the others' results
            import traceback

            traceback.print_exc()
            results[mode] = {"error": f"{type(e).__name__}: {e}"}
        write(args, result)  # after every mode: a run cut short keeps what it measured
    return results


def write(args, result: dict) -> Path:
    out = Path(args.out) / f"cudagraphs_{args.bench_model}_{args.device}{'_' + args.tag if args.tag else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    return out


def bench_mode(args, mode, rates, prompts, length) -> dict:
    start = time.perf_counter()
    llm = build(args.bench_model, args.device, args.dtype, mode, max_num_seqs=max(args.batches),
                max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
                max_model_len=max(length + 64, args.context + 512))
    startup = time.perf_counter() - start
    runner = llm.engine.runner
    entry = {"startup_s": startup, "timeline": llm.engine.timeline.as_dict() if hasattr(
        llm.engine.timeline, "as_dict") else None, "graphs": dict(runner.cudagraphs.stats),
             "dispatch": runner.cudagraphs.dispatcher.describe(), "decode": []}
    for b in args.batches:
        try:
            r = decode(llm, b, args.context, args.device, args.iters, args.profile)
        except Exception as e:  # keep the other batch sizes
            import traceback

            traceback.print_exc()
            entry["decode"].append({"batch": b, "error": f"{type(e).__name__}: {e}"})
            continue
        r.update(step_floor(llm, b, args.context, rates))
        if r.get("floor_ms"):
            r["forward_vs_floor"] = r["forward_ms"] / r["floor_ms"]
        entry["decode"].append(r)
        print(f"{mode:24s} b{b:<4d} forward+logits {r['forward_ms']:.3f} ms "
              f"(floor {r.get('floor_ms', float('nan')):.3f}, x{r.get('forward_vs_floor', float('nan')):.3f}), "
              f"engine step {r['engine_step_ms']:.3f} ms, {r['tokens_per_s']:.0f} tok/s [{r['graph']}]", flush=True)
        if r["profile"]:
            prof = r["profile"]
            print(f"    kernels {prof['kernel_ms']:.3f} ms in {prof['kernels']:.0f} launches; " + ", ".join(
                f"{k} {v['ms']:.3f} ms x{v['count']:.0f}" for k, v in prof["by_category"].items()), flush=True)
            for k in prof["top"][:8]:
                print(f"      {k['ms']:.3f} ms x{k['count']:.0f} {k['name']}", flush=True)
    if not args.skip_prefill:
        try:
            p = prefill(llm, prompts, length, args.device)
        except Exception as e:  # keep the decode results
            import traceback

            traceback.print_exc()
            p = {"error": f"{type(e).__name__}: {e}"}
        if rates["bf16_flops_per_s"] and "error" not in p:
            weights = step_floor(llm, 1, 0, rates)["flops"] / 2
            p["flops_fraction"] = 2 * weights * p["tokens_per_s"] / rates["bf16_flops_per_s"]
        entry["prefill"] = p
        if "error" not in p:
            print(f"{mode:24s} prefill {prompts}x{length}: {p['tokens_per_s']:.0f} tok/s"
                  + (f", {p['flops_fraction']:.2f} of the matmul rate" if "flops_fraction" in p else ""), flush=True)
    if mode in args.recapture and runner.cudagraphs.pool is not None and runner.cudagraphs.dispatcher.captures():
        # Capture again in the same process: Triton's and Inductor's kernels are compiled now, as
        # on a restart with warm caches; the difference is kernel compilation during the first.
        from kiln.cudagraph import ForwardCudagraphs

        g = runner.cudagraphs
        again = ForwardCudagraphs(g.model, g.compiled, g.dispatcher, g.buffers, g.max_model_len, g.max_num_seqs,
                                  static_forward=g.static_forward, head=g.head)
        entry["graphs_recaptured"] = dict(again.capture_all(runner.kv_caches))
        runner.cudagraphs = again
    print(f"{mode:24s} graphs {entry['graphs']} recaptured {entry.get('graphs_recaptured')}", flush=True)
    return entry


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--check-model", default="tiny-llama")
    p.add_argument("--check-tol", type=float, default=1e-3)
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--check-debug", action="store_true", help="check input addresses on every replay")
    p.add_argument("--tag", default="", help="suffix of the JSON's name, for a run of some modes")
    p.add_argument("--check-modes", nargs="+", default=list(MODES))
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--bench-model", default="llama-3-8b")
    p.add_argument("--bench-modes", nargs="+", default=list(MODES))
    p.add_argument("--dtype", default=None)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--prefill", default="8x2048")
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument("--profile", action="store_true", help="kernel breakdown of each decode forward")
    p.add_argument("--recapture", nargs="*", default=[], help="modes to capture a second time (warm kernels)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int, default=6144)
    args = p.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    unknown = sorted((set(args.bench_modes) | set(args.check_modes)) - set(MODES))
    if unknown:
        p.error(f"unknown modes {unknown}; valid: {list(MODES)}")
    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "bench_model": args.bench_model, "context": args.context}
    if not args.skip_check:
        result["check"] = check(args)
        write(args, result)
    result["rates"] = measure_rates(args.device)
    print(f"rates {result['rates']}", flush=True)
    if not args.skip_bench:
        bench(args, result["rates"], result)
    print(f"wrote {write(args, result)}")
    if not args.skip_check and not all(r.get("ok", True) for r in result["check"].values()):
        raise SystemExit("a mode disagrees with eager (see check above)")


if __name__ == "__main__":
    main()
