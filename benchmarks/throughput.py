"""Offline throughput, as `vllm bench throughput --dataset-name random` measures it, beside its floor.

    python benchmarks/throughput.py --model llama-3-8b --device cuda --out $OUT        (the H200)
    python benchmarks/throughput.py --num-prompts 8 --input-len 32 --output-len 8      (CPU smoke test)

--num-prompts prompts of --input-len random token ids (uniform over the vocabulary, seeded)
go to one LLM.generate call together; each must produce exactly --output-len tokens
(ignore_eos, temperature 1.0 and top-p 1.0, as vLLM's benchmark samples). The clock runs
over generate() alone: the engine is started and ready before it, its graphs left for first use
captured (in startup_s). Reported: requests/s,
total (prompt + output) and output tokens/s, and the same work's floor.

The floor is what the hardware allows for this work, measured in the same run (the copy
and matmul rates kiln bench measures): every token's matmul FLOPs (2 x parameters, and
the causal attention over its context) at the matmul rate, and every decode step's weight
bytes (at least ceil(prompts / max_num_seqs) x output-len steps, each reading all weights
but the embedding table) plus the KV cache each decoded token reads, at the copy rate;
the floor is the larger of the two times. Prefill's weight reads and the KV writes are left
out: it is a bound, not a model. Writes --out/throughput_<model>_<device>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from kiln import LLM, SamplingParams
from kiln.ops.cpu import extension
from kiln.compile.config import CompilationConfig
from kiln.tools.bench import Floor, matmul_params, measure_copy, measure_matmul
from kiln.tools.traffic import decode_weight_bytes

# name -> LLM keyword arguments: the default start, and -O2
MODES = {"default": dict, "O2": lambda: dict(compilation=CompilationConfig.level(2))}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a preset, .gguf or HF folder; default: the embedded SmolLM2")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--modes", nargs="+", default=["default"], choices=sorted(MODES))
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    # vLLM's defaults for a throughput run on one H100/H200-class GPU.
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    return p.parse_args()


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def workload_floor(cfg, elem: int, floor: Floor, args) -> dict:
    """Seconds the hardware needs at least for the whole workload (see the module's doc)."""
    c, n, i, o = cfg, args.num_prompts, args.input_len, args.output_len
    per_token_context = c.num_layers * c.num_heads * c.head_dim
    # Causal attention: a token at position p does 4 * p * per_token_context FLOPs (q.k and p.v).
    prefill_attn = 4 * per_token_context * i * (i - 1) / 2
    decode_context = o * i + o * (o - 1) / 2  # positions the output tokens attend over, summed
    flops = n * (2 * matmul_params(cfg) * (i + o) + prefill_attn + 4 * per_token_context * decode_context)
    steps = math.ceil(n / args.max_num_seqs) * o
    kv_per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * elem
    nbytes = steps * floor.weight_bytes + n * decode_context * kv_per_token
    compute_s, memory_s = flops / floor.matmul_flops_per_s, nbytes / floor.copy_bytes_per_s
    seconds = max(compute_s, memory_s)
    return {"seconds": seconds, "bound": "compute" if compute_s >= memory_s else "memory", "compute_s": compute_s,
            "memory_s": memory_s, "flops": flops, "bytes": nbytes, "decode_steps_at_least": steps,
            "total_tokens_per_s": n * (i + o) / seconds, "output_tokens_per_s": n * o / seconds}


def run_mode(name: str, args) -> tuple[dict, object, torch.dtype]:
    """One mode's start and timed generate; also the model's config and dtype (for the floor)."""
    start = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, **MODES[name]())
    # The mixed-batch graphs a start leaves for first use count as start-up here (as an idle
    # server takes them), so that the timed run is the steady state.
    while llm.engine.capture_deferred_graph():
        pass
    startup_s = time.perf_counter() - start
    cfg, dtype = llm.engine.source.config, llm.engine.config.torch_dtype
    prompts = random_prompts(args.num_prompts, args.input_len, cfg.vocab_size, args.seed)
    params = SamplingParams(max_tokens=args.output_len, temperature=1.0, top_p=1.0, ignore_eos=True)
    if args.device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = [len(o.outputs[0].token_ids) for o in outputs]
    if any(p != args.output_len for p in produced):
        raise AssertionError(f"{name}: outputs of {min(produced)}-{max(produced)} tokens, expected "
                             f"{args.output_len} each (ignore_eos)")
    describe = llm.engine.runner.compiled.describe()
    llm.shutdown()
    del llm
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    n = len(prompts)
    return ({"mode": name, "describe": describe, "startup_s": startup_s, "elapsed_s": elapsed,
             "requests_per_s": n / elapsed, "total_tokens_per_s": n * (args.input_len + args.output_len) / elapsed,
             "output_tokens_per_s": n * args.output_len / elapsed}, cfg, dtype)


def main() -> int:
    args = parse_args()
    if args.device == "cpu":
        extension.build()  # the C++ attention a deployment has (kiln prewarm builds it)
    results, bound = [], None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"throughput_{args.model or 'smollm2'}_{args.device}.json"
    for name in args.modes:
        r, cfg, dtype = run_mode(name, args)
        if bound is None:  # measured once, between the modes' engines
            elem = torch.empty(0, dtype=dtype).element_size()
            floor = Floor(measure_copy(args.device, dtype), measure_matmul(args.device, dtype),
                          decode_weight_bytes(cfg, elem))
            bound = workload_floor(cfg, elem, floor, args)
        r["of_floor"] = r["total_tokens_per_s"] / bound["total_tokens_per_s"]
        results.append(r)
        print(f"{r['mode']:8s} {args.num_prompts} x {args.input_len} in / {args.output_len} out: "
              f"{r['elapsed_s']:7.2f} s, {r['requests_per_s']:7.2f} req/s, {r['total_tokens_per_s']:9.0f} tok/s "
              f"total, {r['output_tokens_per_s']:8.0f} output tok/s; floor {bound['total_tokens_per_s']:9.0f} "
              f"tok/s total ({bound['bound']}-bound): {r['of_floor']:.2f} of it; start-up {r['startup_s']:.1f} s",
              flush=True)
        # Written after every mode: a run cut short keeps what it measured.
        path.write_text(json.dumps({
            "model": args.model or "smollm2", "device": args.device, "dtype": str(dtype).removeprefix("torch."),
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "torch": torch.__version__,
            "workload": {k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len", "max_num_seqs",
                                                        "max_num_batched_tokens", "seed")},
            "floor": {"copy_bytes_per_s": floor.copy_bytes_per_s, "matmul_flops_per_s": floor.matmul_flops_per_s,
                      "weight_bytes": floor.weight_bytes, **bound},
            "modes": results, "when": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
