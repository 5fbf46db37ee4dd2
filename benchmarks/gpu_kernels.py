"""Check kiln's Triton kernels against the native references on a GPU, then time them.

    python benchmarks/gpu_kernels.py [OUT_DIR]      (default: $OUT, else benchmarks/results)

Writes OUT_DIR/kernels.json and prints a short table. Checks: norm (and Gemma's unit-offset
norms), silu-and-mul and gelu-tanh-and-mul, rope (alone and writing the KV cache; these three
bitwise in bf16, against the native path eager and as Inductor compiles it), the logits'
argmax in bf16 and fp32, the mixture-of-experts op at Qwen3-MoE's and Mixtral's shapes; the KV
write (exact); paged attention in bf16 against an fp32 reference on the same inputs, swept over
cache block sizes, GQA ratios, head dims and context lengths in decode, prefill and mixed
batches (with sliding windows and Gemma 2's soft-capping); and a CUDA-graph replay of write + attention
with new lengths. Timings (medians): decode attention at Llama-3-8B shape, and each
elementwise kernel against its eager PyTorch equivalent, launched normally and inside a
CUDA graph (the way kiln runs them). Imports only torch, triton and kiln.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

from kiln.compile.config import INDUCTOR_DEFAULTS
from kiln.forward_context import AttentionMetadata
from kiln.ops.activation import gelu_tanh_and_mul_native, silu_and_mul_native
from kiln.ops.moe import fused_moe_reference, route
from kiln.ops.attention_reference import paged_attention_reference, write_kv_reference
from kiln.ops.norm import fused_add_rms_norm_native, rms_norm_native
from kiln.ops.rotary import rope_cos_sin_cache, rotary_native
from kiln.ops.triton.activation import gelu_tanh_and_mul, silu_and_mul
from kiln.ops.triton.argmax import argmax
from kiln.ops.triton.attention import choose_kv_splits, paged_attention, write_kv
from kiln.ops.triton.moe import fused_moe as triton_fused_moe
from kiln.ops.triton.norm import fused_add_rms_norm, rms_norm
from kiln.ops.triton.rotary import rotary_embedding

DEVICE = "cuda"
SEQ_LENS = [1, 17, 128, 1000, 4096]
BLOCK_SIZES = [16, 32, 64]
# (query heads, kv heads, head dim): GQA ratios 1, 4, 8 at both head dims, and 3 at 64; Gemma 2's 256
HEAD_SHAPES = [(2, 2, 64), (8, 2, 64), (16, 2, 64), (6, 2, 64), (2, 2, 128), (8, 2, 128), (16, 2, 128),
               (16, 8, 256)]
GEMMA_SHAPE = (16, 8, 256)
SOFTCAP = 0.5  # low enough to bite on these random scores (Gemma 2's own 50 would not)
# Pass marks (bf16 inputs, fp32 reference): attention rounds probabilities to bf16 for P @ V.
ATTENTION_MAX_REL_ERR = 1e-2
EXACT = ("argmax", "rotary_kv_write.cache")  # checks that must match bit for bit
# In bf16 these must too: eager runs the kernel, a compiled model Inductor's code for the native
# path (rounding as eager's torch ops do), and one ulp between the two flips random-weight
# models' greedy tokens (benchmarks/families.py).
EXACT_BF16 = ("silu_and_mul", "gelu_tanh_and_mul", "rotary_embedding.q", "rotary_embedding.k",
              "silu_and_mul.inductor", "gelu_tanh_and_mul.inductor", "rotary_embedding.inductor.q",
              "rotary_embedding.inductor.k")
ELEMENTWISE_TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}  # max |err| / max(1, |ref|), per element
# fused_moe sums up to 14,336 products per output in another order than cuBLAS: judged by rel_err (norms)
# (the H200 gave 3.3e-4 in bf16 and 2.7e-6 in fp32 at Mixtral's shape, where the per-element mark failed).
MOE_TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}
SWEEP_BUDGET_S = 150.0  # the sweep stops here (recording what it skipped) so timings still run


def errors(actual: torch.Tensor, expected: torch.Tensor) -> dict:
    diff = actual.float() - expected.float()
    return {"max_abs_err": diff.abs().max().item(),
            "rel_err": (diff.norm() / expected.float().norm().clamp_min(1e-30)).item(),
            "nan": bool(actual.isnan().any().item())}


# ---------------------------------------------------------------------------- elementwise kernels


def inductor(fn):
    """fn compiled with the Inductor settings kiln gives its pieces."""
    return torch.compile(fn, options=INDUCTOR_DEFAULTS)


def check_elementwise() -> list[dict]:
    results = []
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def rand(*shape, dtype):
        return torch.randn(*shape, generator=g, device=DEVICE).to(dtype)

    for dtype in (torch.bfloat16, torch.float32):
        x, residual, weight = rand(300, 4096, dtype=dtype), rand(300, 4096, dtype=dtype), rand(4096, dtype=dtype)
        cases = {"rms_norm": (rms_norm(x, weight, 1e-5), rms_norm_native(x, weight, 1e-5))}
        out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
        ref_out, ref_residual = fused_add_rms_norm_native(x, residual, weight, 1e-5)
        cases["fused_add_rms_norm.out"] = (out, ref_out)
        cases["fused_add_rms_norm.residual"] = (new_residual, ref_residual)
        cases["rms_norm.unit_offset"] = (rms_norm(x, weight, 1e-6, True), rms_norm_native(x, weight, 1e-6, True))
        out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6, True)
        cases["fused_add_rms_norm.unit_offset"] = (out, fused_add_rms_norm_native(x, residual, weight, 1e-6, True)[0])
        gate_up = rand(300, 2 * 14336, dtype=dtype) * 3
        cases["silu_and_mul"] = (silu_and_mul(gate_up), silu_and_mul_native(gate_up))
        cases["gelu_tanh_and_mul"] = (gelu_tanh_and_mul(gate_up), gelu_tanh_and_mul_native(gate_up))
        cases["silu_and_mul.inductor"] = (silu_and_mul(gate_up), inductor(silu_and_mul_native)(gate_up))
        cases["gelu_tanh_and_mul.inductor"] = (gelu_tanh_and_mul(gate_up), inductor(gelu_tanh_and_mul_native)(gate_up))
        # Qwen3-30B-A3B's experts (128, top 8) at decode and prefill sizes, Mixtral's (8, top 2) at 64.
        for tokens, experts, top_k, hidden, inter in ((1, 128, 8, 2048, 768), (64, 128, 8, 2048, 768),
                                                      (300, 128, 8, 2048, 768), (64, 8, 2, 4096, 14336)):
            h = rand(tokens, hidden, dtype=dtype)
            logits = rand(tokens, experts, dtype=dtype)
            w13, w2 = rand(experts, 2 * inter, hidden, dtype=dtype) * 0.02, rand(experts, hidden, inter, dtype=dtype) * 0.02
            cases[f"fused_moe.{experts}x{top_k}.t{tokens}"] = (
                triton_fused_moe(h, *route(logits, top_k, True), w13, w2),
                fused_moe_reference(h, logits, w13, w2, top_k, True))
            del w13, w2
        qkv = rand(300, 48 * 128, dtype=dtype)
        q, k, _ = qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1)
        positions = torch.randint(0, 8192, (300,), device=DEVICE)
        cache = rope_cos_sin_cache(128, 8192, 500000.0, None, device=DEVICE)
        q_out, k_out = rotary_embedding(positions, q, k, cache, 128)
        q_ref, k_ref = rotary_native(positions, q, k, cache, 128)
        cases["rotary_embedding.q"], cases["rotary_embedding.k"] = (q_out, q_ref), (k_out, k_ref)
        q_ref, k_ref = inductor(rotary_native)(positions, q, k, cache, 128)
        cases["rotary_embedding.inductor.q"], cases["rotary_embedding.inductor.k"] = (q_out, q_ref), (k_out, k_ref)
        # The rotation with the KV write in the same launch: the cache must be what write_kv leaves.
        v = qkv[:, 40 * 128:]
        fused_cache = rand(2, 64, 16, 8, 128, dtype=dtype)
        apart_cache = fused_cache.clone()
        slots = torch.randperm(64 * 16, device=DEVICE)[:300]
        rotary_embedding(positions, q, k, cache, 128, v, fused_cache, slots)
        write_kv(k_out.view(300, 8, 128), v.reshape(300, 8, 128), apart_cache, slots)
        cases["rotary_kv_write.cache"] = (fused_cache, apart_cache)
        logits = rand(300, 128256, dtype=dtype)
        logits[7, [5, 70000]] = logits.max() + 1  # a tie two blocks apart: the first index wins
        cases["argmax"] = (argmax(logits).float(), logits.argmax(dim=-1).float())
        for name, (actual, expected) in cases.items():
            scaled = ((actual.float() - expected.float()).abs() / expected.float().abs().clamp_min(1)).max().item()
            err = errors(actual, expected)
            if name in EXACT or (dtype == torch.bfloat16 and name in EXACT_BF16):
                ok = torch.equal(actual, expected)
            elif name.startswith("fused_moe"):
                ok = err["rel_err"] <= MOE_TOL[dtype]
            else:
                ok = scaled <= ELEMENTWISE_TOL[dtype]
            results.append({"kernel": name, "dtype": str(dtype).removeprefix("torch."), **err,
                            "max_scaled_err": scaled, "ok": ok})
    return results


# ---------------------------------------------------------------------------- paged batches


class PagedBatch:
    """Sequences (query_len, seq_len) over a random bf16 paged cache with shuffled block tables."""

    def __init__(self, seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype=torch.bfloat16, padding: int = 2, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        blocks_per_seq = [-(-length // block_size) for _, length in seqs]
        num_blocks = sum(blocks_per_seq) + 4
        block_ids = torch.randperm(num_blocks, generator=g)
        table = torch.randint(0, num_blocks, (len(seqs), max(blocks_per_seq) + 1), generator=g)
        slots, starts, used = [], [0], 0
        for i, ((q_len, length), count) in enumerate(zip(seqs, blocks_per_seq)):
            table[i, :count] = block_ids[used:used + count]
            used += count
            pos = torch.arange(length - q_len, length)
            slots.append(table[i, pos // block_size] * block_size + pos % block_size)
            starts.append(starts[-1] + q_len)
        slots.append(torch.full((padding,), -1))
        num_tokens = starts[-1] + padding
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        qkv = torch.randn(num_tokens, sum(sizes), generator=g).to(DEVICE, dtype)
        q, k, v = qkv.split(sizes, dim=-1)
        self.query = q.view(num_tokens, num_heads, head_dim)
        self.key = k.view(num_tokens, num_kv_heads, head_dim)
        self.value = v.view(num_tokens, num_kv_heads, head_dim)
        self.kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(DEVICE, dtype)
        self.scale = head_dim**-0.5
        self.seqs = seqs
        self.meta = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(DEVICE), block_tables=table.to(DEVICE, torch.int32),
            seq_lens=torch.tensor([s for _, s in seqs], dtype=torch.int32, device=DEVICE),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            max_query_len=max(q for q, _ in seqs), max_seq_len=max(s for _, s in seqs),
            num_actual_tokens=starts[-1], seq_lens_cpu=[s for _, s in seqs], query_start_loc_cpu=starts,
        )

    def run_kernel(self, **kwargs) -> torch.Tensor:
        out = torch.full(self.query.shape, float("nan"), dtype=self.query.dtype, device=DEVICE)
        paged_attention(self.query, self.kv_cache, out, self.meta, self.scale, **kwargs)
        return out

    def run_reference(self, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        out = torch.full(self.query.shape, float("nan"), device=DEVICE)
        paged_attention_reference(self.query.float(), self.kv_cache.float(), out, self.meta, self.scale, window,
                                  softcap)
        return out

    def rows_of(self, i: int) -> slice:
        return slice(self.meta.query_start_loc_cpu[i], self.meta.query_start_loc_cpu[i + 1])


def sweep_batches() -> dict[str, list[tuple[str, int, int]]]:
    """kind -> [(role, query_len, seq_len)]: every context length in each kind of batch."""
    return {
        "decode": [("decode", 1, n) for n in SEQ_LENS],
        "prefill": [("prefill", n, n) for n in SEQ_LENS],
        # decode tokens beside chunks from the middle of prompts (the last third of each context)
        "mixed": [("decode", 1, n) for n in SEQ_LENS] + [("chunk", -(-n // 3), n) for n in SEQ_LENS],
    }


def check_attention_sweep(deadline: float) -> tuple[list[dict], list[str]]:
    results, skipped = [], []
    for block_size in BLOCK_SIZES:
        for num_heads, num_kv_heads, head_dim in HEAD_SHAPES:
            for kind, roles in sweep_batches().items():
                label = f"{kind} bs={block_size} heads={num_heads}/{num_kv_heads} D={head_dim}"
                if time.perf_counter() > deadline:
                    skipped.append(label)
                    continue
                batch = PagedBatch([(q, s) for _, q, s in roles], num_heads, num_kv_heads, head_dim, block_size)
                references = {(0, 0.0): batch.run_reference()}
                splits = choose_kv_splits(batch.meta, num_kv_heads, batch.query.device)
                variants = {(splits, 0, 0.0): batch.run_kernel()}
                if kind == "decode" and block_size == 16:  # also the unsplit decode path
                    variants[(1, 0, 0.0)] = batch.run_kernel(kv_splits=1)
                extra = []
                if block_size == 16 and (num_heads, num_kv_heads, head_dim) == HEAD_SHAPES[0]:
                    extra = [(1, 0.0), (100, 0.0)]  # Mistral's sliding window, shorter than most contexts here
                if block_size == 16 and (num_heads, num_kv_heads, head_dim) == GEMMA_SHAPE:
                    extra = [(0, SOFTCAP), (100, SOFTCAP)]  # Gemma 2's soft-capped layers, global and sliding
                for window, softcap in extra:
                    references[(window, softcap)] = batch.run_reference(window, softcap)
                    variants[(splits, window, softcap)] = batch.run_kernel(window=window, softcap=softcap)
                for (splits, window, softcap), out in variants.items():
                    padding_untouched = bool(out[batch.meta.num_actual_tokens:].isnan().all().item())
                    for i, (role, q_len, seq_len) in enumerate(roles):
                        rows = batch.rows_of(i)
                        results.append({
                            "kind": kind, "role": role, "block_size": block_size, "num_heads": num_heads,
                            "num_kv_heads": num_kv_heads, "head_dim": head_dim, "query_len": q_len,
                            "seq_len": seq_len, "kv_splits": splits, "window": window, "softcap": softcap,
                            "padding_untouched": padding_untouched,
                            **errors(out[rows], references[(window, softcap)][rows]),
                        })
    return results, skipped


def summarize_attention(results: list[dict], skipped: list[str]) -> dict:
    worst = max(results, key=lambda r: r["rel_err"]) if results else None
    ok = all(r["rel_err"] <= ATTENTION_MAX_REL_ERR and not r["nan"] and r["padding_untouched"] for r in results)
    return {"cases": len(results), "skipped_batches": skipped, "all_ok": ok and not skipped,
            "max_abs_err": max((r["max_abs_err"] for r in results), default=None),
            "max_rel_err": max((r["rel_err"] for r in results), default=None),
            "rel_err_limit": ATTENTION_MAX_REL_ERR, "worst_case": worst}


def check_write_kv() -> dict:
    batch = PagedBatch([(1, 40), (30, 100), (17, 17)], 32, 8, 128, 16)
    kernel_cache, reference_cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    write_kv(batch.key, batch.value, kernel_cache, batch.meta.slot_mapping)
    write_kv_reference(batch.key, batch.value, reference_cache, batch.meta.slot_mapping)
    return {"exact": bool(torch.equal(kernel_cache, reference_cache))}


def check_gumbel_draws(rows: int = 20000) -> dict:
    """Sampling's draw (Gumbel-max in the argmax kernel) on Llama 3's vocabulary: three kept columns
    in the first, a middle and the ragged last chunk, 60,000 likelier ones just below the threshold;
    each row its own seed. Frequencies within 0.02 of softmax over the kept, none outside them."""
    from kiln.ops.triton import argmax

    width, kept = 128256, torch.tensor([5, 70000, 128255])
    x = torch.full((width,), -30.0, device=DEVICE)
    x[10:60010] = -1.01
    x[kept] = torch.tensor([1.0, 0.0, -1.0], device=DEVICE)
    draws = argmax.gumbel_argmax(x.expand(rows, width).contiguous(), torch.full((rows,), -1.0, device=DEVICE),
                                 torch.randint(0, 2**62, (rows,), device=DEVICE)).cpu()
    freq = torch.stack([(draws == c).float().mean() for c in kept])
    want = torch.tensor([1.0, 0.0, -1.0]).softmax(0)
    inside = bool(torch.isin(draws, kept).all())
    return {"rows": rows, "frequencies": freq.tolist(), "expected": want.tolist(), "all_kept": inside,
            "counters_zero": not bool(argmax._counters(x.device).any()),
            "ok": inside and bool((freq - want).abs().max() < 0.02) and not argmax._counters(x.device).any()}


def check_scaled_sampling(rows: int = 256) -> dict:
    """The sampler's reads of unscaled logits on Llama 3's vocabulary: Gumbel-max dividing by each
    row's temperature as it reads draws what it draws from the scaled rows written out (bit-equal
    division), and kept_mass is within 1e-5 of torch's passes (Triton's exp, its own order)."""
    from kiln.ops.triton import argmax
    from kiln.ops.triton.kept_mass import kept_mass

    x = torch.randn(rows, 128256, device=DEVICE) * 4
    temperature = torch.rand(rows, 1, device=DEVICE) * 1.5 + 0.05
    s = x / temperature
    top = s.amax(dim=-1, keepdim=True)
    tau = s.topk(1000, dim=-1).values[:, -1:]
    seeds = torch.randint(0, 2**62, (rows,), device=DEVICE)
    draws_equal = bool(torch.equal(argmax.gumbel_argmax(x, tau.reshape(-1), seeds, temperature.reshape(-1)),
                                   argmax.gumbel_argmax(s, tau.reshape(-1), seeds)))
    want = (s - top).exp().masked_fill(s < tau, 0).sum(dim=-1, keepdim=True)
    rel = ((kept_mass(x, temperature, top, tau) - want).abs() / want).max().item()
    return {"rows": rows, "draws_equal": draws_equal, "kept_mass_max_rel_err": rel,
            "ok": draws_equal and rel < 1e-5}


def check_sampling_graphs(bucket: int = 64) -> dict:
    """The engine's sampling CUDA graph (kiln.engine.sampling_graphs) against the eager sampler on
    the same logits, settings and seeds, for every kind of cut program: top-k + top-p + min-p
    twice with other values (one graph replayed), top-p alone and a top-k past 1024 (both sort
    whole rows), temperature alone, min-p alone. Every row sampled (the eager sampler's shapes are
    then the graph's): tokens must be equal. Then a batch with greedy rows and padding: greedy
    rows must be the argmax; sampled rows may differ only where a sum rounds otherwise over
    fewer rows."""
    from kiln.engine.sampler import Cuts, sample
    from kiln.engine.sampling_graphs import SamplingGraphs
    from kiln.engine.sampling_params import SamplingParams
    from kiln.ops.triton.argmax import argmax

    # A forward graph's outputs: the same addresses every step (a graph is kept per address).
    logits = torch.empty(bucket, 128256, device=DEVICE)
    greedy = torch.empty(bucket, dtype=torch.long, device=DEVICE)
    graphs = SamplingGraphs(bucket, torch.device(DEVICE))
    cases = {
        "A": lambda i: SamplingParams(temperature=0.7, top_k=40 + i, top_p=0.9, min_p=0.01 * (i % 2), seed=i),
        "B": lambda i: SamplingParams(temperature=1.1, top_k=200 + i, top_p=0.8, min_p=0.01 * (i % 2), seed=i),
        "top-p alone": lambda i: SamplingParams(temperature=0.8, top_p=0.9 + 0.001 * i, seed=i),
        "top-k past 1024": lambda i: SamplingParams(temperature=0.9, top_k=2000 + i, seed=i),
        "temperature alone": lambda i: SamplingParams(temperature=0.5 + 0.01 * i, seed=i),
        "min-p alone": lambda i: SamplingParams(temperature=1.0, min_p=0.02 + 0.001 * i, seed=i),
        "mixed": lambda i: SamplingParams(temperature=0.0) if i % 3 == 0 else
        SamplingParams(temperature=0.9, top_k=50 + i, top_p=0.95, min_p=0.01 * (i % 2), seed=i),
    }
    report, ok, programs = {}, True, set()
    for name, row in cases.items():
        n = bucket - 4 if name == "mixed" else bucket
        logits.copy_(torch.randn(bucket, 128256, device=DEVICE) * 3)
        greedy.copy_(argmax(logits))
        params = [row(i) for i in range(n)]
        programs.add(Cuts.of(params, logits.device))
        gens = [[torch.Generator().manual_seed(1000 + i) for i in range(n)] for _ in range(2)]
        in_graph = graphs.sample(logits, greedy, params, gens[0])
        if in_graph is None:
            report[name] = {"ok": False, "error": "the graph could not be captured (see the log)"}
            ok = False
            continue
        eager = sample(logits[:n], params, gens[1]).cpu()
        in_graph = in_graph.cpu()
        same = int((in_graph == eager).sum())
        greedy_ok = all(int(in_graph[i]) == int(greedy[i]) for i in range(n) if params[i].greedy)
        row_ok = same == n if n == bucket else same >= 0.95 * n and greedy_ok
        report[name] = {"rows": n, "equal_to_eager": same, "greedy_rows_ok": greedy_ok, "ok": row_ok}
        ok = ok and row_ok
    report["graphs"], report["cut_programs"] = len(graphs.graphs), len(programs)
    report["ok"] = ok and len(graphs.graphs) == len(programs) < len(cases)
    return report


def check_cuda_graph_replay() -> dict:
    """Capture write + attention once, then replay with other lengths and block tables."""
    first = PagedBatch([(1, n) for n in (5, 60, 300, 2000)], 32, 8, 128, 16, seed=1)
    second = PagedBatch([(1, n) for n in (900, 3, 64, 1500)], 32, 8, 128, 16, seed=2)
    blocks = max(first.kv_cache.shape[1], second.kv_cache.shape[1])
    kv_cache = torch.zeros(2, blocks, 16, 8, 128, dtype=torch.bfloat16, device=DEVICE)
    tables = torch.zeros(4, max(first.meta.block_tables.shape[1], second.meta.block_tables.shape[1]),
                         dtype=torch.int32, device=DEVICE)
    static = {name: getattr(first, name).clone() for name in ("query", "key", "value")}
    slot_mapping, seq_lens = first.meta.slot_mapping.clone(), first.meta.seq_lens.clone()
    tables[:, : first.meta.block_tables.shape[1]] = first.meta.block_tables

    def load(batch):  # copy a batch into the captured buffers, as a runner would
        kv_cache[:, : batch.kv_cache.shape[1]] = batch.kv_cache
        for name, tensor in static.items():
            tensor.copy_(getattr(batch, name))
        slot_mapping.copy_(batch.meta.slot_mapping)
        seq_lens.copy_(batch.meta.seq_lens)
        tables.zero_()
        tables[:, : batch.meta.block_tables.shape[1]] = batch.meta.block_tables
        return AttentionMetadata(slot_mapping, tables, seq_lens, first.meta.query_start_loc, 1,
                                 batch.meta.max_seq_len, 4, batch.meta.seq_lens_cpu, batch.meta.query_start_loc_cpu)

    meta = load(first)
    out = torch.empty_like(static["query"])

    def step():
        write_kv(static["key"], static["value"], kv_cache, slot_mapping)
        paged_attention(static["query"], kv_cache, out, meta, first.scale)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    result = {}
    for name, batch in (("capture_batch", first), ("other_batch", second)):
        replay_meta = load(batch)
        reference_cache = kv_cache.clone()
        write_kv_reference(static["key"], static["value"], reference_cache, slot_mapping)
        reference = torch.empty(static["query"].shape, device=DEVICE)
        paged_attention_reference(static["query"].float(), reference_cache.float(), reference, replay_meta,
                                  first.scale)
        graph.replay()
        torch.cuda.synchronize()
        result[name] = {**errors(out[:4], reference[:4]), "cache_exact": bool(torch.equal(kv_cache, reference_cache))}
    result["ok"] = all(r["rel_err"] <= ATTENTION_MAX_REL_ERR and not r["nan"] and r["cache_exact"]
                       for r in result.values())
    return result


# ---------------------------------------------------------------------------- timing


def graph_time_us(fn, calls: int = 20, replays: int = 10) -> float:
    """Median time of one call of fn inside a CUDA graph of `calls` calls (no launch overhead)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]


