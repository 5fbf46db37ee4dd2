"""kiln's decode beside a stock torch.compile loop, in one run (a benchmark, not a test).

    python benchmarks/decode_vs_reference.py --out $OUT                        (on the GPU)
    OMP_NUM_THREADS=1 python benchmarks/decode_vs_reference.py --device cpu --model tiny-llama \
        --batches 1 4 --reference-args --layers 2 --hidden 256                 (a smoke run)

Per kiln mode (`default`: the eager forward with full decode graphs; `O2`: piecewise Inductor,
kiln's GEMV kept for small batches, as -O2's default custom ops have it) and batch size, `batch`
sequences of `context` random tokens are prefilled, then decoded:

    engine_step_ms       LLMEngine.step, `steps` of them back to back (scheduling, packing,
                         forward, sampling, stop checks, outputs), no wait between them:
                         with async scheduling (the GPU default) the host prepares a step
                         while the GPU runs the one before
    sync_engine_step_ms  the same with async scheduling off: each step waits for its tokens
    *_median_ms, *_max_ms  the median and the slowest of those steps (wall time between step
                         returns): a one-off stall moves the mean, not the median
    *_full_collections   the garbage collector's full (oldest-generation) collections during
                         those steps, and *_full_collection_ms their time: the stall the engine's
                         frozen start-up heap (kiln.compile.gc_pause.freeze_heap) keeps short
    sampled_engine_step_ms  (--sampled) engine_step_ms with chat-style sampling instead of greedy
                         (temperature 0.8, top-k 50, top-p 0.95, unseeded): what sampling after
                         the graph's replay adds to a step
    forward_ms           the step's forward and logits alone, replayed on its own inputs
                         (CUDA-event timed)

Per mode, tokens_sha digests the greedy and seeded tokens of 8 prompts: two runs (e.g. KILN_PDL
on and off) with the same digest generated the same tokens.

Beside them (unless --no-reference) the stock loop of benchmarks/reference_decode.py (same shape,
context and batch, in a subprocess of this run): reference_step_ms is its loop left to run ahead
of the GPU, as kiln's engine steps are; its one-step-at-a-time time is kept too. floor_ms is what the
hardware allows (kiln.tools.bench: weights and KV bytes at the measured copy rate, FLOPs at
the measured matmul rate). JSON to --out/decode_vs_reference_<device>.json.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kiln import LLM, SamplingParams
from kiln.compile.config import CompilationConfig
from kiln.forward_context import set_forward_context
from kiln.loader import load_source
from kiln.tools.bench import Floor, floor_for, measure_copy, measure_matmul
from kiln.tools.traffic import decode_weight_bytes

ROOT = Path(__file__).resolve().parent.parent
# name -> LLM arguments
# "O2 native": -O2 with rotary and the activations left to Inductor (its CPU default, and its GPU
# default before 2026-12-04).
MODES = {"default": dict, "default sample-in-graph": lambda: dict(sample_in_graph=True),
         "O2": lambda: dict(compilation=CompilationConfig.level(2)),
         "O2 native": lambda: dict(compilation=CompilationConfig.level(2),
                                   custom_ops=["none", "+rms_norm", "+fused_add_rms_norm", "+skinny_linear"]),
         # Inductor's kernels launched dependently too (with KILN_PDL, kiln's own are).
         "O2 inductor-pdl": lambda: dict(compilation=CompilationConfig.level(
             2, inductor_compile_config={"triton.enable_pdl": True}))}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# --sampled: what a chat client typically asks for.
CHAT_SAMPLING = dict(temperature=0.8, top_k=50, top_p=0.95)


class FullCollections:
    """The oldest generation's collections while it is entered, and their time."""

    def __enter__(self):
        self.count, self.seconds, self._start = 0, 0.0, None
        gc.callbacks.append(self._record)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._record)

    def _record(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.count += 1
            self.seconds += time.perf_counter() - self._start


def measure_batch(llm: LLM, batch: int, args, sampling: dict | None = None) -> dict:
    """The engine step (both ways) and forward at `batch` greedy sequences; with `sampling`, only
    the overlapped engine step of sequences that sample so."""
    engine, runner = llm.engine, llm.engine.runner
    gen = torch.Generator().manual_seed(batch)
    vocab = engine.source.config.vocab_size
    params = SamplingParams(max_tokens=2 * (args.warmup + args.steps) + 16, ignore_eos=True,
                            **(sampling or dict(temperature=0)))
    ids = [engine.add_request(torch.randint(0, vocab, (args.context,), generator=gen).tolist(), params)
           for _ in range(batch)]
    seqs = [engine.seqs[i] for i in ids]
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
        engine.step()
    last = {}
    prepare = runner.prepare

    def recording_prepare(b):
        last["step"] = prepare(b)
        return last["step"]

    runner.prepare = recording_prepare
    result = {"batch": batch}
    try:
        # The same engine both ways: switching is safe between steps once nothing is in flight.
        ways = (("sampled_engine_step_ms", True),) if sampling else \
            (("engine_step_ms", True), ("sync_engine_step_ms", False))
        for key, overlapped in ways:
            engine.async_scheduling = overlapped
            for _ in range(args.warmup):
                engine.step()
            sync(args.device)
            start = time.perf_counter()
            ends = []
            with FullCollections() as collections:
                for _ in range(args.steps):
                    engine.step()
                    ends.append(time.perf_counter())
                sync(args.device)
            result[key] = (time.perf_counter() - start) / args.steps * 1e3
            # A one-off stall (a collection, a host hiccup) moves the mean of 30 steps by 1/30 of
            # itself: the median and the slowest step say whether one did.
            intervals = [1e3 * (b - a) for a, b in zip([start] + ends, ends)]
            result[key.replace("_ms", "_median_ms")] = statistics.median(intervals)
            result[key.replace("_ms", "_max_ms")] = max(intervals)
            result[key.replace("_ms", "_full_collections")] = collections.count
            result[key.replace("_ms", "_full_collection_ms")] = collections.seconds * 1e3
            engine.drain()
        if not sampling:
            result["mean_context"] = statistics.mean(s.num_computed_tokens for s in seqs) - args.steps / 2
            result["forward_ms"] = forward_ms(runner, last["step"], batch, args)
    finally:
        runner.prepare = prepare
        engine.async_scheduling = llm.engine.config.uses_async_scheduling
        for request_id in ids:
            engine.abort_request(request_id)
        while engine.has_unfinished():
            engine.step()
    return result


def async_tokens(llm: LLM) -> tuple[bool, str]:
    """Whether greedy and seeded tokens are the same with async scheduling on and off (same engine),
    8 prompts, and a digest of them (to compare runs: the same digest, the same tokens)."""
    gen = torch.Generator().manual_seed(7)
    vocab = llm.engine.source.config.vocab_size
    prompts = [torch.randint(0, vocab, (16 + 5 * i,), generator=gen).tolist() for i in range(8)]
    params = [SamplingParams(max_tokens=12 + i, temperature=0 if i % 2 else 0.8, seed=i, ignore_eos=True)
              for i in range(8)]
    # Prefix caching off for the check: the second run would take the first one's prompt blocks from
    # the cache, computed in another batch than a fresh prefill, and bf16 tells the two apart (seen on
    # the H200: half the requests differed, the same with async scheduling on in both runs).
    blocks = llm.engine.scheduler.block_manager
    caching, blocks.enable_prefix_caching = blocks.enable_prefix_caching, False
    runs = []
    for overlapped in (True, False):
        llm.engine.async_scheduling = overlapped
        runs.append([o.token_ids for o in llm.generate(prompts, params)])
    llm.engine.async_scheduling = llm.engine.config.uses_async_scheduling
    blocks.enable_prefix_caching = caching
    return runs[0] == runs[1], hashlib.sha256(json.dumps(runs[0]).encode()).hexdigest()[:16]


def forward_ms(runner, step, batch: int, args) -> float:
    """The forward (its CUDA graph where one was captured) and the logits of a recorded step."""
    def once():
        with set_forward_context(step.attn_metadata, runner.kv_caches):
            hidden, head = runner.cudagraphs.run(step.cudagraph, step.input_ids, step.positions)
        return head[0] if head is not None else runner.model.compute_logits(hidden[:batch])

    with torch.inference_mode():
        for _ in range(3):
            once()
        sync(args.device)
        start = time.perf_counter()
        for _ in range(args.steps):
            once()
        sync(args.device)
    return (time.perf_counter() - start) / args.steps * 1e3


def run_mode(name: str, args) -> dict:
    blocks = max(args.batches) * -(-(args.context + 2 * (args.warmup + args.steps) + 32) // 16) + 16
    start = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=max(args.batches),
              max_num_batched_tokens=2048, max_model_len=args.context + 2 * (args.warmup + args.steps) + 32,
              num_kv_blocks=blocks, **MODES[name]())
    out = {"startup_s": time.perf_counter() - start, "describe": llm.engine.runner.compiled.describe(),
           "async_scheduling": llm.engine.async_scheduling, "points": []}
    out["async_tokens_match"], out["tokens_sha"] = async_tokens(llm)
    print(f"{name}: async and synchronous tokens {'match' if out['async_tokens_match'] else 'DIFFER'}", flush=True)
    for batch in args.batches:
        point = measure_batch(llm, batch, args)
        if args.sampled:
            point.update(measure_batch(llm, batch, args, CHAT_SAMPLING))
        out["points"].append(point)
        print(f"{name:8s} b{batch:<4d} engine step {point['engine_step_ms']:6.2f} ms (median "
              f"{point['engine_step_median_ms']:6.2f}, slowest {point['engine_step_max_ms']:6.2f}, full collections "
              f"{point['engine_step_full_collections']}; sync "
              f"{point['sync_engine_step_ms']:6.2f}"
              + (f", sampled {point['sampled_engine_step_ms']:6.2f}" if args.sampled else "")
              + f"), forward+logits {point['forward_ms']:6.2f} ms", flush=True)
    llm.shutdown()
    del llm
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def reference(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(ROOT / "benchmarks" / "reference_decode.py"), "--device", args.device,
               "--context", str(args.context), "--steps", str(args.steps), "--out", tmp,
               "--batches", *map(str, args.batches), *args.reference_args]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
        print(done.stdout.strip(), flush=True)
        report = json.loads((Path(tmp) / f"reference_decode_{args.device}.json").read_text())
    return {r["batch"]: r for r in report["results"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--dtype", default=None)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--modes", nargs="+", default=["default", "O2"], choices=list(MODES))
    p.add_argument("--sampled", action="store_true",
                   help=f"also time the engine step with sampling {CHAT_SAMPLING} instead of greedy")
    p.add_argument("--no-reference", action="store_true", help="time kiln's modes alone")
    p.add_argument("--reference-args", nargs=argparse.REMAINDER, default=[],
                   help="passed on to reference_decode.py (e.g. a smaller shape for a CPU smoke run)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    modes = {name: run_mode(name, args) for name in args.modes}
    ref = {} if args.no_reference else reference(args)
    cfg = load_source(args.model).config
    dtype = getattr(torch, args.dtype)
    elem = torch.empty(0, dtype=dtype).element_size()
    floor = Floor(measure_copy(args.device, dtype), measure_matmul(args.device, dtype), decode_weight_bytes(cfg, elem))
    for name, mode in modes.items():
        for point in mode["points"]:
            b = point["batch"]
            point["floor_ms"] = floor_for(cfg, elem, floor, b, point["mean_context"])["step_ms"]
            r = ref.get(b, {})
            point["reference_step_ms"] = r.get("loop_step_ms")
            point["reference_synced_step_ms"] = r.get("step_ms")
            if point["reference_step_ms"]:
                point["vs_reference"] = point["reference_step_ms"] / point["engine_step_ms"]
            print(f"{name:8s} b{b:<4d} engine {point['engine_step_ms']:6.2f} ms, reference "
                  f"{point['reference_step_ms'] or float('nan'):6.2f} ms, floor {point['floor_ms']:6.2f} ms"
                  + (f", {point['vs_reference']:.2f}x the reference's speed" if "vs_reference" in point else ""))
    report = {"model": args.model, "device": args.device, "dtype": args.dtype, "context": args.context,
              "steps": args.steps, "sampling": CHAT_SAMPLING if args.sampled else None, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              "floor": {"copy_bytes_per_s": floor.copy_bytes_per_s, "matmul_flops_per_s": floor.matmul_flops_per_s,
                        "weight_bytes": floor.weight_bytes},
              "modes": modes, "reference": ref if "error" in ref else {"per_batch": list(ref.values())},
              "kiln_pdl": os.environ.get("KILN_PDL"),
              "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.out:
        path = Path(args.out) / f"decode_vs_reference_{args.device}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
