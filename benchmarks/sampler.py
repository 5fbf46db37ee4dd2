r"""The sampler's time on one decode step's logits (a benchmark, not a test).

    python benchmarks/sampler.py --out $OUT                     (on the GPU)
    OMP_NUM_THREADS=1 python benchmarks/sampler.py --device cpu --vocab 49152 --batches 1 16

kiln.engine.sampler.sample on [batch, vocab] fp32 logits (Llama 3's vocabulary by default) with
greedy decoding and with chat-style sampling (temperature 0.8, top-k 50, top-p 0.95), top-p
alone (0.95, as OpenAI clients send it) and top-k alone (50); unseeded, and with every row
seeded (a host generator per row). Mean milliseconds per call, CUDA-event timed on the GPU.
Beside them the primitives a sampler is built from, on the same logits (sorts, topk, softmax,
cumsum, Exp(1) draws), to say where its time goes. On the GPU also the engine's sampling CUDA
graph (kiln.engine.sampling_graphs: host settings and seeds, then one replay) and its replay
alone (the GPU time a decode step spends sampling).
JSON to --out/sampler_<device>[_<tag>].json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kiln.engine.sampler import greedy_tokens, sample
from kiln.engine.sampling_graphs import SamplingGraphs
from kiln.engine.sampling_params import SamplingParams

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "chat (top-k 50, top-p 0.95)": dict(temperature=0.8, top_k=50, top_p=0.95),
    "top-p 0.95": dict(temperature=0.8, top_p=0.95),
    "top-k 50": dict(temperature=0.8, top_k=50),
}


def time_ms(fn, device: str, calls: int) -> float:
    for _ in range(3):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / calls
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - begin) / calls * 1e3


PRIMITIVES = {
    "sort": lambda x: x.sort(dim=-1, descending=True),
    "sort (stable)": lambda x: x.sort(dim=-1, descending=True, stable=True),
    "topk 50": lambda x: x.topk(50, dim=-1),
    "topk 1024": lambda x: x.topk(1024, dim=-1),
    "softmax": lambda x: x.softmax(dim=-1),
    "cumsum": lambda x: x.cumsum(dim=-1),
    "exponential_": lambda x: torch.empty_like(x).exponential_(),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    rows = []
    for batch in args.batches:
        logits = (torch.randn(batch, args.vocab, device=args.device) * 4).to(torch.bfloat16).float()
        for name, settings in SETTINGS.items():
            for seeded in (False, True) if name != "greedy" else (False,):
                params = [SamplingParams(**settings, seed=7 if seeded else None)] * batch
                gens = [torch.Generator().manual_seed(7) if seeded else None for _ in range(batch)]
                ms = time_ms(lambda: sample(logits, params, gens), args.device, args.calls)
                row = {"batch": batch, "sampling": name, "seeded": seeded, "ms": ms}
                if args.device == "cuda" and name != "greedy":
                    graphs = SamplingGraphs(batch, logits.device)
                    greedy = greedy_tokens(logits)
                    row["graph_ms"] = time_ms(lambda: graphs.sample(logits, greedy, params, gens), "cuda", args.calls)
                    (graph, _), = graphs.graphs.values()
                    row["replay_ms"] = time_ms(graph.replay, "cuda", args.calls)
                rows.append(row)
                print(f"b{batch:<4d} {name:28s} {'seeded' if seeded else '':7s} {ms:8.3f} ms" +
                      (f"   in a graph {row['graph_ms']:.3f} ms (replay {row['replay_ms']:.3f})"
                       if "graph_ms" in row else ""), flush=True)
        for name, fn in PRIMITIVES.items():
            ms = time_ms(lambda: fn(logits), args.device, args.calls)
            rows.append({"batch": batch, "primitive": name, "ms": ms})
            print(f"b{batch:<4d} {name:36s} {ms:8.3f} ms", flush=True)
    if args.out:
        tag = f"_{args.tag}" if args.tag else ""
        path = Path(args.out) / f"sampler_{args.device}{tag}.json"
        path.write_text(json.dumps({"device": args.device, "gpu": torch.cuda.get_device_name()
                                    if args.device == "cuda" else None, "torch": torch.__version__,
                                    "vocab": args.vocab, "calls": args.calls, "results": rows,
                                    "when": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
