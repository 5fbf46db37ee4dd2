"""Prometheus metrics of one server (its own registry, so one process may run several).

Latencies are observed as requests run. Engine state (running and waiting requests, KV
blocks) and start-up numbers (phase seconds, compile cache counters) are read when
/metrics is scraped, from the engine thread's last snapshot and the start-up timeline.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kiln.compile.cache import triton_kernels
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.outputs import RequestOutput

# Timeline phases that count as compilation and as graph capture. Phases with other names
# still appear, under kiln_startup_phase_seconds.
COMPILE_PHASES = ("dynamo", "split", "inductor", "cache_load")
CAPTURE_PHASES = ("cudagraphs",)

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self, engine: AsyncEngine):
        self.registry = CollectorRegistry()
        self.ttft = Histogram("kiln_time_to_first_token_seconds",
                              "Seconds from a request's arrival to its first output token",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("kiln_time_per_output_token_seconds",
                              "Seconds per output token after the first, per finished request",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.requests = Counter("kiln_requests", "Requests that ran, by endpoint and finish reason "
                                "(stop, length, abort: client gone or shutdown)",
                                ["endpoint", "finish_reason"], registry=self.registry)
        self.prompt_tokens = Counter("kiln_prompt_tokens", "Prompt tokens of requests that ran (counted as "
                                     "they end)", registry=self.registry)
        self.generation_tokens = Counter("kiln_generation_tokens", "Output tokens generated",
                                         registry=self.registry)
        self.registry.register(_EngineCollector(engine))

    def timer(self, endpoint: str, num_prompt_tokens: int) -> "RequestTimer":
        return RequestTimer(self, endpoint, num_prompt_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """One request's latencies, fed every output the client receives."""

    def __init__(self, metrics: ServerMetrics, endpoint: str, num_prompt_tokens: int):
        self.metrics, self.endpoint = metrics, endpoint
        self.start = time.perf_counter()
        self.num_prompt_tokens = num_prompt_tokens
        self.first_token: float | None = None
        self.num_tokens = 0
        self.done = False

    def output(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        total = sum(len(c.token_ids) for c in out.outputs)  # every choice's (n > 1)
        self.metrics.generation_tokens.inc(total - self.num_tokens)
        self.num_tokens = total
        if self.first_token is None and total:
            self.first_token = now
            self.metrics.ttft.observe(now - self.start)
        if out.finished:
            longest = max(len(c.token_ids) for c in out.outputs)  # the choices run side by side
            if longest > 1:
                self.metrics.tpot.observe((now - self.first_token) / (longest - 1))
            self._finish(out.finish_reason)

    def aborted(self) -> None:
        if not self.done:
            self._finish("abort")

    def _finish(self, reason: str) -> None:
        self.done = True
        self.metrics.requests.labels(self.endpoint, reason).inc()
        self.metrics.prompt_tokens.inc(self.num_prompt_tokens)


def _compile_cache_counters(engine) -> tuple[int, int]:
    """(hits, misses) from the compile monitors of the runner's compiled forwards."""
    counters = [compiled.monitor.counters for compiled in engine.runner.compiled_forwards]
    return sum(c.cache_hits for c in counters), sum(c.cache_misses for c in counters)


class _EngineCollector:
    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self):
        stats, timeline = self.engine.stats, self.engine.timeline
        yield _gauge("kiln_ready", "1 once the model is loaded, compiled and captured and requests are served",
                     self.engine.ready)
        yield _gauge("kiln_requests_running", "Requests in the running batch", stats.num_running)
        yield _gauge("kiln_requests_waiting", "Requests queued for the batch", stats.num_waiting)
        yield _gauge("kiln_kv_blocks_in_use", "KV-cache blocks owned by requests", stats.kv_blocks_in_use)
        yield _gauge("kiln_kv_blocks_total", "KV-cache blocks in the pool", stats.kv_blocks_total)
        yield CounterMetricFamily("kiln_preemptions", "Requests preempted for want of KV blocks and "
                                  "recomputed later", value=stats.num_preemptions)
        yield _gauge("kiln_step_time_budget_seconds", "The seconds a step's prefill chunks are cut to fit "
                     "(--max-step-seconds; 0: no time budget)", self.engine.config.step_time_budget or 0.0)
        yield CounterMetricFamily("kiln_steps_over_time_budget", "Steps that took longer than the time budget "
                                  "(0 without one); the log says once when even the smallest prefill chunk overran "
                                  "it", value=stats.steps_over_budget)
        yield _gauge("kiln_kv_blocks_cached", "KV-cache blocks no request uses that keep a cached prefix (free "
                     "to be handed out, evicted least recently used first)", stats.kv_blocks_cached)
        yield CounterMetricFamily("kiln_prefix_cache_queries", "Prompt tokens looked up in the prefix cache as "
                                  "requests were admitted", value=stats.prefix_cache_queries)
        yield CounterMetricFamily("kiln_prefix_cache_hits", "Prompt tokens the prefix cache served (their KV "
                                  "blocks shared, not computed)", value=stats.prefix_cache_hits)
        yield _gauge("kiln_prefix_cache_hit_rate", "prefix cache hits / queries since start-up (0 before any)",
                     stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0)

        info = timeline.as_dict()
        phases = GaugeMetricFamily("kiln_startup_phase_seconds", "Seconds of each start-up phase the "
                                   "engine recorded (the timeline served at /health)", labels=["phase"])
        for name, seconds in info["phases_s"].items():
            phases.add_metric([name], seconds)
        yield phases
        if timeline.ready_seconds is not None:
            yield _gauge("kiln_startup_seconds", "Seconds from start-up to ready", timeline.ready_seconds)
        yield _gauge("kiln_compile_seconds", f"Start-up seconds spent compiling: timeline phases "
                     f"{', '.join(COMPILE_PHASES)}; 0 when the engine recorded none (it runs eagerly)",
                     sum(info["phases_s"].get(p, 0.0) for p in COMPILE_PHASES))
        yield _gauge("kiln_graph_capture_seconds", f"Start-up seconds spent capturing CUDA graphs: "
                     f"timeline phase {', '.join(CAPTURE_PHASES)}; 0 when the engine recorded none",
                     sum(info["phases_s"].get(p, 0.0) for p in CAPTURE_PHASES))

        kernels = triton_kernels.counts()
        yield CounterMetricFamily("kiln_triton_kernels_compiled", "Kernels Triton compiled for this process (kiln's "
                                  "own, here or in kiln's precompile workers; Inductor's compile workers are not "
                                  "seen); 0 on a start from an imported or warm cache root", value=kernels["compiled"])
        yield CounterMetricFamily("kiln_triton_kernels_cached", "Kernels Triton found in its cache in this process",
                                  value=kernels["cache_hits"])
        stats = [c.stats for c in self.engine.engine.runner.compiled_forwards] if self.engine.engine else []
        yield CounterMetricFamily("kiln_inductor_compiles", "Piece compiles Inductor ran at start-up, the static "
                                  "decode forward's per bucket included (0 on a warm start)",
                                  value=sum(s["inductor_compiles"] for s in stats))
        yield CounterMetricFamily("kiln_dynamo_graphs", "Graphs Dynamo traced (0 on a warm start, which skips "
                                  "Dynamo)", value=sum(s["graphs_seen"] for s in stats))
        hits, misses = _compile_cache_counters(self.engine.engine) if self.engine.engine else (0, 0)
        yield CounterMetricFamily("kiln_compile_cache_hits", "Pieces loaded from kiln's compile cache "
                                  "or served from Inductor's, from the compiled model's monitor; 0 when "
                                  "the engine has no compiled model", value=hits)
        yield CounterMetricFamily("kiln_compile_cache_misses", "Piece compiles no cache could serve (the "
                                  "compiler ran), from the compiled model's monitor; 0 when the engine "
                                  "has no compiled model", value=misses)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=float(value))
