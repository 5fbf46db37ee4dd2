"""The model forward of each step, through the CUDA graph its batch was dispatched to.

This is the package's entry point for the engine. Captured after the KV cache exists (a full
graph's attention reads it), into one memory pool: at start-up every (phase, bucket) of the
phases that capture at start, largest first; a bucket of a phase that captures on first use
before the first step dispatched to it is packed (capture_for), or earlier through
capture_next(), which a server calls while it has no request. A decode step also runs the
engine's `head` on its hidden states (the logits and the greedy choice): inside a full decode
graph, so that the replay leaves only sampling's extra work, if any, to launch; after the
forward otherwise.
The first capture of each piece of code (a phase's forward, for each compiled shape) is
preceded by one ordinary run of the same shape, so that nothing compiles, autotunes or
allocates lazily inside the capture. On the CPU nothing is captured and every call passes
through (with the same dispatch and padding, when enabled).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from kiln.compile import CompiledModel
from kiln.cudagraph.breakable import capture_breakable
from kiln.cudagraph.dispatcher import CudagraphChoice, CudagraphDispatcher, PhasePlan
from kiln.cudagraph.piecewise import PiecewiseCudagraphs
from kiln.cudagraph.pool import CudagraphPool, log_capture
from kiln.cudagraph.step_buffers import PackedStep, StepBuffers
from kiln.forward_context import set_forward_context

logger = logging.getLogger("kiln")

# What a decode step computes from its hidden states, with the forward (the engine's logits and
# greedy tokens); its outputs are valid until the next step.
Head = Callable[[torch.Tensor], tuple]


class ForwardCudagraphs:
    def __init__(self, model: nn.Module, compiled: CompiledModel, dispatcher: CudagraphDispatcher,
                 buffers: StepBuffers, max_model_len: int, max_num_seqs: int, debug: bool = False,
                 static_forward: CompiledModel | None = None, head: Head | None = None):
        """static_forward: the forward compiled per decode bucket (SGLang's static decode path),
        when the decode phase asks for it (it may be set later, before the first capture). head:
        what a decode step computes from its hidden states (one row per sequence), run with the
        forward."""
        self.model, self.compiled, self.dispatcher, self.buffers = model, compiled, dispatcher, buffers
        self.static_forward, self.head = static_forward, head
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.device = buffers.device
        self.split_names = {op.name for op in compiled.split_ops}
        self.pool = CudagraphPool(self.device, debug) if self.device.type == "cuda" else None
        self.piecewise = PiecewiseCudagraphs(self.pool)
        if any(phase.mode == "piecewise" for phase in (dispatcher.prefill, dispatcher.decode)):
            compiled.wrap_pieces(self.piecewise.wrap)
        self.graphs: dict[tuple[str, int], object] = {}  # (phase, bucket) -> captured graph
        # Buckets left for first use (largest first), and those whose capture failed (they run
        # without a graph); the KV cache the captures read, once capture_all has it.
        self.deferred: list[tuple[PhasePlan, int]] = []
        self.failed: set[tuple[str, int]] = set()
        self.kv_caches: dict[str, torch.Tensor] | None = None
        self._warmed: set = set()  # what _first_run has warmed up
        self.stats = {"num_graphs": 0, "capture_s": 0.0, "graph_memory_bytes": 0, "buckets": 0,
                      "warm_up_runs": 0, "warm_up_s": 0.0,  # the runs before captures (_first_run)
                      "deferred_buckets": 0, "captured_after_start": 0, "capture_after_start_s": 0.0}

    # ------------------------------------------------------------------ per step

    def pack(self, step: PackedStep, uniform_decode: bool) -> tuple[CudagraphChoice, tuple]:
        """Choose the graph for this step and write its padded inputs; returns the choice and
        (input ids, positions, metadata)."""
        choice = self.dispatcher.choose(step.num_tokens, uniform_decode)
        num_tokens = choice.padded(step.num_tokens)
        if choice.mode == "full":
            num_seqs, max_query_len, max_seq_len = self._full_shape(choice.phase, choice.bucket)
        else:
            num_seqs = len(step.seq_lens)
            max_query_len = max(b - a for a, b in zip(step.query_start_loc, step.query_start_loc[1:]))
            # A decode step without a full graph reports the graph's context bound too: the
            # attention's split count follows it, and the same count rounds a sequence the same.
            max_seq_len = self.max_model_len if max_query_len == 1 else max(step.seq_lens)
        return choice, self.buffers.load(step, num_tokens, num_seqs, max_query_len, max_seq_len)

    def run(self, choice: CudagraphChoice, input_ids: torch.Tensor,
            positions: torch.Tensor) -> tuple[torch.Tensor, tuple | None]:
        """Hidden states of the (padded) step and, for a decode step, head(hidden states) (None
        otherwise, or without a head); valid until the next call. Call inside the step's
        forward context."""
        decode = choice.phase == "decode" and self.head is not None
        graph = self.graphs.get((choice.phase, choice.bucket))
        if graph is None:
            hidden = self._forward(choice)(input_ids, positions)
        elif choice.mode == "full":
            return graph.replay(input_ids, positions)
        elif choice.mode == "piecewise":
            with self.piecewise.active(choice.bucket, "replay"):
                hidden = self.compiled(input_ids, positions)
        else:
            hidden = graph.replay()
        return hidden, self.head(hidden) if decode else None

    def head_in_graph(self, choice: CudagraphChoice) -> bool:
        """Whether this step's head outputs come from a full graph's replay: the same addresses
        every step of its bucket."""
        return (choice.phase == "decode" and choice.mode == "full" and self.head is not None
                and (choice.phase, choice.bucket) in self.graphs)

    # ------------------------------------------------------------------ capture

    def capture_all(self, kv_caches: dict[str, torch.Tensor]) -> dict:
        """Capture the graphs of every phase that captures at start-up, and leave the others for
        first use; returns stats for the timeline."""
        todo = self.dispatcher.captures_at_start()
        if self.pool is None:
            return self.stats
        self.kv_caches = kv_caches
        self.deferred = self.dispatcher.deferred_captures()
        self.stats["deferred_buckets"] = len(self.deferred)
        if not todo:
            return self.stats
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        with self.pool.session():
            for phase, bucket in todo:
                self._capture(phase, bucket, kv_caches, self._first_run(phase, bucket, self._warmed))
        torch.cuda.synchronize(self.device)
        used = self.pool.memory_bytes()
        self.stats.update(num_graphs=self.pool.num_graphs, capture_s=time.perf_counter() - start,
                          graph_memory_bytes=used, buckets=len(todo))
        log_capture(self.pool, used, self.stats["warm_up_runs"], self.stats["warm_up_s"])
        if self.deferred:
            phases = sorted({phase.name for phase, _ in self.deferred})
            logger.info("%d bucket(s) of the %s phase are captured when a step first needs one, or while the "
                        "engine idles", len(self.deferred), " and ".join(phases))
        return self.stats

    def capture_next(self) -> bool:
        """Capture the largest bucket still left for first use; False when none is left. A
        server calls this between requests, so that later steps find their graphs ready."""
        if not self.deferred:
            return False
        phase, bucket = self.deferred[0]
        self._capture_later(phase, bucket)
        return True

    def capture_for(self, num_tokens: int, uniform_decode: bool) -> None:
        """Before a step of `num_tokens` is packed: capture its bucket's graph if it was left for
        first use."""
        if not self.deferred:
            return
        choice = self.dispatcher.choose(num_tokens, uniform_decode)
        for phase, bucket in self.deferred:
            if phase.name == choice.phase and bucket == choice.bucket:
                self._capture_later(phase, bucket)
                return

    def _capture_later(self, phase: PhasePlan, bucket: int) -> None:
        """Capture one deferred bucket between steps. It writes an empty step into the step
        buffers (the step that needs the graph writes its own after), and waits for the device
        like every capture. One that fails (out of memory, say) leaves its bucket without a
        graph: those steps run the same forward ungraphed."""
        self.deferred.remove((phase, bucket))
        start = time.perf_counter()
        try:
            with self.pool.session(collect=False):
                self._capture(phase, bucket, self.kv_caches, self._first_run(phase, bucket, self._warmed))
        except RuntimeError as e:  # torch.OutOfMemoryError among them
            self.failed.add((phase.name, bucket))
            logger.warning("could not capture the %s graph of bucket %d (%s); its steps run without a graph",
                           phase.name, bucket, str(e).splitlines()[0] if str(e) else type(e).__name__)
            return
        seconds = time.perf_counter() - start
        self.stats["captured_after_start"] += 1
        self.stats["capture_after_start_s"] += seconds
        self.stats["num_graphs"] = self.pool.num_graphs
        logger.debug("captured the %s graph(s) of bucket %d in %.1f ms", phase.name, bucket, seconds * 1e3)
        if not self.deferred:
            logger.info("captured the %d deferred bucket(s) in %.2f s in all; %d CUDA graphs now",
                        self.stats["captured_after_start"], self.stats["capture_after_start_s"], self.pool.num_graphs)

    def warm_up(self, kv_caches: dict[str, torch.Tensor], todo: list[tuple[PhasePlan, int]],
                eager: bool = False) -> None:
        """The ordinary run that precedes each capture, for each (phase, bucket) of `todo` (a
        slice of dispatcher.captures()), without capturing: what those runs launch (`eager`:
        through the model's own forward, whatever the graph's compiler)."""
        for phase, bucket in todo:
            forward, (ids, pos, meta) = self._bucket_inputs(phase, bucket, eager)
            with set_forward_context(meta, kv_caches), torch.inference_mode(), self.pool.capturing():
                forward(ids, pos)

    def _bucket_inputs(self, phase: PhasePlan, bucket: int, eager: bool = False) -> tuple[Callable, tuple]:
        """The forward a (phase, bucket) graph records (a full decode graph's with the head), and
        its inputs in the step buffers."""
        # No real tokens: a graph records launches and addresses, and the kernels' grids depend
        # only on shapes, so an all-padding step captures the same graph as a real one.
        empty = PackedStep([], [], [], [], [], [0])
        if phase.mode == "full":
            num_seqs, max_query_len, max_seq_len = self._full_shape(phase.name, bucket)
        else:
            num_seqs, max_query_len, max_seq_len = 0, 1, 1
        inputs = self.buffers.load(empty, bucket, num_seqs, max_query_len, max_seq_len)
        _, forward = self._phase_forward(phase, bucket, eager)
        return (self._with_head(forward, phase.name) if phase.mode == "full" else forward), inputs

    def _phase_forward(self, phase: PhasePlan, bucket: int, eager: bool = False) -> tuple[str, Callable]:
        """The compiler a (phase, bucket) graph takes (`eager`: the model's own forward) and its forward."""
        compiler = "eager" if eager else "static" if phase.static_compile else phase.compiler
        return compiler, self._forward(CudagraphChoice(phase.name, phase.mode, compiler, bucket))

    def _first_run(self, phase: PhasePlan, bucket: int, warmed: set) -> bool:
        """Whether the capture of (phase, bucket) is the first of its code, and so needs a warm-up
        run: a first call may autotune (Inductor times a kernel's configs once) or allocate what
        it keeps. Later buckets of the same code are captured without one, as vLLM does: those
        runs cost as much as the captures (30 of them took 1.0 of 2.3 s of an -O2 start on the
        H200). A kernel variant of kiln's first launched in a capture only loads its module,
        which a capture allows. Code that may compile per count is warmed for every bucket."""
        compiler, forward = self._phase_forward(phase, bucket)
        code = forward.code_for(bucket) if isinstance(forward, CompiledModel) else "eager"
        key = (phase.name, compiler, code)
        if code is None or key not in warmed:
            warmed.add(key)
            return True
        return False

    def _capture(self, phase: PhasePlan, bucket: int, kv_caches: dict[str, torch.Tensor], warm_up: bool) -> None:
        forward, (ids, pos, meta) = self._bucket_inputs(phase, bucket)
        with set_forward_context(meta, kv_caches), torch.inference_mode():
            if warm_up:
                start = time.perf_counter()
                with self.pool.capturing():
                    forward(ids, pos)  # compiles, autotunes and allocates outside the capture
                self.stats["warm_up_runs"] += 1
                self.stats["warm_up_s"] += time.perf_counter() - start
            with self.pool.capturing():
                if phase.mode == "full":
                    graph, _ = self.pool.capture(forward, ids, pos)
                elif phase.mode == "breakable":
                    graph, _ = capture_breakable(self.pool, forward, (ids, pos), self.split_names)
                else:
                    with self.piecewise.active(bucket, "capture"):
                        forward(ids, pos)
                    graph = "piecewise"  # the graphs live in the pieces
        self.graphs[(phase.name, bucket)] = graph

    def _with_head(self, forward: Callable, phase: str) -> Callable:
        """A full graph's body: the forward, and for decode the head too; returns what run() does."""
        if phase != "decode" or self.head is None:
            return lambda ids, pos: (forward(ids, pos), None)

        def forward_and_head(ids, pos):
            hidden = forward(ids, pos)
            return hidden, self.head(hidden)
        return forward_and_head

    def _full_shape(self, phase: str, bucket: int) -> tuple[int, int, int]:
        """(sequences, max query len, max context) a full graph of `bucket` is captured with:
        a decode bucket is `bucket` one-token sequences; a mixed one holds up to max_num_seqs
        sequences with long queries. The context bound is the model's, so the attention
        launch splits long decode contexts as it would for any length."""
        if phase == "decode":
            return bucket, 1, self.max_model_len
        return min(bucket, self.max_num_seqs, self.buffers.max_seqs), bucket, self.max_model_len

    def _forward(self, choice: CudagraphChoice) -> Callable:
        if choice.compiler == "static":
            if self.static_forward is None:
                raise RuntimeError("the decode phase compiles statically per bucket (static_compile), but no "
                                   "statically compiled forward was given; this is a kiln bug")
            return self.static_forward
        return self.compiled if choice.compiler == "inductor" else self.model
