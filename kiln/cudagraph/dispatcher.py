"""Which CUDA graph runs a step: the per-phase plans and the choice made for each step.

A uniform decode batch (every sequence adds one token) goes to the decode phase's graphs,
anything else to the prefill phase's; a decode batch larger than the decode phase's
largest bucket falls back to the prefill phase, and a batch above both runs without a
graph. Pure bookkeeping, no CUDA: the same decisions are made (and unit-tested) on the
CPU, where the graph layer itself passes every call through.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.compile.config import CompilationConfig, PhaseGraphs
from kiln.cudagraph.ladder import DEFAULT_MAX_CAPTURE_SIZE, BucketTable, capture_ladder, mixed_batch_ladder


@dataclass(frozen=True)
class PhasePlan:
    name: str  # "prefill" | "decode"
    mode: str  # full | piecewise | breakable | none
    compiler: str  # inductor | eager
    buckets: BucketTable
    static_compile: bool = False
    static_max_batch: int = 0
    capture: str = "start"  # "start" | "first_use" (PhaseGraphs.capture)


@dataclass(frozen=True)
class CudagraphChoice:
    phase: str
    mode: str  # the graph mode that runs this step; "none" = no graph
    compiler: str  # inductor | eager | static (the whole forward compiled for the bucket's size)
    bucket: int | None  # the padded size; None without a graph (or a static compile)

    def padded(self, num_tokens: int) -> int:
        return self.bucket if self.bucket is not None else num_tokens


def phase_plan(name: str, phase: PhaseGraphs, sizes: list[int], limit: int) -> PhasePlan:
    """Buckets of one phase: its own sizes, else the global ones, capped by its max batch and
    by what one step can hold (`limit`: tokens for prefill, sequences for decode)."""
    cap = min(phase.max_batch or limit, limit)
    if phase.static_compile:
        cap = min(cap, phase.static_max_batch)
    chosen = [n for n in (phase.sizes or sizes) if n <= cap]
    if phase.mode == "none":
        chosen = []
    return PhasePlan(name, phase.mode, phase.compiler, BucketTable(chosen), phase.static_compile,
                     phase.static_max_batch, phase.capture)


class CudagraphDispatcher:
    """Picks the CUDA graph (or none) for each step, and the bucket it is padded to."""

    def __init__(self, prefill: PhasePlan, decode: PhasePlan, enabled: bool):
        self.prefill, self.decode, self.enabled = prefill, decode, enabled

    @classmethod
    def from_config(cls, config: CompilationConfig, max_num_seqs: int, max_num_batched_tokens: int,
                    enabled: bool) -> "CudagraphDispatcher":
        """enabled=False (the CPU): every step runs without a graph, through the same choice."""
        top = config.max_cudagraph_capture_size or min(2 * max_num_seqs, DEFAULT_MAX_CAPTURE_SIZE)
        given = config.cudagraph_capture_sizes
        prefill_sizes = [n for n in (given or mixed_batch_ladder(top)) if n <= top]
        decode_sizes = [n for n in (given or capture_ladder(top)) if n <= top]
        prefill = phase_plan("prefill", config.phase_graphs("prefill"), prefill_sizes, max_num_batched_tokens)
        decode = phase_plan("decode", config.phase_graphs("decode"), decode_sizes,
                            min(max_num_seqs, max_num_batched_tokens))
        return cls(prefill, decode, enabled)

    def choose(self, num_tokens: int, uniform_decode: bool) -> CudagraphChoice:
        phases = (self.decode, self.prefill) if uniform_decode else (self.prefill,)
        if uniform_decode and self.decode.static_compile:
            # SGLang's path: the forward compiled for the bucket's exact size, graphed where graphs
            # are on; padded to the bucket either way (the compile is for that size only).
            bucket = self.decode.buckets.bucket_for(num_tokens)
            if bucket is not None:
                return CudagraphChoice("decode", self.decode.mode if self.enabled else "none", "static", bucket)
        if self.enabled:
            for phase in phases:
                bucket = phase.buckets.bucket_for(num_tokens)
                if bucket is not None:
                    return CudagraphChoice(phase.name, phase.mode, phase.compiler, bucket)
        first = phases[0]
        # SGLang's path: decode batches past the statically compiled buckets run eagerly.
        compiler = "eager" if first.static_compile else first.compiler
        return CudagraphChoice(first.name, "none", compiler, None)

    def captures(self) -> list[tuple[PhasePlan, int]]:
        """Every (phase, bucket) to capture, largest first so that smaller graphs fit in the
        memory the larger ones leave in the shared pool."""
        if not self.enabled:
            return []
        todo = [(p, n) for p in (self.prefill, self.decode) for n in p.buckets.sizes]
        return sorted(todo, key=lambda item: (-item[1], item[0].name))

    def captures_at_start(self) -> list[tuple[PhasePlan, int]]:
        """The captures the engine makes before it is ready; the others wait for first use."""
        return [(p, n) for p, n in self.captures() if p.capture == "start"]

    def deferred_captures(self) -> list[tuple[PhasePlan, int]]:
        return [(p, n) for p, n in self.captures() if p.capture != "start"]

    def summary(self) -> dict:
        """Per phase: its graph mode, compiler and buckets (what inspect and prewarm print)."""
        return {"enabled": self.enabled, **{p.name: {"mode": p.mode, "compiler": p.compiler,
                                                     "static_compile": p.static_compile, "buckets": p.buckets.sizes,
                                                     "capture": p.capture}
                                            for p in (self.prefill, self.decode)}}

    def describe(self) -> str:
        parts = []
        for p in (self.prefill, self.decode):
            sizes = p.buckets.sizes
            span = f"{len(sizes)} buckets up to {sizes[-1]}" if sizes else "no buckets"
            extra = f", static compile up to {p.static_max_batch}" if p.static_compile else ""
            if sizes and p.mode != "none" and p.capture != "start":
                extra += ", captured on first use"
            parts.append(f"{p.name} {p.mode} ({p.compiler}{extra}, {span})")
        return "CUDA graphs: " + ("; ".join(parts) if self.enabled else "off (no CUDA device): calls pass through")
