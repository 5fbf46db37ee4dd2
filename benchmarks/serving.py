"""Online serving under Poisson arrivals through `kiln serve`, as `vllm bench serve` measures it, beside its floors.

    python benchmarks/serving.py --model llama-3-8b --device cuda --rates 2 8 32 --out $OUT     (the H200)
    python benchmarks/serving.py --rates 1 4 --num-prompts 6 --input-len 32 --output-len 8       (CPU smoke test)

This script starts `kiln serve` (extra flags: --server-args), then for each rate sends
--num-prompts requests whose arrival gaps are exponential with mean 1/rate (seeded): each a
streamed /v1/completions of --input-len random token ids (uniform over the vocabulary) that
must produce exactly --output-len tokens (ignore_eos), with vLLM's return_token_ids so every
step's tokens arrive in a chunk whether or not the model has a tokenizer. Per request, on
the client's clock: TTFT (send -> first token), TPOT ((last token - first token) / (tokens -
1)) and the gaps between chunks (ITL). Per rate: their p50 and p99, output tokens/s and
requests/s over the rate's wall time, lost requests (an error, a short answer), the five
slowest first tokens (which request, sent when after the rate's start) and the kernels Triton
compiled or loaded from its cache while the rate ran (server's /metrics; 0 when start-up
loaded every kernel a request needs).

Floors, measured in this process before the server starts (kiln bench's copy and matmul
rates): TTFT >= one prompt's prefill alone (its matmul FLOPs at the matmul rate, or the
weights at the copy rate, whichever is longer); TPOT >= one decode step at batch 1, and at each
rate >= a decode step at the concurrency that rate holds, beside the share of the matmul rate its
tokens need (floor.under_load, `load_floor`); output tokens/s <= what arrives (rate x
output-len). Writes --out/serving_<model>_<device>.json.
The HTTP client is a few lines of asyncio (no dependency beyond the standard library).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_process import ServerProcess  # noqa: E402

from kiln.config import EngineConfig  # noqa: E402
from kiln.loader import load_source  # noqa: E402
from kiln.tools.bench import Floor, floor_for, kv_bytes, matmul_params, measure_copy, measure_matmul  # noqa: E402
from kiln.tools.traffic import decode_weight_bytes  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a preset, .gguf or HF folder; default: the embedded SmolLM2")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rates", type=float, nargs="+", default=[2.0, 8.0, 32.0], help="requests per second")
    p.add_argument("--num-prompts", type=int, default=200, help="requests per rate")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--server-args", default="", help="more `kiln serve` flags, one string")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the server may take to be ready")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    return p.parse_args()


@dataclass
class Result:
    ok: bool
    error: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0
    end: float = 0.0


async def _read_chunked(reader: asyncio.StreamReader):
    """The body of a chunked HTTP/1.1 response, chunk by chunk."""
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            return
        data = await reader.readexactly(size)
        await reader.readexactly(2)  # the chunk's CRLF
        yield data


async def stream_request(port: int, body: dict, expected_tokens: int) -> Result:
    """POST one streamed completion and time its tokens as they arrive."""
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        payload = json.dumps(body).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(payload) + payload)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        if status != 200:
            return Result(False, f"HTTP {status}: {(await reader.read(500)).decode(errors='replace')}",
                          end=time.perf_counter())
        if headers.get("transfer-encoding") != "chunked":
            return Result(False, f"expected a chunked event stream, got headers {headers}", end=time.perf_counter())
        result, buffer, stamps, done = Result(True), b"", [], False
        async for data in _read_chunked(reader):
            buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                text = event.decode().removeprefix("data: ")
                if text == "[DONE]":
                    done = True
                    continue
                chunk = json.loads(text)
                if "error" in chunk:
                    return Result(False, str(chunk["error"]), end=time.perf_counter())
                new = sum(len(c.get("token_ids") or []) for c in chunk["choices"])
                if new:
                    stamps.append(time.perf_counter())
                    result.tokens += new
        result.end = time.perf_counter()
        if not done or result.tokens != expected_tokens:
            return Result(False, f"{result.tokens} tokens (expected {expected_tokens}), [DONE] {done}", end=result.end)
        result.ttft_s = stamps[0] - start
        if result.tokens > 1:
            result.tpot_s = (stamps[-1] - stamps[0]) / (result.tokens - 1)
        result.itl_s = [b - a for a, b in zip(stamps, stamps[1:])]
        return result
    except (OSError, ValueError, asyncio.IncompleteReadError) as e:
        return Result(False, f"{type(e).__name__}: {e}", end=time.perf_counter())
    finally:
        writer.close()


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    ordered = sorted(values)
    return {"p50": statistics.median(ordered), "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "mean": statistics.fmean(ordered)}


async def run_rate(port: int, model: str, rate: float, prompts: list[list[int]], args) -> dict:
    gaps = random.Random(args.seed).expovariate
    tasks, sent, start = [], [], time.perf_counter()
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": 1.0, "stream": True,
                "ignore_eos": True, "return_token_ids": True}
        sent.append(time.perf_counter() - start)
        tasks.append(asyncio.create_task(stream_request(port, body, args.output_len)))
        await asyncio.sleep(gaps(rate))
    results = await asyncio.gather(*tasks)
    # Which requests a p99 comes from: the first ones after start-up, or a burst of arrivals.
    slowest = sorted((i for i, r in enumerate(results) if r.ok), key=lambda i: -results[i].ttft_s)[:5]
    wall = max(r.end for r in results) - start
    good = [r for r in results if r.ok]
    output_tokens = sum(r.tokens for r in good)
    return {"rate": rate, "requests": len(results), "completed": len(good), "lost": len(results) - len(good),
            "errors": sorted({r.error for r in results if not r.ok})[:5], "wall_s": wall,
            "requests_per_s": len(good) / wall, "output_tokens_per_s": output_tokens / wall,
            "offered_output_tokens_per_s": rate * args.output_len,
            "ttft_s": percentiles([r.ttft_s for r in good]),
            "slowest_ttft": [{"request": i, "sent_s": sent[i], "ttft_s": results[i].ttft_s} for i in slowest],
            "tpot_s": percentiles([r.tpot_s for r in good if r.tpot_s is not None]),
            "itl_s": percentiles([g for r in good for g in r.itl_s])}


def floors(args) -> dict:
    source = load_source(args.model)
    cfg = source.config
    dtype = EngineConfig(model=args.model, device=args.device).torch_dtype  # what the server will run in
    elem = torch.empty(0, dtype=dtype).element_size()
    floor = Floor(measure_copy(args.device, dtype), measure_matmul(args.device, dtype), decode_weight_bytes(cfg, elem))
    prefill_s = max(2 * matmul_params(cfg) * args.input_len / floor.matmul_flops_per_s,
                    floor.weight_bytes / floor.copy_bytes_per_s)
    step = floor_for(cfg, elem, floor, 1, args.input_len + args.output_len / 2)
    return {"vocab_size": cfg.vocab_size, "dtype": str(dtype).removeprefix("torch."),
            "copy_bytes_per_s": floor.copy_bytes_per_s, "matmul_flops_per_s": floor.matmul_flops_per_s,
            "weight_bytes": floor.weight_bytes, "ttft_s": prefill_s, "tpot_s": step["step_ms"] / 1e3,
            "under_load": {rate: load_floor(cfg, elem, floor, rate, args.input_len, args.output_len,
                                            step["step_ms"] / 1e3) for rate in args.rates}}


def load_floor(cfg, elem: int, floor: Floor, rate: float, input_len: int, output_len: int,
               alone_s: float) -> dict:
    """What `rate` requests a second ask of the device in steady state. `compute_fraction`: the
    share of the matmul rate their tokens' matmuls take (prompt tokens without the LM head).
    `tpot_s`: the floor of a decode step at the concurrency the rate then holds (Little's law:
    rate x output_len x step sequences decoding), each step reading the weights and those
    sequences' KV caches, with the prompts' matmuls hidden under the reads, and never below
    `alone_s`, one sequence's step; None where either share reaches 1 (the queue grows without
    bound)."""
    head = cfg.vocab_size * cfg.hidden_size
    flops = 2 * (input_len * (matmul_params(cfg) - head) + output_len * matmul_params(cfg))
    compute_fraction = rate * flops / floor.matmul_flops_per_s
    per_sequence = kv_bytes(cfg, elem, input_len + output_len / 2)  # its cache at its mean context
    # Seconds of KV reads each second of decode steps: each sequence decoding reads its cache once a step.
    kv_share = rate * output_len * per_sequence / floor.copy_bytes_per_s
    tpot = None
    if compute_fraction < 1 and kv_share < 1:
        # The step's length sets how many sequences decode in it, which set its reads (and, for a
        # mixture of experts, how many experts it reads): iterate to the fixed point.
        tpot = alone_s
        for _ in range(200):
            batch = max(1.0, rate * output_len * tpot)
            weights = decode_weight_bytes(cfg, elem, math.ceil(batch)) if cfg.num_experts else floor.weight_bytes
            step = max(alone_s, (weights + batch * per_sequence) / floor.copy_bytes_per_s)
            if abs(step - tpot) <= 1e-12:
                break
            tpot = step
    return {"compute_fraction": compute_fraction, "kv_read_fraction": kv_share, "tpot_s": tpot}


def triton_kernels(server: ServerProcess) -> dict[str, float]:
    """The server's counts of kernels Triton compiled and loaded from its cache, from /metrics."""
    metrics = server.metrics()
    return {kind: metrics[f"kiln_triton_kernels_{kind}_total"] for kind in ("compiled", "cached")}