def time_us(fn) -> dict:
    return {"launch_us": triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1000,
            "graph_us": graph_time_us(fn)}


def time_decode_attention() -> list[dict]:
    results = []
    cases = [(batch, 128, None) for batch in (1, 8, 64, 256)] + [(1, 4096, 1), (1, 4096, None), (8, 4096, None)]
    for batch_size, context, splits in cases:
        batch = PagedBatch([(1, context)] * batch_size, 32, 8, 128, 16, padding=0)
        out = torch.empty_like(batch.query)
        chosen = splits or choose_kv_splits(batch.meta, 8, batch.query.device)
        timing = time_us(lambda: paged_attention(batch.query, batch.kv_cache, out, batch.meta, batch.scale,
                                                 kv_splits=chosen))
        kv_bytes = 2 * batch_size * context * 8 * 128 * 2
        results.append({"batch": batch_size, "context": context, "kv_splits": chosen, **timing,
                        "kv_read_gb_per_s": kv_bytes / (timing["graph_us"] * 1e3)})
    return results


def time_elementwise() -> list[dict]:
    results = []
    hidden, intermediate = 4096, 14336
    cache = rope_cos_sin_cache(128, 8192, 500000.0, None, device=DEVICE)
    weight = torch.randn(hidden, device=DEVICE, dtype=torch.bfloat16)
    for tokens in (1, 64, 2048):
        x = torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
        residual = torch.randn_like(x)
        gate_up = torch.randn(tokens, 2 * intermediate, device=DEVICE, dtype=torch.bfloat16)
        qkv = torch.randn(tokens, 48 * 128, device=DEVICE, dtype=torch.bfloat16)
        q, k, _ = qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1)
        positions = torch.randint(0, 8192, (tokens,), device=DEVICE)
        pairs = {
            "rms_norm": (lambda: rms_norm(x, weight, 1e-5), lambda: rms_norm_native(x, weight, 1e-5)),
            "fused_add_rms_norm": (lambda: fused_add_rms_norm(x, residual, weight, 1e-5),
                                   lambda: fused_add_rms_norm_native(x, residual, weight, 1e-5)),
            "silu_and_mul": (lambda: silu_and_mul(gate_up), lambda: silu_and_mul_native(gate_up)),
            "rotary_embedding": (lambda: rotary_embedding(positions, q, k, cache, 128),
                                 lambda: rotary_native(positions, q, k, cache, 128)),
        }
        kv_cache = torch.randn(2, 2048, 16, 8, 128, device=DEVICE, dtype=torch.bfloat16)
        slots = torch.arange(tokens, device=DEVICE)
        v = qkv[:, 40 * 128:]

        def rotary_then_write():
            _, k_rot = rotary_embedding(positions, q, k, cache, 128)
            write_kv(k_rot.view(tokens, 8, 128), v.view(tokens, 8, 128), kv_cache, slots)

        # "native" here is the pair of kernels the fused launch replaces.
        pairs["rotary+kv_write"] = (lambda: rotary_embedding(positions, q, k, cache, 128, v, kv_cache, slots),
                                    rotary_then_write)
        if tokens <= 256:  # the logits of a decode batch
            logits = torch.randn(tokens, 128256, device=DEVICE)
            pairs["argmax"] = (lambda: argmax(logits), lambda: logits.argmax(dim=-1))
        for name, (kernel, native) in pairs.items():
            kernel_time, native_time = time_us(kernel), time_us(native)
            results.append({"op": name, "tokens": tokens,
                            **{f"triton_{k}": v for k, v in kernel_time.items()},
                            **{f"native_{k}": v for k, v in native_time.items()}})
    return results


