"""`kiln serve` start-up time and behaviour under load (a benchmark, not a test): prints numbers, writes JSON.

    python benchmarks/server_load.py --out benchmarks/results

1. Start-up: starts `kiln serve` --startup-runs times (default 2, one after the other) and
   times process start -> port answering -> /health 200, with the phases /health reports.
   The second run is the "warm" one: once the compile cache exists it is what a cache hit
   costs; until then both runs do the same eager start.
2. Load: against the last server started, --concurrency (64) clients each send streaming
   chat requests back to back for --duration seconds, then wait for their last one.
   Reports output tokens/s, requests/s, p50/p99 time to first token, p50 time per output
   token, and lost requests (an error, or a stream that ended without a finish reason).

    python benchmarks/server_load.py --url http://127.0.0.1:8000 --startup-runs 0   (a running server)

3. With --chaos (a server this script started): of the clients, every third disconnects after
   a random number of chunks and every fifth sends malformed bodies (expecting a 4xx), one
   request body of --max-request-bytes + 1 is sent, and /health is polled every 50 ms
   throughout (its p50/p99 latency reported). After the load: the KV blocks still in use
   once nothing runs (a leak if not 0), then SIGTERM during a last wave of streams, each of
   which must finish or end with an error event; the process's exit time after the signal.

    python benchmarks/server_load.py --chaos --concurrency 256 --duration 30 --max-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_process import ServerProcess  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
    "Give me three tips for learning Python.", "What causes the seasons on Earth?",
    "Describe a cat to someone who has never seen one.", "Why is the sky blue?", "Tell me a short story.",
]


@dataclass
class RequestResult:
    ok: bool
    error: str | None
    start: float
    first_token: float | None
    end: float
    completion_tokens: int


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def measure_startup(runs: int, server_args: list[str]) -> tuple[list[dict], ServerProcess | None]:
    results, server = [], None
    for run in range(runs):
        if server is not None:
            server.stop()
        server = ServerProcess(*server_args).wait_ready()
        _, health = server.get("/health")
        results.append({"run": run + 1, "port_open_s": round(server.port_open_s, 2),
                        "health_200_s": round(server.ready_s, 2), "phases_s": health["phases_s"],
                        "engine_ready_s": round(health["ready_s"], 2)})
        print(f"start-up run {run + 1}: port answers after {server.port_open_s:.2f} s, /health 200 after "
              f"{server.ready_s:.2f} s (engine phases: "
              + ", ".join(f"{k} {v:.2f} s" for k, v in health["phases_s"].items()) + ")")
    return results, server


async def one_request(client: openai.AsyncOpenAI, model: str, question: str, max_tokens: int) -> RequestResult:
    start = time.perf_counter()
    first, finish, tokens = None, None, 0
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
            temperature=0.7, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices:
                if first is None and chunk.choices[0].delta.content:
                    first = time.perf_counter()
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except openai.APIError as e:
        return RequestResult(False, str(e), start, first, time.perf_counter(), tokens)
    ok = finish is not None and tokens > 0
    return RequestResult(ok, None if ok else "stream ended without a finish reason", start, first,
                         time.perf_counter(), tokens)


async def run_load(url: str, model: str, concurrency: int, duration_s: float, max_tokens: int) -> dict:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    results: list[RequestResult] = []
    begin = time.perf_counter()

    async def worker(i: int):
        n = 0
        while time.perf_counter() - begin < duration_s:
            results.append(await one_request(client, model, QUESTIONS[(i + n) % len(QUESTIONS)], max_tokens))
            n += 1

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    wall = time.perf_counter() - begin
    await client.close()
    done = [r for r in results if r.ok]
    ttft = [r.first_token - r.start for r in done if r.first_token is not None]
    tpot = [(r.end - r.first_token) / (r.completion_tokens - 1) for r in done
            if r.first_token is not None and r.completion_tokens > 1]
    tokens = sum(r.completion_tokens for r in done)
    errors = sorted({r.error for r in results if not r.ok})
    return {"concurrency": concurrency, "duration_s": duration_s, "wall_s": round(wall, 2),
            "max_tokens": max_tokens, "requests": len(results), "completed": len(done),
            "lost": len(results) - len(done), "errors": errors[:5], "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / wall, 1), "requests_per_s": round(len(done) / wall, 3),
            "ttft_p50_s": round(percentile(ttft, 50), 3), "ttft_p99_s": round(percentile(ttft, 99), 3),
            "tpot_p50_s": round(percentile(tpot, 50), 4), "tpot_p99_s": round(percentile(tpot, 99), 4)}


MALFORMED = [b"{not json", b'{"model": "smollm2"}', b'{"model": "smollm2", "messages": [], "max_tokens": -1}',
             b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
             b'{"model": "smollm2", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}']


async def chaos_request(client: openai.AsyncOpenAI, server: ServerProcess, model: str, i: int, n: int,
                        max_tokens: int, counts: dict) -> RequestResult | None:
    """Client i's n-th request: a malformed one (every fifth client), one it leaves early
    (every third), else a normal stream."""
    import random

    if i % 5 == 0:
        status, _ = await asyncio.to_thread(server.request, "POST", "/v1/chat/completions",
                                            MALFORMED[n % len(MALFORMED)], {"Content-Type": "application/json"})
        counts["malformed_4xx" if 400 <= status < 500 else "malformed_other"] += 1
        await asyncio.sleep(0.05)  # a client, not a flood
        return None
    if i % 3 == 0:
        stop_after = random.Random(i * 1000 + n).randint(1, max_tokens)
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": QUESTIONS[n % len(QUESTIONS)]}],
            max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True})
        seen = 0
        async for _ in stream:
            seen += 1
            if seen >= stop_after:
                break
        await stream.close()  # the connection closes: the server aborts the request
        counts["disconnected"] += 1
        return None
    return await one_request(client, model, QUESTIONS[(i + n) % len(QUESTIONS)], max_tokens)


async def run_chaos(server: ServerProcess, model: str, concurrency: int, duration_s: float, max_tokens: int,
                    max_request_bytes: int) -> dict:
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
    counts = {"malformed_4xx": 0, "malformed_other": 0, "disconnected": 0}
    results: list[RequestResult] = []
    health_s: list[float] = []
    begin = time.perf_counter()
    import threading

    done = threading.Event()

    async def poll_health():
        # In a thread of its own, so that this process's event loop (busy with the streams)
        # does not add to what is measured.
        def poll():
            while not done.is_set():
                start = time.perf_counter()
                server.request("GET", "/health")
                health_s.append(time.perf_counter() - start)
                time.sleep(0.05)

        await asyncio.to_thread(poll)

    async def worker(i: int):
        n = 0
        while time.perf_counter() - begin < duration_s:
            r = await chaos_request(client, server, model, i, n, max_tokens, counts)
            if r is not None:
                results.append(r)
            n += 1

    async def big_body():
        await asyncio.sleep(duration_s / 2)
        start = time.perf_counter()
        status, _ = await asyncio.to_thread(server.request, "POST", "/v1/completions", b"x" * (max_request_bytes + 1),
                                            {"Content-Type": "application/json"})
        counts["big_body_status"], counts["big_body_s"] = status, round(time.perf_counter() - start, 3)

    poller = asyncio.create_task(poll_health())
    await asyncio.gather(big_body(), *(worker(i) for i in range(concurrency)))
    await asyncio.sleep(1.0)  # aborts of the last disconnects reach the engine thread
    leaked = server.metrics().get("kiln_kv_blocks_in_use", float("nan"))
    # A last wave of streams, then SIGTERM while they run.
    wave = [asyncio.create_task(one_request(client, model, QUESTIONS[i % len(QUESTIONS)], 10 * max_tokens))
            for i in range(min(concurrency, 32))]
    await asyncio.sleep(2.0)
    done.set()
    await poller
    signalled = time.perf_counter()
    server.proc.send_signal(signal.SIGTERM)
    ended = await asyncio.gather(*wave)
    exit_code = await asyncio.to_thread(server.proc.wait, 120)
    exit_s = time.perf_counter() - signalled
    await client.close()
    ok = [r for r in results if r.ok]
    return {"concurrency": concurrency, "duration_s": duration_s, "max_tokens": max_tokens, **counts,
            "streams": len(results), "streams_completed": len(ok), "streams_lost": len(results) - len(ok),
            "errors": sorted({r.error for r in results if not r.ok})[:5],
            "kv_blocks_in_use_after": leaked,
            "health_p50_ms": round(1e3 * percentile(health_s, 50), 1),
            "health_p99_ms": round(1e3 * percentile(health_s, 99), 1), "health_polls": len(health_s),
            "sigterm_wave": len(wave), "sigterm_wave_finished": sum(r.ok for r in ended),
            "sigterm_wave_error_event": sum(not r.ok and r.error is not None and "stream ended" not in r.error
                                            for r in ended),
            "sigterm_wave_cut": sum(not r.ok and r.error is not None and "stream ended" in r.error for r in ended),
            "exit_code": exit_code, "exit_after_sigterm_s": round(exit_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default=None, help="load an already running server instead of starting one")
    parser.add_argument("--model", default="smollm2", help="the served model name")
    parser.add_argument("--startup-runs", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds during which requests are sent")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--chaos", action="store_true", help="disconnects, malformed bodies, a large body, "
                        "/health latency, leaked blocks and a SIGTERM at the end (see the module's doc)")
    parser.add_argument("--shutdown-timeout", type=float, default=5.0, help="with --chaos")
    parser.add_argument("server_args", nargs="*", help="extra `kiln serve` arguments (after --)")
    args = parser.parse_args()
    if args.chaos:
        server = ServerProcess("--model", args.model, "--shutdown-timeout", str(args.shutdown_timeout),
                               *args.server_args).wait_ready()
        try:
            chaos = asyncio.run(run_chaos(server, args.model, args.concurrency, args.duration, args.max_tokens,
                                          4 << 20))
        finally:
            server.stop()
        print(json.dumps(chaos, indent=1))
        out = Path(args.out) / "server_chaos.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"machine": platform.machine(), "cpus": os.cpu_count(),
                                   "when": time.strftime("%Y-%m-%d %H:%M:%S"), "model": args.model, **chaos},
                                  indent=2))
        print(f"wrote {out}")
        return
    result = {"machine": platform.machine(), "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
              "model": args.model, "mode": "eager (no compile yet, so no compile cache: every start is cold)"}
    server = None
    try:
        if args.url is None:
            runs = max(args.startup_runs, 1)
            result["startup"], server = measure_startup(runs, ["--model", args.model, *args.server_args])
            url = server.url
        else:
            url = args.url
        load = asyncio.run(run_load(url, args.model, args.concurrency, args.duration, args.max_tokens))
    finally:
        if server is not None:
            server.stop()
    result["load"] = load
    print(f"load: {load['concurrency']} concurrent streams for {load['duration_s']:.0f} s "
          f"({load['wall_s']:.0f} s with the last requests): {load['completed']} requests completed, "
          f"{load['lost']} lost; {load['output_tokens_per_s']} output tokens/s, {load['requests_per_s']} "
          f"requests/s; time to first token p50 {load['ttft_p50_s']} s, p99 {load['ttft_p99_s']} s; "
          f"time per output token p50 {load['tpot_p50_s']} s")
    out = Path(args.out) / "server_load.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    if load["lost"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
