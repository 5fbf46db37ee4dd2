"""The Triton skinny matmul (kiln/ops/triton/gemv.py) against cuBLAS at Llama-3-8B decode shapes.

    python benchmarks/gemv.py --out DIR                 (the H200: one device call, ~2-3 min)
    python benchmarks/gemv.py --out DIR --device cpu    (smoke test: tiny shapes, interpreter)

For each weight shape (N, K) and each row count M in 1, 2, 4, 8, 16, 32, 64 (a shape kiln's
table has no config for is autotuned first, as kiln prewarm does):
- correctness in bf16 (fp16 in the CPU smoke test): cuBLAS (F.linear) and the kernel against an fp32 matmul of the same
  bf16 inputs; the kernel passes when its error, ||y - ref|| / ||ref||, is at most
  REL_ERR_TOL (bf16 output rounding alone is ~2e-3);
- time: each implementation replayed in a CUDA graph of CALLS back-to-back calls (launch
  overhead amortised as in a decode graph), cycling through enough copies of W that none
  is still in L2 from the call before (a decode step reads every weight once); the
  graph's outputs are checked again after the replays (split-K counters must survive them);
- microseconds per call, GB/s ((W + x + y) bytes / time), cuBLAS time / kernel time, and
  the config the autotuner picked. At M = 1, 2 and 4 the other kernel (dot / fma) is timed
  too, to check the FMA_MAX_ROWS threshold.
- for the down projection, also the MLP's activation with it, as the engine runs it: kiln's
  gated GEMV (silu(gate) * up computed in its loads; `gated_us`) against the SiLU kernel
  followed by the GEMV or cuBLAS (`unfused_us`), both through gemv.linear's choice.

Then the decode step of Llama-3-8B (32 layers x qkv, o, gate_up, down, plus lm_head) at
M = 1, 8 and 64, summed from the per-shape times, against the floor: its 15.0 GB of weights
over the copy bandwidth measured here (a large device-to-device copy, read + write bytes).

Prints a table and writes DIR/gemv_cuda.json (gemv_cpu.json for the smoke test). A failure
(compile error, mismatch) is recorded for its case and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
CPU_SHAPES = {"qkv": (96, 64), "o_proj": (64, 64), "gate_up": (200, 64), "down": (64, 224), "lm_head": (500, 64)}
ROWS = [1, 2, 4, 8, 16, 32, 64]
NUM_LAYERS = 32
CALLS = 20  # matmuls per captured graph
REPLAYS = 10
L2_FLUSH_BYTES = 256 << 20  # weight copies per shape add up to at least this (H200 L2: 50 MB)
REL_ERR_TOL = 5e-3


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    return parser.parse_args()


args = parse_args()
if args.device == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kiln.ops.triton import gemv, gemv_configs  # noqa: E402
from kiln.ops.triton.activation import silu_and_mul  # noqa: E402

DEVICE = torch.device(args.device)
# The interpreter's tl.dot multiplies bf16 as raw integers (tests/test_triton_kernels.py), so
# the CPU smoke test runs in fp16.
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16


def _patch_interpreter() -> None:
    """As tests/test_triton_kernels.py does: Triton 3.6's interpreter turns a 1-element
    array into a loop bound with int(), which numpy >= 2.4 rejects (triton-lang/triton#9171)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def time_per_call(fn, weights, x) -> tuple[float, list]:
    """Seconds per call of fn(x, w) over CALLS calls cycling through `weights`; also the
    outputs of the last len(weights) calls (from the graph on CUDA)."""
    order = [weights[i % len(weights)] for i in range(CALLS)]
    if DEVICE.type != "cuda":  # the smoke test: wall time of the interpreter, not meaningful
        start = time.perf_counter()
        outs = [fn(x, w) for w in order]
        return (time.perf_counter() - start) / CALLS, outs[-len(weights):]
    for w in weights:  # warm-up outside the capture: autotuning, compiles, allocations
        fn(x, w)
    sync()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            outs = [fn(x, w) for w in order]
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    sync()
    return start.elapsed_time(end) / 1e3 / (REPLAYS * CALLS), outs[-len(weights):]


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    n = (2 << 30) if DEVICE.type == "cuda" else (16 << 20)
    src, dst = torch.empty(n, dtype=torch.uint8, device=DEVICE), torch.empty(n, dtype=torch.uint8, device=DEVICE)
    src.fill_(1)
    times = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - start)
    times.sort()
    return 2 * n / times[len(times) // 2]


def config_str(config) -> str | None:
    if config is None:
        return None
    kw = config.kwargs
    return (f"BLOCK_N={kw['BLOCK_N']} BLOCK_K={kw['BLOCK_K']} SPLIT_K={kw['SPLIT_K']} "
            f"warps={config.num_warps} stages={config.num_stages}")


def bench_case(name, n, k, m, weights, results):
    dtype = DTYPE
    g = torch.Generator(device=DEVICE).manual_seed(m)
    x = torch.randn(m, k, generator=g, device=DEVICE).to(dtype)
    gate_up = None
    if name == "down":  # x is the activation of a gate_up output, which the gated impls take
        gate_up = (torch.randn(m, 2 * k, generator=g, device=DEVICE) * 3).to(dtype)
        x = silu_and_mul(gate_up)
    w0 = weights[0]
    ref = x.float() @ w0.float().T
    nbytes = (n * k + m * k + m * n) * 2
    row = {"shape": name, "N": n, "K": k, "M": m, "bytes": nbytes}
    row["cublas_rel_err"] = rel_err(F.linear(x, w0), ref)
    impls = {"cublas": F.linear, "triton": lambda x, w: gemv.skinny_matmul(x, w)}
    other = {1: "dot", 2: "fma", 4: "fma"}.get(m)
    if other:
        impls[f"triton_{other}"] = lambda x, w: gemv.skinny_matmul(x, w, kernel=other)
    if gate_up is not None:
        impls["gated"] = lambda x, w: gemv.linear(gate_up, w, activation="silu")
        impls["unfused"] = lambda x, w: gemv.linear(silu_and_mul(gate_up), w)
    for impl, fn in impls.items():
        try:
            if impl != "cublas":
                err = rel_err(fn(x, w0), ref)
                row[f"{impl}_rel_err"] = err
                if not err <= REL_ERR_TOL:
                    raise AssertionError(f"rel err {err:.2e} > {REL_ERR_TOL}")
            seconds, outs = time_per_call(fn, weights, x)
            # outs[i] came from weights[(CALLS - len(weights) + i) % len(weights)]
            for i, out in enumerate(outs):
                w = weights[(CALLS - len(weights) + i) % len(weights)]
                err = rel_err(out, x.float() @ w.float().T)
                if not err <= max(REL_ERR_TOL, 2 * row["cublas_rel_err"]):
                    raise AssertionError(f"after graph replay: rel err {err:.2e}")
            row[f"{impl}_us"] = seconds * 1e6
            row[f"{impl}_gbps"] = nbytes / seconds / 1e9
            if impl.startswith("triton"):
                kernel = impl.split("_")[1] if "_" in impl else gemv.choose_kernel(m)
                block_m = gemv.padded_rows(m, kernel)
                row[f"{impl}_config"] = config_str(
                    gemv.launch_config(DEVICE, n, k, block_m, dtype, kernel == "fma")
                    or gemv.chosen_config(m, n, k, dtype, kernel))
        except Exception as e:  # noqa: BLE001  record and go on
            row[f"{impl}_error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc(limit=3)
    if "cublas_us" in row and "triton_us" in row:
        row["speedup"] = row["cublas_us"] / row["triton_us"]
    if "gated_us" in row and "unfused_us" in row:
        row["gated_speedup"] = row["unfused_us"] / row["gated_us"]
    results.append(row)
    fmt = lambda key, spec: format(row[key], spec) if key in row else "-"  # noqa: E731
    print(f"{name:8s} {n:6d} {k:5d} {m:2d} | cuBLAS {fmt('cublas_us', '8.1f')} us {fmt('cublas_gbps', '6.0f')} GB/s"
          f" | triton {fmt('triton_us', '8.1f')} us {fmt('triton_gbps', '6.0f')} GB/s | x{fmt('speedup', '.3f')}"
          f" | err {fmt('triton_rel_err', '.1e')} | {row.get('triton_config') or row.get('triton_error', '')}"
          + (f" | {other}: {fmt(f'triton_{other}_us', '.1f')} us" if other else "")
          + (f" | SiLU fused {fmt('gated_us', '.1f')} us, apart {fmt('unfused_us', '.1f')} us"
             if gate_up is not None else ""), flush=True)


def main():
    if DEVICE.type == "cpu":
        _patch_interpreter()
    shapes = SHAPES if DEVICE.type == "cuda" else CPU_SHAPES
    start = time.perf_counter()
    info = {"device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu (interpreter)",
            "torch": torch.__version__, "dtype": str(DTYPE), "calls_per_graph": CALLS, "rel_err_tol": REL_ERR_TOL}
    import triton

    info["triton"] = triton.__version__
    bandwidth = copy_bandwidth()
    info["copy_bandwidth_gbps"] = bandwidth / 1e9
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)", flush=True)
    results = []
    for name, (n, k) in shapes.items():
        w_bytes = n * k * 2
        copies = max(1, min(8, -(-L2_FLUSH_BYTES // w_bytes))) if DEVICE.type == "cuda" else 1
        g = torch.Generator(device=DEVICE).manual_seed(n + k)
        weights = [(torch.randn(n, k, generator=g, device=DEVICE) * 0.02).to(DTYPE) for _ in range(copies)]
        with gemv_configs.tuning():
            for m in ROWS:
                bench_case(name, n, k, m, weights, results)
        del weights
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()

    # The decode step: 32 x (qkv + o_proj + gate_up + down) + lm_head.
    counts = {"qkv": NUM_LAYERS, "o_proj": NUM_LAYERS, "gate_up": NUM_LAYERS, "down": NUM_LAYERS, "lm_head": 1}
    step_bytes = sum(counts[name] * n * k * 2 for name, (n, k) in shapes.items())
    steps = []
    for m in (1, 8, 64):
        rows = {r["shape"]: r for r in results if r["M"] == m}
        step = {"M": m, "weight_bytes": step_bytes, "floor_us": step_bytes / bandwidth * 1e6}
        for impl in ("cublas", "triton"):
            if all(f"{impl}_us" in rows.get(name, {}) for name in counts):
                step[f"{impl}_us"] = sum(counts[name] * rows[name][f"{impl}_us"] for name in counts)
                step[f"{impl}_over_floor"] = step[f"{impl}_us"] / step["floor_us"]
        steps.append(step)
        print(f"decode step M={m}: {step_bytes / 1e9:.2f} GB, floor {step['floor_us']:.0f} us | "
              + " | ".join(f"{impl} {step[f'{impl}_us']:.0f} us ({step[f'{impl}_over_floor']:.3f}x floor)"
                           for impl in ("cublas", "triton") if f"{impl}_us" in step), flush=True)
    # What the autotuner picked for shapes kiln's table lacks, in the table's form.
    info["tuned"] = {f"{n},{k},{block_m}": gemv_configs.as_entry(c)
                     for (n, k, block_m, dtype), c in gemv.tuned_choices().items() if dtype == DTYPE}
    print("tuned:", json.dumps(info["tuned"]), flush=True)
    info["elapsed_s"] = time.perf_counter() - start
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"gemv_{DEVICE.type}.json"
    path.write_text(json.dumps({"info": info, "cases": results, "decode_step": steps}, indent=1))
    failures = [r for r in results if any(key.endswith("_error") for key in r)]
    print(f"wrote {path} in {info['elapsed_s']:.0f} s; {len(failures)} case(s) with errors")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
