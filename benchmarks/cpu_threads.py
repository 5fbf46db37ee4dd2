"""How many intra-op threads a CPU engine should use, measured: throughput at 1..N threads, alone
and beside a co-tenant that keeps one core busy (a spinning process), side by side in one run.

    python benchmarks/cpu_threads.py --out benchmarks/results

SmolLM2 fp32 (the C++ attention built first), 16 chats x 32 tokens and one stream of 32 tokens
per setting. Writes cpu_threads_smollm2_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from pathlib import Path

import torch

from kiln import LLM, SamplingParams
from kiln.ops.cpu import extension

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain recursion to a child.",
           "List three prime numbers.", "Who wrote Hamlet?", "Describe a sunset in one sentence.",
           "What is 12 times 13?", "Name a famous painter.", "How do plants make food?", "Tell me a joke.",
           "What is the speed of light?", "Translate 'good morning' into Spanish.", "Why is the sky blue?",
           "Give me a synonym for happy.", "What does a CPU do?", "Summarise the plot of Cinderella."]


def _spin(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def _rate(llm: LLM, chats: list, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.chat(chats, params, use_tqdm=False)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args()
    extension.build()
    cores = os.cpu_count() or 1
    llm = LLM("smollm2", device="cpu", dtype="float32", max_num_seqs=16)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    _rate(llm, chats[:2], 4)  # warm
    rows = []
    for cotenant in (False, True):
        stop = multiprocessing.Event()
        spinner = multiprocessing.Process(target=_spin, args=(stop,), daemon=True) if cotenant else None
        if spinner:
            spinner.start()
        try:
            for _ in range(args.runs):
                for threads in range(1, cores + 1):
                    torch.set_num_threads(threads)
                    row = {"cotenant": cotenant, "threads": threads, "batch_tok_s": _rate(llm, chats, args.tokens),
                           "single_tok_s": _rate(llm, chats[:1], args.tokens)}
                    rows.append(row)
                    print(f"co-tenant {cotenant!s:5s} threads {threads}: 16 streams {row['batch_tok_s']:6.1f} tok/s, "
                          f"one stream {row['single_tok_s']:5.1f} tok/s", flush=True)
        finally:
            if spinner:
                stop.set()
                spinner.join()
    llm.shutdown()
    report = {"torch": torch.__version__, "cpu_count": cores, "rows": rows, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = Path(args.out) / "cpu_threads_smollm2_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
