r"""Where a decode step's time goes, eager beside compiled (a benchmark, not a test).

    python benchmarks/profile_step.py --model llama-3-8b --device cuda --out $OUT
    python benchmarks/profile_step.py --modes default compiled\ -O2 --batch 64 256 --context 128 --top 20 --out $OUT

For each mode: host wall time per decode step, device kernel time and kernel launches per
step from a torch.profiler trace, the top kernels, and prefill time for one full batch.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kiln import LLM, SamplingParams
from kiln.compile.config import CompilationConfig

# default: no compile flag (on a GPU the eager forward with full decode graphs, what kiln serve runs).
MODES = {"default": dict(level=None), "default sample-in-graph": dict(level=None, sample_in_graph=True),
         "eager -O0": dict(level=0), "compiled -O2": dict(level=2),
         "compiled -O2, no size asserts": dict(level=2, size_asserts=False)}
# --sampled: what a chat client typically asks for (decode_vs_reference.py's CHAT_SAMPLING).
CHAT_SAMPLING = dict(temperature=0.8, top_k=50, top_p=0.95)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def idle_gaps(prof, steps: int = 5, top: int = 8) -> dict:
    """The GPU's idle time between consecutive device events (kernels, copies) per step, and
    the largest gaps summed by the pair of events around them: whether time between kernels
    is the host's (gaps at the step's edges) or inside the graph."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    pairs: dict[tuple[str, str], list[float]] = {}
    idle = 0.0
    for (_, end, before), (start, _, after) in zip(spans, spans[1:]):
        gap = start - end
        if gap > 0:
            idle += gap
            pairs.setdefault((before[:60], after[:60]), []).append(gap)
    worst = sorted(pairs.items(), key=lambda item: -sum(item[1]))[:top]
    return {"idle_ms_per_step": idle / steps / 1e3,
            "idle_gaps": [{"before": b, "after": a, "ms_per_step": sum(g) / steps / 1e3,
                           "count_per_step": len(g) / steps, "max_us": max(g)} for (b, a), g in worst]}


def run_mode(model, device, dtype, batch, context, level, size_asserts=True, top=8, sampling=None,
             sample_in_graph=None) -> dict:
    import torch._inductor.config as inductor_config

    inductor_config.size_asserts = size_asserts
    torch._dynamo.reset()
    # Every sequence must outlive the prefill, the 20 timed steps and the 5 profiled ones: one
    # that finished early would shrink the profiled batch (it did at 256 with 40 tokens).
    max_tokens = -(-batch * context // 2048) + 41
    llm = LLM(model, device=device, dtype=dtype, max_num_seqs=batch, max_num_batched_tokens=2048,
              max_model_len=context + max_tokens, num_kv_blocks=max(2048, batch * -(-(context + max_tokens) // 16)),
              compilation=None if level is None else CompilationConfig.level(level), sample_in_graph=sample_in_graph)
    engine = llm.engine
    vocab = engine.source.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **(sampling or dict(temperature=0)))
    for _ in range(batch):
        engine.add_request(torch.randint(0, vocab, (context,), generator=gen).tolist(), params)
    sync(device)
    start = time.perf_counter()
    steps = 0
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.seqs.values()):
        engine.step()
        steps += 1
    sync(device)
    prefill_s = time.perf_counter() - start
    for _ in range(10):  # decode warm-up
        engine.step()
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        engine.step()
    sync(device)
    step_ms = (time.perf_counter() - start) / 10 * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(5):
            engine.step()
        sync(device)
    running = len(engine.seqs)
    gaps = idle_gaps(prof) if device == "cuda" else {}
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_us = sum(e.self_device_time_total for e in events) / 5
    launches = sum(e.count for e in events) / 5
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:top]
    llm.shutdown()  # its memory back now: a built engine's heap is frozen, out of gc.collect()'s reach
    return {"prefill_tokens": batch * context, "prefill_steps": steps, "prefill_s": prefill_s,
            "decode_step_ms": step_ms, "device_kernel_ms_per_step": kernel_us / 1e3,
            "kernels_per_step": launches, "running_after_profile": running, **gaps,
            "top_kernels": [{"name": e.key[:90], "ms_per_step": e.self_device_time_total / 5e3,
                             "count_per_step": e.count / 5} for e in top]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, nargs="+", default=[8])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--top", type=int, default=8, help="kernels listed per mode")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--sampled", action="store_true", help=f"sequences sample with {CHAT_SAMPLING} instead of greedy")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    a = p.parse_args()
    dtype = "bfloat16" if a.device == "cuda" else "float32"
    result = {"model": a.model, "device": a.device, "batch": a.batch, "context": a.context,
              "sampling": CHAT_SAMPLING if a.sampled else None,
              "torch": torch.__version__, "modes": {}}
    for name, batch in ((n, b) for n in a.modes for b in a.batch):
        r = run_mode(a.model, a.device, dtype, batch, a.context, top=a.top,
                     sampling=CHAT_SAMPLING if a.sampled else None, **MODES[name])
        result["modes"][name if len(a.batch) == 1 else f"{name}, batch {batch}"] = r
        print(f"{name}, batch {batch}: prefill {r['prefill_tokens']} tokens in {r['prefill_s'] * 1e3:.0f} ms; decode step "
              f"{r['decode_step_ms']:.2f} ms wall, {r['device_kernel_ms_per_step']:.2f} ms of kernels, "
              f"{r['kernels_per_step']:.0f} launches", flush=True)
        if "idle_ms_per_step" in r:
            print(f"    GPU idle between device events: {r['idle_ms_per_step']:.3f} ms a step; largest:")
            for g in r["idle_gaps"]:
                print(f"    {g['ms_per_step']:7.3f} ms  x{g['count_per_step']:5.1f}  (max {g['max_us']:.0f} us)  "
                      f"{g['before']} -> {g['after']}")
        for k in r["top_kernels"]:
            print(f"    {k['ms_per_step']:7.3f} ms  x{k['count_per_step']:5.0f}  {k['name']}")
    suffix = ("" if a.batch == [8] else "_b" + "_".join(map(str, a.batch))) + ("_sampled" if a.sampled else "")
    out = Path(a.out) / f"profile_step_{a.model}_{a.device}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