# ---------------------------------------------------------------------------- report


def print_table(report: dict) -> None:
    print(f"\n{report['device']}  torch {report['torch']}  triton {report['triton']}  ({report['seconds']:.0f} s)")
    print("\nchecks")
    for r in report["elementwise_checks"]:
        print(f"  {r['kernel']:<28} {r['dtype']:<9} max|err| {r['max_abs_err']:.2e}  "
              f"rel {r['rel_err']:.2e}  {'ok' if r['ok'] else 'FAIL'}")
    print(f"  {'write_kv':<28} exact: {report['write_kv_check']['exact']}")
    s = report["attention_summary"]
    print(f"  {'paged_attention sweep':<28} {s['cases']} cases, max|err| {s['max_abs_err']:.2e}, "
          f"max rel {s['max_rel_err']:.2e} (limit {s['rel_err_limit']:.0e}), skipped {len(s['skipped_batches'])}: "
          f"{'ok' if s['all_ok'] else 'FAIL'}")
    g = report["cuda_graph_replay"]
    print(f"  {'cuda graph replay':<28} rel {g['other_batch']['rel_err']:.2e}  {'ok' if g['ok'] else 'FAIL'}")
    d = report["gumbel_draws"]
    print(f"  {'gumbel draws':<28} {' '.join(f'{f:.3f}' for f in d['frequencies'])} (softmax "
          f"{' '.join(f'{f:.3f}' for f in d['expected'])})  {'ok' if d['ok'] else 'FAIL'}")
    g = report["sampling_graphs"]
    print(f"  {'sampling graphs':<28} " + ", ".join(f"{k} {g[k]['equal_to_eager']}/{g[k]['rows']} as eager"
                                                   for k in ("A", "B", "mixed"))
          + f"; {g['graphs']} graph  {'ok' if g['ok'] else 'FAIL'}")
    print("\ndecode attention (32/8 heads, D=128, block 16, bf16)   us in graph   us launched   KV GB/s")
    for r in report["timings"]["decode_attention"]:
        print(f"  batch {r['batch']:>3} context {r['context']:>4} splits {r['kv_splits']:>2}"
              f"   {r['graph_us']:>10.1f}   {r['launch_us']:>11.1f}   {r['kv_read_gb_per_s']:>7.0f}")
    print("\nelementwise (bf16)            tokens   triton us (graph/launch)   native us (graph/launch)")
    for r in report["timings"]["elementwise"]:
        print(f"  {r['op']:<26} {r['tokens']:>6}   {r['triton_graph_us']:>8.1f} / {r['triton_launch_us']:>8.1f}"
              f"        {r['native_graph_us']:>8.1f} / {r['native_launch_us']:>8.1f}")


