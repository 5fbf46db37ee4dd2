"""The mixed-batch (prefill) phase's bucket ladder: what a coarser one saves at start-up and what
its padding costs a step, side by side in one process (a benchmark, not a test): prints, writes JSON.

    python benchmarks/prefill_ladder.py --out $OUT                  (GPU: llama-3-8b, -O2)

Two ladders for the mixed-batch phase's piecewise graphs: `fine` (the decode ladder: 1, 2, 4,
then steps of 8) and `coarse` (kiln's default, kiln.cudagraph.ladder.mixed_batch_ladder). Each
engine starts twice, alternating (fine, coarse, fine, coarse: the first start of each compiles,
the second is a warm restart), and the warm one is timed: its CUDA-graph phase (capture_s, graphs)
and, per prompt length n, the median time of generate() of one n-token prompt and one output
token, i.e. one mixed step of n tokens padded to the ladder's bucket plus the host work around
it (vs_fine: coarse over fine at each n). JSON: --out/prefill_ladder_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kiln import LLM, SamplingParams
from kiln.compile.config import CompilationConfig
from kiln.cudagraph.ladder import capture_ladder

LENGTHS = [3, 9, 17, 24, 33, 40, 49, 57, 65, 72, 81, 90, 97, 104, 113, 120, 128]


def start(args, ladder: str) -> tuple[LLM, dict]:
    top = 2 * args.max_num_seqs
    prefill = {"sizes": capture_ladder(top)} if ladder == "fine" else {}
    llm = LLM(args.model, device=args.device, max_num_seqs=args.max_num_seqs, seed=0,
              compilation=CompilationConfig.level(2, cudagraph_prefill=prefill))
    runner = llm.engine.runner
    phases = llm.engine.timeline.as_dict()["phases_s"]
    pool = runner.cudagraphs.pool
    return llm, {"engine_ready_s": llm.engine.timeline.ready_seconds, "capture_s": phases.get("cudagraphs", 0.0),
                 "graphs": pool.num_graphs if pool is not None else 0,
                 "prefill_buckets": runner.cudagraphs.dispatcher.prefill.buckets.sizes}


def time_prompts(llm: LLM, args) -> dict:
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    table = llm.engine.runner.cudagraphs.dispatcher.prefill.buckets
    vocab = llm.engine.source.config.vocab_size
    out = {}
    for n in LENGTHS:
        prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for _ in range(args.reps + 2)]
        times = []
        for i, prompt in enumerate(prompts):
            begin = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            if i >= 2:  # the first two warm this length's path
                times.append(time.perf_counter() - begin)
        out[n] = {"bucket": table.bucket_for(n), "median_ms": 1e3 * statistics.median(times),
                  "min_ms": 1e3 * min(times)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=".")
    args = p.parse_args()
    report = {"model": args.model, "device": args.device, "max_num_seqs": args.max_num_seqs, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "starts": [], "ladders": {}}
    for rep in range(2):
        for ladder in ("fine", "coarse"):
            llm, started = start(args, ladder)
            report["starts"].append({"ladder": ladder, "rep": rep, **started})
            print(f"{ladder:6s} start {rep}: ready {started['engine_ready_s']:.2f} s, CUDA graphs "
                  f"{started['capture_s']:.2f} s ({started['graphs']} graphs, prefill buckets "
                  f"{started['prefill_buckets']})", flush=True)
            if rep == 1:
                report["ladders"][ladder] = {**started, "prompts": time_prompts(llm, args)}
            llm.shutdown()
    fine, coarse = report["ladders"]["fine"], report["ladders"]["coarse"]
    print(f"{'n':>4s} {'fine bucket':>11s} {'ms':>7s} {'coarse bucket':>13s} {'ms':>7s} {'coarse/fine':>11s}")
    for n in LENGTHS:
        f, c = fine["prompts"][n], coarse["prompts"][n]
        c["vs_fine"] = c["median_ms"] / f["median_ms"]
        print(f"{n:4d} {f['bucket']:11d} {f['median_ms']:7.2f} {c['bucket']:13d} {c['median_ms']:7.2f} {c['vs_fine']:11.3f}")
    report["capture_s_saved"] = fine["capture_s"] - coarse["capture_s"]
    print(f"warm start CUDA graphs: fine {fine['capture_s']:.2f} s ({fine['graphs']} graphs), coarse "
          f"{coarse['capture_s']:.2f} s ({coarse['graphs']} graphs)")
    path = Path(args.out) / f"prefill_ladder_{args.device}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
