"""Host time of kiln's Triton op wrappers, their kernel launches left out (a benchmark, not a test).

    OMP_NUM_THREADS=1 python benchmarks/op_host_cost.py --out benchmarks/results

What an eager forward, a kernel-recording run and every CUDA-graph capture pay in Python per op
call before Triton's own launch: checks, output allocation, launch settings. Each wrapper runs on
CPU tensors of Llama-3-8B's shapes (bf16, one token and 64) with its kernels replaced by a no-op,
so only the wrapper's own work is timed; no GPU is needed. An 8B forward calls the norms 65
times, the GEMV 129, rotary and attention 32 each. JSON: --out/op_host_cost.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kiln.forward_context import AttentionMetadata
from kiln.ops.triton import attention, gemv, norm, rotary


class _NoLaunch:
    """Stands in for a Triton kernel (and an autotuner, whose .fn.fn is the kernel): launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None

    @property
    def fn(self):
        return self


def stub_kernels() -> None:
    for module, names in ((norm, ("rms_norm_kernel", "fused_add_rms_norm_kernel")),
                          (attention, ("paged_attention_kernel", "write_kv_kernel")), (rotary, ("rotary_kernel",)),
                          (gemv, ("fma_kernel", "dot_kernel"))):
        for name in names:
            setattr(module, name, _NoLaunch())


def per_call_us(fn, calls: int) -> float:
    for _ in range(calls // 10):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def calls_for(tokens: int) -> dict:
    bf = torch.bfloat16
    hidden, heads, kv_heads, dim = 4096, 32, 8, 128
    x, residual, weight = torch.randn(tokens, hidden, dtype=bf), torch.randn(tokens, hidden, dtype=bf), torch.randn(hidden, dtype=bf)
    qkv_weight = torch.randn(6144, hidden, dtype=bf)
    positions = torch.zeros(tokens, dtype=torch.long)
    q, k, v = (torch.randn(tokens, n * dim, dtype=bf) for n in (heads, kv_heads, kv_heads))
    cos_sin = torch.randn(8192, dim)
    kv_cache = torch.zeros(2, 64, 16, kv_heads, dim, dtype=bf)
    slots = torch.arange(tokens)
    meta = AttentionMetadata(slot_mapping=slots, block_tables=torch.zeros(tokens, 8, dtype=torch.int32),
                             seq_lens=torch.full((tokens,), 100, dtype=torch.int32),
                             query_start_loc=torch.arange(tokens + 1, dtype=torch.int32), max_query_len=1,
                             max_seq_len=8192, num_actual_tokens=tokens)
    out = torch.empty(tokens, heads, dim, dtype=bf)
    calls = {
        "rms_norm": lambda: norm.rms_norm(x, weight, 1e-5),
        "fused_add_rms_norm": lambda: norm.fused_add_rms_norm(x, residual, weight, 1e-5),
        "rotary_kv_write": lambda: rotary.rotary_embedding(positions, q, k, cos_sin, dim, v, kv_cache, slots),
        "paged_attention_decode": lambda: attention.paged_attention(q.view(tokens, heads, dim), kv_cache, out, meta,
                                                                    dim ** -0.5),
    }
    if tokens <= gemv.MIN_DOT_ROWS:  # past it the shape's winner may be cuBLAS, not the kernel
        calls["gemv_linear"] = lambda: gemv.linear(x, qkv_weight)
    return calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    stub_kernels()
    torch.set_grad_enabled(False)
    rows = []
    for tokens in (1, 64):
        for name, fn in calls_for(tokens).items():
            us = per_call_us(fn, args.calls)
            rows.append({"op": name, "tokens": tokens, "host_us": us})
            print(f"{name:24s} {tokens:3d} token(s): {us:6.1f} us a call")
    if args.out:
        path = Path(args.out) / "op_host_cost.json"
        path.write_text(json.dumps({"torch": torch.__version__, "calls": args.calls, "rows": rows,
                                    "when": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
        print("wrote", path)


if __name__ == "__main__":
    main()