def check_and_time_kernels(out_dir) -> dict:
    start = time.perf_counter()
    torch.manual_seed(0)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    report["elementwise_checks"] = check_elementwise()
    report["write_kv_check"] = check_write_kv()
    attention, skipped = check_attention_sweep(deadline=start + SWEEP_BUDGET_S)
    report["attention_summary"] = summarize_attention(attention, skipped)
    report["attention_checks"] = attention
    report["cuda_graph_replay"] = check_cuda_graph_replay()
    report["gumbel_draws"] = check_gumbel_draws()
    report["scaled_sampling"] = check_scaled_sampling()
    report["sampling_graphs"] = check_sampling_graphs()
    report["timings"] = {"decode_attention": time_decode_attention(), "elementwise": time_elementwise()}
    report["all_checks_ok"] = (all(r["ok"] for r in report["elementwise_checks"])
                               and report["write_kv_check"]["exact"] and report["attention_summary"]["all_ok"]
                               and report["cuda_graph_replay"]["ok"] and report["gumbel_draws"]["ok"]
                               and report["scaled_sampling"]["ok"] and report["sampling_graphs"]["ok"])
    report["seconds"] = time.perf_counter() - start
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kernels.json").write_text(json.dumps(report, indent=1, default=str))
    return report


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("gpu_kernels.py needs a CUDA GPU")
    target = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "benchmarks/results")
    result = check_and_time_kernels(target)
    print_table(result)
    print(f"\nall checks ok: {result['all_checks_ok']}; wrote {Path(target) / 'kernels.json'}")
    sys.exit(0 if result["all_checks_ok"] else 1)
