"""Which matmul wins at Llama-3-8B's decode sizes: cuBLAS, cuBLASLt or Triton (a benchmark, not a test).

    python benchmarks/gemm_choices.py --out DIR                       (the H200, ~3-5 min)
    python benchmarks/gemm_choices.py --rows 64 256 --impls cublas cublaslt --out DIR

For each weight shape (qkv, o_proj, gate_up, down, lm_head) and row count M, each
implementation is timed by decode_attention.time_step (a CUDA graph of 32 back-to-back calls
cycling through weight copies that together overflow L2), and checked against an fp32 matmul:
- cublas: F.linear as torch calls it (cuBLAS);
- cublaslt: the same through cuBLASLt (kiln.ops.triton.gemv.cublaslt_linear, which the GEMV
  table may pick at 17-64 rows);
- triton: Inductor's max-autotune over its Triton matmul templates only (persistent TMA
  templates on), compiled for exactly this (M, N, K).
Then the step: 32 layers' four matmuls plus lm_head per M, per implementation and with the
best one per shape, against the compute floor (FLOPs at the matmul rate measured here) and
the byte floor (weights over the copy rate).
Writes DIR/gemm_choices_cuda.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from decode_attention import time_step  # this script's folder is on sys.path
from kiln.ops.triton.gemv import cublaslt_linear
from kiln.tools.bench import measure_copy, measure_matmul

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
LAYER_COUNTS = {"qkv": 32, "o_proj": 32, "gate_up": 32, "down": 32, "lm_head": 1}
L2_FLUSH_BYTES = 256 << 20
REL_ERR_TOL = 5e-3


def rel_err(actual, expected) -> float:
    return ((actual.float() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def triton_linear():
    import torch._inductor.config as inductor_config

    inductor_config.max_autotune_gemm_backends = "TRITON"
    inductor_config.triton.enable_persistent_tma_matmul = True
    torch._dynamo.reset()
    return torch.compile(lambda x, w: F.linear(x, w), mode="max-autotune-no-cudagraphs", dynamic=False,
                         fullgraph=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--impls", nargs="+", default=["cublas", "cublaslt", "triton"])
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    a = p.parse_args()
    started = time.perf_counter()
    flops_rate, bytes_rate = measure_matmul("cuda", torch.bfloat16), measure_copy("cuda", torch.bfloat16)
    print(f"matmul {flops_rate / 1e12:.0f} TFLOP/s, copy {bytes_rate / 1e9:.0f} GB/s", flush=True)
    cases = []
    for name, (n, k) in SHAPES.items():
        copies = max(1, min(8, -(-L2_FLUSH_BYTES // (n * k * 2))))
        g = torch.Generator(device="cuda").manual_seed(n + k)
        weights = [(torch.randn(n, k, generator=g, device="cuda") * 0.02).bfloat16() for _ in range(copies)]
        for m in a.rows:
            x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
            ref = x.float() @ weights[0].float().T
            row = {"shape": name, "N": n, "K": k, "M": m, "flop": 2 * m * n * k, "bytes": 2 * (n * k + m * k + m * n)}
            for impl in a.impls:
                try:
                    fn = {"cublas": F.linear, "cublaslt": cublaslt_linear}.get(impl) or triton_linear()
                    compile_start = time.perf_counter()
                    err = rel_err(fn(x, weights[0]), ref)
                    if impl == "triton":
                        row["triton_compile_s"] = time.perf_counter() - compile_start
                    if not err <= REL_ERR_TOL:
                        raise AssertionError(f"rel err {err:.2e}")
                    seconds = time_step(lambda i, w=weights: fn(x, w[i]), len(weights))
                    row[f"{impl}_us"] = seconds * 1e6
                    row[f"{impl}_tflops"] = row["flop"] / seconds / 1e12
                    row[f"{impl}_gbps"] = row["bytes"] / seconds / 1e9
                except Exception as e:  # noqa: BLE001  record and go on
                    row[f"{impl}_error"] = f"{type(e).__name__}: {e}"[:300]
                    traceback.print_exc(limit=2)
            timed = {impl: row[f"{impl}_us"] for impl in a.impls if f"{impl}_us" in row}
            row["best"] = min(timed, key=timed.get) if timed else None
            floor_us = max(row["flop"] / flops_rate, row["bytes"] / bytes_rate) * 1e6
            row["floor_us"] = floor_us
            cases.append(row)
            print(f"{name:8s} M={m:4d} floor {floor_us:7.1f} us | " + " | ".join(
                f"{impl} {row[f'{impl}_us']:7.1f} us" if f"{impl}_us" in row else f"{impl} error" for impl in a.impls)
                + f" | best {row['best']}", flush=True)
        del weights
        torch.cuda.empty_cache()
    steps = []
    for m in a.rows:
        rows = {r["shape"]: r for r in cases if r["M"] == m}
        step = {"M": m, "floor_us": sum(LAYER_COUNTS[s] * rows[s]["floor_us"] for s in SHAPES)}
        for impl in a.impls + ["best"]:
            key = (lambda r: r.get(f"{r['best']}_us")) if impl == "best" else (lambda r: r.get(f"{impl}_us"))
            if all(key(rows[s]) is not None for s in SHAPES):
                step[f"{impl}_us"] = sum(LAYER_COUNTS[s] * key(rows[s]) for s in SHAPES)
        steps.append(step)
        print(f"step M={m}: floor {step['floor_us']:.0f} us | " + " | ".join(
            f"{impl} {step[f'{impl}_us']:.0f}" for impl in a.impls + ["best"] if f"{impl}_us" in step), flush=True)
    out = Path(a.out) / "gemm_choices_cuda.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "matmul_flops_per_s": flops_rate,
            "copy_bytes_per_s": bytes_rate, "elapsed_s": time.perf_counter() - started}
    out.write_text(json.dumps({"info": info, "cases": cases, "step": steps}, indent=1))
    print(f"wrote {out} in {info['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