def main() -> int:
    args = parse_args()
    bound = floors(args)
    g = torch.Generator().manual_seed(args.seed)
    server_args = ["--device", args.device, *shlex.split(args.server_args)]
    if args.model:
        server_args = ["--model", args.model, *server_args]
    server = ServerProcess(*server_args)
    report = {"model": args.model or "smollm2", "device": args.device, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              "workload": {k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len", "seed",
                                                          "server_args")},
              "floor": bound, "rates": [], "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"serving_{args.model or 'smollm2'}_{args.device}.json"
    try:
        server.wait_ready(args.timeout)
        report["server_ready_s"] = server.ready_s
        model = server.get("/v1/models")[1]["data"][0]["id"]
        for rate in args.rates:
            prompts = torch.randint(0, bound["vocab_size"], (args.num_prompts, args.input_len), generator=g).tolist()
            kernels_before = triton_kernels(server)
            r = asyncio.run(run_rate(server.port, model, rate, prompts, args))
            # Kernels Triton compiled or loaded while serving: a first-call cost start-up left to a request.
            r["triton_kernels_while_serving"] = {k: v - kernels_before[k] for k, v in triton_kernels(server).items()}
            report["rates"].append(r)
            ms = lambda d, k: f"{d[k] * 1e3:7.1f}" if d[k] is not None else "      -"  # noqa: E731
            load = bound["under_load"][rate]
            at_load = (f"{load['tpot_s'] * 1e3:.2f} at this load" if load["tpot_s"] is not None
                       else "none at this load")
            print(f"rate {rate:6.2f}/s: {r['completed']}/{r['requests']} done, {r['output_tokens_per_s']:8.1f} output "
                  f"tok/s (arriving {r['offered_output_tokens_per_s']:.0f}), TTFT p50 {ms(r['ttft_s'], 'p50')} p99 "
                  f"{ms(r['ttft_s'], 'p99')} ms (floor {bound['ttft_s'] * 1e3:.1f}), TPOT p50 {ms(r['tpot_s'], 'p50')} "
                  f"p99 {ms(r['tpot_s'], 'p99')} ms (floor {bound['tpot_s'] * 1e3:.2f}, {at_load}, matmuls "
                  f"{load['compute_fraction']:.0%} of the device), ITL p99 "
                  f"{ms(r['itl_s'], 'p99')} ms" + (f"; errors: {r['errors']}" if r["errors"] else "")
                  + "".join(f"\n    slow first token: request {x['request']} sent at {x['sent_s']:.2f} s, "
                            f"{x['ttft_s'] * 1e3:.1f} ms" for x in r["slowest_ttft"][:2]), flush=True)
            path.write_text(json.dumps(report, indent=1))  # after every rate: a cut run keeps what it measured
    finally:
        server.stop()
    print(f"wrote {path}")
    return 0 if all(r["lost"] == 0 for r in report["rates"]) else 1


if __name__ == "__main__":
    sys.exit(main())
