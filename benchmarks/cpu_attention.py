"""kiln's CPU attention against the Python reference, side by side in one process: "kiln" (prompt
chunks and decode batches through torch's SDPA, the rest through the C++ kernel, as an engine runs it),
"kernel" (the C++ kernel for every row) and "reference" (the Python reference for every row).

    python benchmarks/cpu_attention.py --out benchmarks/results

1. The op alone on SmolLM2's shapes (9 query heads, 3 KV heads, head dim 64, 16-token blocks):
   a decode batch of 16 sequences at 512 tokens of context, one 2048-token prefill chunk, and 15
   decodes beside a 512-token chunk.
2. An engine generating 16 prompts x 64 forced tokens (SmolLM2, fp32), the three arms
   alternating run after run on the same engine; tokens compared.
3. One long prompt's prefill (4096 tokens in 2048-token chunks), time and peak memory growth.
Writes cpu_attention_smollm2_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch

from kiln import LLM, SamplingParams
from kiln.forward_context import AttentionMetadata
from kiln.ops import attention as attention_module
from kiln.ops.attention import paged_attention_cpu
from kiln.ops.cpu import extension, sdpa_attention

HQ, HKV, D, BLOCK = 9, 3, 64, 16
NEVER = 1 << 62
# arm -> (the C++ kernel's loader, the fewest queries of a chunk and the fewest decode rows SDPA takes)
ARMS = {"kiln": (extension.kernel, sdpa_attention.MIN_QUERIES, sdpa_attention.MIN_DECODE_ROWS),
        "kernel": (extension.kernel, NEVER, NEVER), "reference": (lambda: None, NEVER, NEVER)}


def use(arm: str) -> None:
    attention_module.cpu_kernel, sdpa_attention.MIN_QUERIES, sdpa_attention.MIN_DECODE_ROWS = ARMS[arm]
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain recursion to a child.",
           "List three prime numbers.", "Who wrote Hamlet?", "Describe a sunset in one sentence.",
           "What is 12 times 13?", "Name a famous painter.", "How do plants make food?", "Tell me a joke.",
           "What is the speed of light?", "Translate 'good morning' into Spanish.", "Why is the sky blue?",
           "Give me a synonym for happy.", "What does a CPU do?", "Summarise the plot of Cinderella."]


def _metadata(seq_lens: list[int], query_lens: list[int]) -> AttentionMetadata:
    tables, starts, next_block = [], [0], 0
    for length, q in zip(seq_lens, query_lens):
        count = -(-length // BLOCK)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
        starts.append(starts[-1] + q)
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.long), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), num_actual_tokens=starts[-1], seq_lens_cpu=list(seq_lens),
        query_start_loc_cpu=starts), next_block


def op_case(name: str, seq_lens: list[int], query_lens: list[int], repeats: int) -> dict:
    meta, blocks = _metadata(seq_lens, query_lens)
    cache = torch.randn(2, blocks, BLOCK, HKV, D)
    query = torch.randn(sum(query_lens), HQ, D)
    times = {}
    for arm in ARMS:
        use(arm)
        meta.cpu_plans.clear()  # the step's routing, planned by the arm before
        out = torch.empty_like(query)
        paged_attention_cpu(query, cache, out, meta, D**-0.5, 0, 0.0)
        start = time.perf_counter()
        for _ in range(repeats):
            paged_attention_cpu(query, cache, out, meta, D**-0.5, 0, 0.0)
        times[arm] = (time.perf_counter() - start) / repeats * 1e3
        times[f"{arm}_out"] = out
    use("kiln")
    reference = times.pop("reference_out")
    row = {"case": name, **{f"{arm}_ms": times[arm] for arm in ARMS},
           "max_abs_diff": max((times.pop(f"{arm}_out") - reference).abs().max().item() for arm in ("kiln", "kernel"))}
    print(f"op {name:30s} " + ", ".join(f"{arm} {times[arm]:8.2f} ms" for arm in ARMS)
          + f", max |diff| {row['max_abs_diff']:.1e}", flush=True)
    return row


def engine_runs(args) -> dict:
    llm = LLM("smollm2", device="cpu", dtype="float32", max_num_seqs=16)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    rates = {arm: [] for arm in ARMS}
    tokens = {}
    llm.chat(chats[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm
    for _ in range(args.runs):
        for arm in ARMS:
            use(arm)
            start = time.perf_counter()
            outs = llm.chat(chats, params, use_tqdm=False)
            rates[arm].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
            tokens[arm] = [o.token_ids for o in outs]
    use("kiln")
    row = {arm: {"tok_s_runs": r, "tok_s_median": statistics.median(r)} for arm, r in rates.items()}
    row["tokens_equal"] = tokens["kiln"] == tokens["kernel"] == tokens["reference"]
    print(f"engine 16 x {args.tokens} tokens: " + ", ".join(f"{arm} {row[arm]['tok_s_median']:.1f} tok/s" for arm in ARMS)
          + f", tokens equal {row['tokens_equal']}", flush=True)
    llm.shutdown()
    return row


def long_prompt(args) -> dict:
    llm = LLM("smollm2", device="cpu", dtype="float32", max_model_len=args.long + 64, max_num_batched_tokens=2048)
    vocab = llm.engine.source.config.vocab_size
    prompt = torch.randint(0, vocab, (args.long,), generator=torch.Generator().manual_seed(0)).tolist()
    row = {"prompt_tokens": args.long}
    for arm in ARMS:
        use(arm)
        llm.engine.scheduler.block_manager.enable_prefix_caching = False
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
        row[f"{arm}_s"] = time.perf_counter() - start
        row[f"{arm}_peak_rss_growth_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    use("kiln")
    print(f"prefill of {args.long} tokens: " + ", ".join(f"{arm} {row[f'{arm}_s']:.2f} s" for arm in ARMS), flush=True)
    llm.shutdown()
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--long", type=int, default=4096)
    args = p.parse_args()
    start = time.perf_counter()
    library = extension.build()
    report = {"torch": torch.__version__, "threads": torch.get_num_threads(), "kernel": str(library),
              "build_or_load_s": time.perf_counter() - start}
    report["op"] = [op_case("decode 16 x ctx 512", [512] * 16, [1] * 16, 50),
                    op_case("prefill chunk 2048 (ctx 2048)", [2048], [2048], 2),
                    op_case("mixed: 15 decodes + 512 chunk", [512] * 15 + [1024], [1] * 15 + [512], 5)]
    report["engine"] = engine_runs(args)
    report["long_prompt"] = long_prompt(args)
    report["when"] = time.strftime("%Y-%m-%d %H:%M:%S")
    out = Path(args.out) / "cpu_attention_smollm2_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
