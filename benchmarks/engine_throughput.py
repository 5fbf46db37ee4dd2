"""Engine throughput and memory (a benchmark, not a test): prints numbers, writes JSON.

CPU:  python benchmarks/engine_throughput.py --out benchmarks/results
      eager tokens/s for 16 short plain prompts (a few words, no chat template) x 64 tokens on
      the embedded SmolLM2, and peak RSS of `kiln generate` measured with /usr/bin/time -v.
      The CPU serving figure to quote is benchmarks/cpu_peer.py's (16 chat prompts of ~35
      tokens x 64, beside vLLM's CPU build); this one is kept for the generate's peak RSS.
GPU:  python benchmarks/engine_throughput.py --device cuda --model llama-3-8b --out $OUT
      decode step time and tokens/s of a random bf16 Llama-3-8B at batch 1 and 64, eager
      and compiled side by side (no CUDA graphs yet).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from kiln import LLM, SamplingParams
from kiln.ops.cpu import extension
from kiln.compile.config import CompilationConfig

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are",
           "My favourite food is", "In 1969, astronauts", "Water boils at", "The quick brown fox",
           "To make a cup of tea,", "The largest planet in the solar system", "Machine learning is",
           "Dear diary, today", "The recipe calls for", "Photosynthesis converts", "A haiku about autumn:",
           "The stock market"]


def cpu_throughput(num_tokens: int) -> dict:
    llm = LLM("smollm2", device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(PROMPTS, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    return {"model": "smollm2", "prompts": len(PROMPTS), "max_tokens": num_tokens,
            "generated_tokens": generated, "seconds": elapsed, "tokens_per_s": generated / elapsed}


def peak_rss_of_generate() -> dict:
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "kiln.cli", "generate",
           "What is the capital of France?", "--max-tokens", "32"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if run.returncode != 0:
        raise RuntimeError(f"kiln generate failed:\n{run.stderr}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr).group(1))
    return {"command": " ".join(cmd[2:]), "max_rss_mib": rss_kb / 1024, "target_mib": 1.5 * 1024}


def gpu_decode(model: str, batches: list[int], context: int, steps: int) -> list[dict]:
    """Decode step time, eager (-O0: Triton kernels for every custom op) beside compiled (-O2)."""
    results = []
    for label, level in (("eager -O0", 0), ("compiled -O2", 2)):
        start = time.perf_counter()
        llm = LLM(model, device="cuda", dtype="bfloat16", max_num_seqs=max(batches),
                  max_num_batched_tokens=2048, max_model_len=context + steps + 16,
                  num_kv_blocks=4096, compilation=CompilationConfig.level(level))
        startup = time.perf_counter() - start
        for batch in batches:
            median = _median_decode_step(llm.engine, batch, context, steps)
            results.append({"model": model, "mode": label, "startup_s": startup, "batch": batch,
                            "context": context, "median_step_ms": median * 1e3,
                            "tokens_per_s": batch / median})
            print(f"{model} {label} batch {batch}: decode step {median * 1e3:.2f} ms, "
                  f"{batch / median:.0f} tokens/s (start-up {startup:.1f} s)", flush=True)
        llm.shutdown()  # its memory back now: a built engine's heap is frozen, out of gc.collect()'s reach
    return results


def _median_decode_step(engine, batch: int, context: int, steps: int) -> float:
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    vocab = engine.source.config.vocab_size
    for _ in range(batch):
        engine.add_request(torch.randint(0, vocab, (context,), generator=gen).tolist(), params)
    step_times = []
    while engine.has_unfinished():
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        step_times.append(time.perf_counter() - start)
    # Only the last decode steps: prefill and the first decodes (allocator warm-up) are out.
    decode = sorted(step_times[-(steps - 8):])
    return decode[len(decode) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    result = {"torch": torch.__version__, "machine": platform.machine(), "device": args.device,
              "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.device == "cpu":
        extension.build()  # a deployment's CPU attention (kiln prewarm builds it), not the Python reference
        torch.set_num_threads(1)
        result.update(threads=1, mode="eager (the CPU default)")
        result["throughput"] = cpu_throughput(args.tokens)
        result["kiln_generate_peak_rss"] = peak_rss_of_generate()
        print(json.dumps(result, indent=2))
    else:
        result["gpu"] = torch.cuda.get_device_name()
        result["decode"] = gpu_decode(args.model, [1, 64], context=128, steps=64)
    out = Path(args.out) / f"engine_throughput_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
