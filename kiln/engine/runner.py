"""Owns the model and its KV cache; turns a scheduled batch into one forward and samples."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import importlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.compile import CompiledModel, compile_model
from kiln.compile.cache import CompileCache
from kiln.compile.cache import triton_kernels
from kiln.compile.cache.entry import probe_isa_ahead
from kiln.compile.cache.preload import isa_probes_ahead_due, packaged_start_likely, preload_if_warm
from kiln.compile.compile_workers import compiles_in_workers, start_ahead, start_before_cold_start, worker_count
from kiln.compile.gc_pause import collector_paused
from kiln.compile.layer_stamping import layer_kinds
from kiln.compile.opt_in import is_repeated_layer
from kiln.compile.triton_precompile import KernelCompiler, MissingKernels, triton_target
from kiln.config import DEFAULT_FORWARD_REASON, SAMPLE_IN_GRAPH_BY_DEFAULT, EngineConfig
from kiln.cudagraph import CudagraphChoice, CudagraphDispatcher, ForwardCudagraphs, PackedStep, StepBuffers
from kiln.engine.logprobs import Logprob, TokenLogprobs
from kiln.engine.sampler import (RowHistory, greedy_tokens, host_to, largest_cuts, needs_history, plain, sample,
                                 to_device)
from kiln.engine.sampling_graphs import SamplingGraphs
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.scheduler import ScheduledBatch
from kiln.engine.sequence import Sequence
from kiln.engine.structured_output import token_bitmask
from kiln.engine.timeline import StartupTimeline
from kiln.forward_context import AttentionMetadata, set_forward_context, warm_up_metadata
from kiln.loader import ModelSource
from kiln.models import build_model
from kiln.ops import Attention
from kiln.ops.cpu.packed_linear import pack_linear_weights
from kiln.ops.linear import GEMV_ROW_BUCKETS, kiln_linear_weights

logger = logging.getLogger("kiln")


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # padded to the chosen graph's bucket
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    cudagraph: CudagraphChoice  # which CUDA graph (or none) runs the forward
    sample_rows: list[int]  # rows of the hidden states whose logits pick a token
    sample_seqs: list[Sequence]  # the sequences those rows belong to
    # Sequences that asked for prompt_logprobs, with their first row in this step, the position
    # it holds, and how many of their rows predict a prompt token.
    prompt_rows: list[tuple[Sequence, int, int, int]] = dataclasses.field(default_factory=list)


def compile_cache(source: ModelSource, dtype: torch.dtype, custom_ops: frozenset[str]) -> CompileCache | None:
    """The compile cache for this model (None when KILN_DISABLE_COMPILE_CACHE is set). What is
    given here joins the cache key: the architecture, dtype and custom ops, never a path."""
    arch = {k: v for k, v in dataclasses.asdict(source.config).items() if k not in ("bos_token_id", "eos_token_ids")}
    return CompileCache.from_env({"architecture": arch, "dtype": str(dtype).removeprefix("torch."),
                                  "custom_ops": sorted(custom_ops)}, name=source.name)


def start_compile_workers_ahead(config: EngineConfig, source: ModelSource) -> None:
    """For an engine that another thread builds later: see compile_workers.start_ahead. (Under
    tensor parallelism each rank starts its own, in its own process.)"""
    if config.tensor_parallel_size == 1:
        cache = compile_cache(source, config.torch_dtype, config.resolved_custom_ops())
        start_ahead(config.compilation_config, cache, config.torch_device.type)


def compile_forward(model: torch.nn.Module, config: EngineConfig, cache: CompileCache | None,
                    timeline: StartupTimeline) -> CompiledModel:
    """Capture and compile (or load from the cache) before the first request, so serving
    never waits on a compile."""
    compiled = forward_of(model, config, cache)
    _make_ready(compiled, timeline)
    return compiled


def forward_of(model: torch.nn.Module, config: EngineConfig, cache: CompileCache | None) -> CompiledModel:
    """The model's forward under the configured compile mode, not compiled yet (see _make_ready)."""
    compiled = compile_model(model, config.compilation_config, config.max_num_batched_tokens, cache=cache)
    if config.compilation is None:
        logger.info("model forward: %s", DEFAULT_FORWARD_REASON)
    return compiled


def decode_head(model: torch.nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's logits and greedy tokens, one row per sequence (padding rows too): run
    inside its CUDA graph, so that a greedy batch launches nothing after the replay. (A function of
    the model, not a runner method: the graphs holding it must not hold the runner in a cycle.)
    The logits may stay in the model's dtype (compute_logits' fp32=False; the argmax is the same):
    the cast to fp32 is then paid only by a step that reads them (b256 on an H100: the cast took
    0.103 ms a step and the argmax over fp32 0.055 ms, profile_step_..._b256_h100.json)."""
    logits = model.compute_logits(hidden, fp32=False)
    return logits, greedy_tokens(logits)


def compile_static_decode(model: torch.nn.Module, config: EngineConfig, cache: CompileCache | None,
                          sizes: list[int], timeline: StartupTimeline) -> CompiledModel:
    """SGLang's static decode path (cudagraph_decode static_compile): the whole forward compiled
    for each decode bucket's exact size, before the first request like the rest."""
    compiled = compile_model(model, config.compilation_config.static_decode(sizes), max(2, sizes[-1]), cache=cache)
    logger.info("decode forward: %s, one compile per decode bucket (%s)", compiled.describe(),
                ", ".join(map(str, sizes)))
    _make_ready(compiled, timeline, counts=sizes)
    return compiled


def _make_ready(compiled: CompiledModel, timeline: StartupTimeline, counts: list[int] | None = None) -> None:
    """Run the compiled forward's warm-up (CompiledModel.warm_up) and put its parts on the timeline."""
    if compiled.mode == 0:
        return
    dev = next(compiled.model.parameters()).device
    start = time.perf_counter()
    with timeline.phase("compile", record=False), torch.inference_mode():
        # Values do not matter, only token counts; position 0 is valid for any model.
        compiled.warm_up(lambda n: (torch.zeros(n, dtype=torch.long, device=dev),
                                    torch.zeros(n, dtype=torch.long, device=dev)),
                         context=lambda n: set_forward_context(warm_up_metadata(n, dev), {}), counts=counts)
    wall = time.perf_counter() - start
    times = compiled.monitor.times
    # Only what ran: a warm start records cache_load, a cold one dynamo, split (the backend's
    # own work: splitting, piece inputs, dedup, the cache key) and inductor.
    parts = (("cache_load", times.load_s), ("dynamo", times.dynamo_s), ("split", times.split_s),
             ("inductor", times.compile_s))
    for phase, seconds in parts:
        if seconds > 0:
            timeline.add(phase, seconds)
    # The rest of those calls (the forward's runs themselves, a kernel's first launch loading its
    # binary, waiting on compile workers) would otherwise hide in "other". A warm start's
    # cache_load counts the preload's wait, which came before them (CompiledModel's constructor).
    rest = wall - sum(seconds for _, seconds in parts) + (compiled.preload_wait_s if compiled.started_warm else 0.0)
    if rest > 0:
        timeline.add("compile_calls", rest)


def _in_background(fn: Callable) -> concurrent.futures.Future:
    executor = concurrent.futures.ThreadPoolExecutor(1)
    future = executor.submit(fn)
    executor.shutdown(wait=False)
    return future


@contextlib.contextmanager
def _first_layers_of_each_kind(model: torch.nn.Module, per_kind: int = 2):
    """Run the model's eager forward through only the first `per_kind` of each kind of repeated
    layer (kiln.compile.layer_stamping.layer_kinds): the other layers of a kind launch the same
    kernels on the same shapes, so a kernel-recording run needs none of them (32 layers to 2).
    Two, not one: a model's first layer is called with arguments (no residual yet) that the later
    ones are not, and each pattern launches its own kernels."""
    keep = {path for kind in layer_kinds(model) for path in kind[:per_kind]}
    lists = [(path, m) for path, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and any(is_repeated_layer(layer) for layer in m)]
    saved = [(m, m._modules) for _, m in lists]
    try:
        for path, m in lists:
            prefix = f"{path}." if path else ""
            # ModuleList iterates its _modules: a shorter dict, not new modules, keeps every name.
            object.__setattr__(m, "_modules", {k: layer for k, layer in m._modules.items()
                                                if not is_repeated_layer(layer) or prefix + k in keep})
        yield
    finally:
        for m, modules in saved:
            object.__setattr__(m, "_modules", modules)


def _tuning() -> bool:
    """Inside kiln prewarm's GEMV tuning, where every launch must really run to be timed."""
    from kiln.ops.triton import gemv_configs  # Triton is there only with a GPU

    return gemv_configs.is_tuning()


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, timeline: StartupTimeline):
        self.config = config
        self.device, self.dtype = config.torch_device, config.torch_dtype
        if self.device.type == "cpu" and config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        self.block_size = config.block_size
        self.custom_ops = config.resolved_custom_ops()
        # The last launched step's sampled tokens on the device, and each sequence's index among them.
        self._in_flight: tuple[torch.Tensor, dict[Sequence, int]] | None = None
        cache = compile_cache(source, self.dtype, self.custom_ops)
        if self.device.type == "cuda":  # kiln's own kernels compile into the cache root (where one is on)
            triton_kernels.use_cache_root(cache.root.path) if cache is not None else triton_kernels.listen()
            triton_kernels.start_up(done=False)
        packaged = packaged_start_likely(config.compilation_config, cache, self.device)
        if config.compilation_config.mode != 0 and not packaged:
            # A compile imports Dynamo anyway (~1 s): here, on the timeline, before the threads below
            # start (two threads importing the same circular modules can deadlock). Eager, or a start
            # from AOT packages, never.
            with timeline.phase("imports"), collector_paused():
                importlib.import_module("torch._dynamo")
        # A warm start's once-per-process work (imports, torch's and Triton's keys) runs while the weights load,
        # and so does Triton's driver start (on a fresh machine it builds its C utilities first: ~0.7 s).
        if not packaged:
            preload_if_warm(config.compilation_config, cache, self.device)
        start_before_cold_start(config.compilation_config, cache, self.device.type)
        if isa_probes_ahead_due(config.compilation_config, cache, self.device):
            with timeline.phase("imports"), collector_paused():  # the modules the probes' thread uses, on this one
                probe_isa_ahead()
        target = _in_background(functools.partial(triton_target, cache.root.path if cache is not None else None)) \
            if self.device.type == "cuda" else None
        with timeline.phase("weights"), collector_paused():
            self.model = build_model(source.config, self.dtype, self.device, self.custom_ops,
                                     source.weights() if source.weights and config.load_format == "auto" else None)
        if "skinny_linear" in self.custom_ops and self.device.type == "cpu":
            with timeline.phase("pack_weights"):
                packed = pack_linear_weights(kiln_linear_weights(self.model))
            if packed:  # bf16 only: fp32 with an explicit +skinny_linear packs nothing
                logger.info("linear weights prepacked for oneDNN: %.0f MB", packed / 2**20)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # On a fresh machine kiln's own Triton kernels are compiled in parallel processes (see
        # kiln.compile.triton_precompile) before the real warm-up runs and captures, which then
        # only load them.
        recorder = None
        if target is not None and not _tuning():
            with timeline.phase("triton_driver"):  # what its start beside the weights left to wait for
                recorder = MissingKernels(target.result())
        dispatcher = CudagraphDispatcher.from_config(config.compilation_config, config.max_num_seqs,
                                                     config.max_num_batched_tokens,
                                                     enabled=self.device.type == "cuda")
        static_sizes = dispatcher.decode.buckets.sizes if dispatcher.decode.static_compile else []
        self.compiled = forward_of(self.model, config, cache)
        model_len = source.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        self.cudagraphs = ForwardCudagraphs(
            self.model, self.compiled, dispatcher,
            StepBuffers(config.max_num_batched_tokens, config.max_num_seqs,
                        -(-self.max_model_len // self.block_size), self.device),
            self.max_model_len, config.max_num_seqs, debug=config.compilation_config.cudagraph_debug,
            head=functools.partial(decode_head, self.model))
        self.sampling_graphs = None
        graphed = self.device.type == "cuda" and dispatcher.decode.mode == "full"
        if config.sample_in_graph and not graphed:
            raise ValueError(f"sample_in_graph replays a graph after a decode step's full CUDA graph, and this "
                             f"engine has none ({self.device.type}, decode CUDA graphs "
                             f"'{dispatcher.decode.mode}'); drop --sample-in-graph or decode in full graphs "
                             f"on a GPU")
        if config.sample_in_graph or (config.sample_in_graph is None and graphed and SAMPLE_IN_GRAPH_BY_DEFAULT
                                      and config.tensor_parallel_size == 1):
            self.sampling_graphs = SamplingGraphs(config.max_num_seqs, self.device)
        with recorder or contextlib.nullcontext():
            # Not under tensor parallelism: the recorded runs all-reduce, so every rank would have to
            # make the same runs, and whether a rank's kernels are in the cache is its own affair.
            early = None
            if recorder is not None and config.tensor_parallel_size == 1:
                with timeline.phase("kernels"):
                    early = self._start_kernels_on_eager(recorder)
            _make_ready(self.compiled, timeline)
            self.static_decode = compile_static_decode(self.model, config, cache, static_sizes, timeline) \
                if static_sizes else None
            self.cudagraphs.static_forward = self.static_decode
            with timeline.phase("kv_cache"):
                self.num_blocks = self._num_kv_blocks()
                self.kv_caches = self._kv_caches(self.num_blocks)
            if early is not None:
                with timeline.phase("kernels_wait"):
                    self._finish_kernels(recorder, early)
            if recorder is not None:
                with timeline.phase("kernels_check"):
                    self._precompile_kernels(recorder, self.compiled, self.kv_caches)
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", self.num_blocks, self.block_size,
                    self.num_blocks * self.bytes_per_block / 2**30)
        if "skinny_linear" in self.custom_ops and self.device.type == "cuda":
            with timeline.phase("gemv"):
                self._warm_gemv()
        if self.device.type == "cuda":
            with timeline.phase("warm_up"):
                self._warm_up_requests()
        logger.info("%s", self.cudagraphs.dispatcher.describe())
        if self.cudagraphs.dispatcher.captures():
            with timeline.phase("cudagraphs"):
                self.cudagraphs.capture_all(self.kv_caches)
        if self.device.type == "cuda":
            kernels = triton_kernels.counts()
            logger.info("Triton: %d kernels compiled at start-up, %d loaded from its cache", kernels["compiled"],
                        kernels["cache_hits"])
            triton_kernels.start_up(done=True)

    @property
    def compiled_forwards(self) -> list[CompiledModel]:
        """The forward, and the static decode forward where the decode phase compiles per bucket."""
        return [self.compiled] + ([self.static_decode] if self.static_decode is not None else [])

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return sum(2 * self.block_size * a.num_kv_heads * a.head_dim * elem for a in self.attn_layers)

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type != "cuda":
            return int(self.config.kv_cache_gib * 2**30) // self.bytes_per_block
        return self._profile_gpu_blocks()

    def _kv_caches(self, num_blocks: int) -> dict[str, torch.Tensor]:
        return {layer.layer_name: torch.empty(2, num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim,
                                              dtype=self.dtype, device=self.device)
                for layer in self.attn_layers}

    def capture_next_graph(self) -> bool:
        """Capture one CUDA graph left for first use (the largest bucket first); False when none
        is left. For an engine with nothing to run."""
        return self.cudagraphs is not None and self.cudagraphs.capture_next()

    def shutdown(self) -> None:
        """Free what this runner holds on its device (weights, KV cache, CUDA graphs and their pool)
        now rather than at some later garbage collection, and hand the cached blocks back to the
        driver: a process can then build another engine in their place. The runner is unusable after."""
        self.model = self.compiled = self.static_decode = self.cudagraphs = self.sampling_graphs = None
        self.kv_caches, self.attn_layers, self._in_flight = {}, [], None
        # A compiled forward's parts refer to each other (the capture's backend and tracer callbacks),
        # so the last reference going leaves a cycle for the collector: collect it now.
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _warm_gemv(self, forward: Callable | None = None, kv_caches: dict[str, torch.Tensor] | None = None) -> None:
        """Launch the GEMV once per weight shape and row bucket: its kernels compile (or load
        from Triton's cache) here, not on a first request (a prefill's logits are computed outside
        any CUDA graph). On an H100 this took 0.14 s, nearly all of it the first launches of its
        kernel variants: through two layers of each kind instead of 32 it took as long. Under
        kiln prewarm this is where unknown shapes are autotuned."""
        rows = [r for r in GEMV_ROW_BUCKETS if r <= self.config.max_num_batched_tokens]
        forward = forward or self.compiled
        kv_caches = self.kv_caches if kv_caches is None else kv_caches
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            for n in rows:
                # Without metadata attention is the Python reference (0.24 of this phase's 0.45 s under
                # py-spy on an H100); a prefill's metadata runs the kernel a request runs. One row keeps
                # the reference: as a prefill it would launch a decode variant that no step uses.
                ids, positions, meta = self._dummy_prefill(n) if n > 1 else (zero, zero, None)
                with set_forward_context(meta, kv_caches if meta is not None else {}):
                    self.model.compute_logits(forward(ids, positions))
        torch.cuda.synchronize()

    def _dummy_prefill(self, n: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Token ids, positions and metadata of n prompt tokens whose values do not matter, in
        sequences no longer than the model's, for a run through attention's prefill kernel with
        the KV cache in place: its cache writes are skipped (slot -1) and every key is read from
        block 0, whatever that holds. The block table is as wide as a real step's (the step
        buffers' rows): Triton specialises a kernel on its integer arguments' divisibility by
        16, so another width (the row stride) is another kernel. A 2-wide one left the first
        request on the H100 to compile attention's prefill variant, 1.5 s."""
        length = min(n, self.max_model_len)
        meta = warm_up_metadata(n, self.device, length=length)
        blocks = torch.zeros(meta.num_seqs, self.cudagraphs.buffers.max_blocks, dtype=torch.int32,
                             device=self.device)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        positions = torch.arange(n, device=self.device) % length
        return ids, positions, dataclasses.replace(meta, block_tables=blocks)

    def _prefill(self, forward: Callable, kv_caches: dict[str, torch.Tensor], n: int) -> torch.Tensor:
        """`forward` over n prompt tokens (_dummy_prefill) with `kv_caches` in place: the hidden states."""
        ids, positions, meta = self._dummy_prefill(n)
        with torch.inference_mode(), set_forward_context(meta, kv_caches):
            return forward(ids, positions)

    def _warm_up_requests(self, forward: Callable | None = None,
                          kv_caches: dict[str, torch.Tensor] | None = None) -> None:
        """What a request launches outside the CUDA graphs, once before serving, so that its kernels
        compile (or load) here and not on the first request: a small prefill through the forward
        with the KV cache in place (attention's prefill tiles; its cache writes are skipped, slot -1,
        and it reads block 0, whatever that holds) and a greedy and a sampled row (the Triton argmax
        and its Gumbel variant, each the same kernel for every batch and sampling setting)."""
        hidden = self._prefill(forward or self.compiled, self.kv_caches if kv_caches is None else kv_caches,
                               min(32, self.config.max_num_batched_tokens))
        with torch.inference_mode():
            sample(self.model.compute_logits(hidden[-1:]).repeat(2, 1),
                   [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)], [None, None])
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _precompile_kernels(self, missing: MissingKernels, forward: Callable,
                            kv_caches: dict[str, torch.Tensor]) -> None:
        """_record_kernels through `forward`, then wait for their compiles."""
        compiler = self._kernel_compiler(missing)
        try:
            self._record_kernels(missing, forward, kv_caches, compiler)
        finally:
            self._finish_kernels(missing, compiler)

    def _start_kernels_on_eager(self, missing: MissingKernels) -> KernelCompiler | None:
        """_record_kernels on the model's own forward, which launches the same kernels of kiln's
        ops as the compiled one, before that is traced and compiled: the kernels compile in other
        processes meanwhile. Returns their compiler (_finish_kernels waits for it), None if the
        runs failed (the kernels check records what is missing then). The KV cache is not sized
        yet: one block serves, as the warm-up steps write no slot (-1) and read only block 0."""
        cc = self.config.compilation_config
        # Leave the cores the pieces compile on to them.
        busy = worker_count(cc) if cc.mode != 0 and compiles_in_workers(cc) else 0
        compiler = self._kernel_compiler(missing, max(1, (os.cpu_count() or 1) - busy))
        try:
            self._record_kernels(missing, self.model, self._kv_caches(1), compiler, eager=True)
        except Exception as e:
            logger.warning("kiln's kernels were not recorded before the compile (%s: %s); the kernels check "
                           "records them after it", type(e).__name__, e)
            self._finish_kernels(missing, compiler)
            return None
        return compiler

    def _kernel_compiler(self, missing: MissingKernels, workers: int | None = None) -> KernelCompiler:
        from triton import knobs

        return KernelCompiler(missing.target, knobs.cache.dir, workers)

    def _record_kernels(self, missing: MissingKernels, forward: Callable, kv_caches: dict[str, torch.Tensor],
                        compiler: KernelCompiler, eager: bool = False) -> None:
        """Run what start-up runs next (each graph's warm-up, the KV-cache profile's forward, the GEMV
        warm-up) through `forward` (`eager`: the model's own, for every graph) with missing kernels
        recorded instead of compiled; each goes to `compiler` as soon as it is recorded (so do those
        recorded before), while the runs go on. The first run (the smallest graph's) is a probe:
        when nothing is missing after it, the kernels are in Triton's cache dir and the other runs
        are left to the real start."""
        todo = self.cudagraphs.dispatcher.captures()  # largest first
        runs = [lambda: self.cudagraphs.warm_up(kv_caches, todo[-1:], eager)] if todo else []
        # Second, the KV-cache profile's forward (its attention launches the long-prompt tiles of
        # choose_tiles): left to the profile, after the compile phase, they compiled last (a cold -O2
        # start on an H100 then waited 2.6 s for them, now 0.1 s).
        runs.append(lambda: self._prefill(forward, kv_caches, self.config.max_num_batched_tokens))
        if "skinny_linear" in self.custom_ops:
            runs.append(lambda: self._warm_gemv(forward, kv_caches))
        runs.append(lambda: self._warm_up_requests(forward, kv_caches))
        runs.append(lambda: self.cudagraphs.warm_up(kv_caches, todo[:-1], eager))
        for launch in missing.launches.values():
            compiler.submit(launch)
        missing.compiler = compiler
        # Only where every run is the model's own forward: a compiled one does not iterate the layers.
        fewer_layers = eager or (self.compiled.mode == 0 and self.static_decode is None)
        try:
            with _first_layers_of_each_kind(self.model) if fewer_layers else contextlib.nullcontext():
                for i, run in enumerate(runs):
                    if i == 1 and not missing.launches:
                        break
                    run()
                torch.cuda.synchronize()
        finally:
            missing.compiler = None

    def _finish_kernels(self, missing: MissingKernels, compiler: KernelCompiler) -> None:
        """Wait for `compiler`'s kernels, with those recorded since its runs (the compile phase's,
        the KV-cache profile's): the recorded kernels' next launches load them."""
        try:
            for launch in missing.launches.values():
                compiler.submit(launch)
            done = compiler.finish()
        finally:
            missing.compiled()
        if not done["workers"]:  # nothing was missing
            return
        triton_kernels.add_worker_compiles(done)
        logger.info("Triton: %d kernels compiled in %d processes in %.2f s (%.1f s in all, %.1f s of it building "
                    "launchers; the slowest: %s, %.2f s)%s", done["compiled"], done["workers"], done["seconds"],
                    done["kernel_seconds"], done["launcher_seconds"], *done["slowest"],
                    f" ({done['failed']} failed: they compile at their launch)" if done["failed"] else "")

    def _profile_gpu_blocks(self) -> int:
        """Blocks that fit in the GPU share left after a forward of the largest batch and its
        sampling, and, with sampling graphs, their pool. The forward's attention is the prefill
        kernel a step runs, over a one-block cache: without metadata it would be the Python
        reference, whose scores matrix a step never holds (at 2048 tokens of Llama-3-8B it took
        0.13 s of the profile's GPU time, and its temporaries counted against the cache)."""
        torch.cuda.empty_cache()
        one_block = {name: cache.zero_() for name, cache in self._kv_caches(1).items()}
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            hidden = self._prefill(self.compiled, one_block, self.config.max_num_batched_tokens)
            forward_peak = torch.cuda.max_memory_allocated()
            # A step samples at most one row per sequence. The eager sampler may hold two copies of
            # the logits beside them (a grammar's mask; logit_bias or penalties applied), then the
            # cuts' temporaries.
            logits = self.model.compute_logits(hidden[: self.config.max_num_seqs])
            copies = [logits.clone(), logits.clone()]
            torch.cuda.reset_peak_memory_stats()
            held = torch.cuda.memory_allocated()
            largest_cuts(copies[-1])
            cuts_bytes = torch.cuda.max_memory_allocated() - held
            logits_bytes = logits.numel() * logits.element_size()
            del copies, logits, hidden, one_block
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        non_torch = (total - free) - torch.cuda.memory_reserved()
        peak = max(forward_peak, held + cuts_bytes)
        # The sampling graphs' pool keeps one program's temporaries for good (the fp32 cast of the
        # decode graph's logits and the cuts'), beside whatever the eager sampler's next peak takes
        # from the general pool.
        reserved = cuts_bytes + logits_bytes if self.sampling_graphs is not None else 0
        budget = total * self.config.gpu_memory_utilization - peak - reserved - non_torch
        if budget <= 0:
            raise RuntimeError(f"no GPU memory left for the KV cache: the model peaks at "
                               f"{peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB; raise "
                               f"gpu_memory_utilization or lower max_num_batched_tokens")
        return int(budget) // self.bytes_per_block

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """Pack the batch into the step buffers, padded for the graph it goes to: token ids,
        positions, attention metadata, and the rows to sample. A token still pending (sampled by
        the step in flight) is copied into its row on the GPU, behind that step."""
        bs = self.block_size
        step = PackedStep([], [], [], [s.block_table for s in batch.seqs], [], [0])
        sample_rows, sample_seqs, prompt_rows = [], [], []
        pending_rows, pending_from = [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            begin, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            known = seq.num_tokens
            if seq.params.prompt_logprobs is not None and begin < seq.num_prompt_tokens - 1:
                # Position p's logits give token p + 1's log probability, up to the prompt's last token.
                prompt_rows.append((seq, len(step.input_ids), begin, min(end, seq.num_prompt_tokens - 1) - begin))
            step.input_ids += seq.token_ids[begin:min(end, known)]
            if end > known:
                pending_rows.append(len(step.input_ids))
                pending_from.append(self._pending_index(seq, end - known))
                step.input_ids.append(0)
            step.positions += range(begin, end)
            step.slots += [seq.block_table[p // bs] * bs + p % bs for p in range(begin, end)]
            step.query_start_loc.append(step.query_start_loc[-1] + n)
            step.seq_lens.append(end)
            if end == known + seq.num_pending_tokens:  # caught up: its last logits choose the next token
                sample_rows.append(step.query_start_loc[-1] - 1)
                sample_seqs.append(seq)
        choice, (input_ids, positions, meta) = self.cudagraphs.pack(step, batch.uniform_decode)
        if pending_rows:
            rows = to_device(pending_rows, torch.long, self.device)
            input_ids.index_copy_(0, rows, self._in_flight[0].index_select(0, to_device(pending_from, torch.long,
                                                                                         self.device)))
        return StepInputs(input_ids, positions, meta, choice, sample_rows, sample_seqs, prompt_rows)

    def _pending_index(self, seq: Sequence, count: int) -> int:
        """Where the step in flight left `seq`'s pending token among its sampled ones."""
        index = self._in_flight[1].get(seq) if self._in_flight is not None else None
        if count != 1 or index is None:
            raise RuntimeError(f"sequence {seq.seq_id} is scheduled {count} token(s) past those it has, but only "
                               f"the token the step in flight samples for it can be read from the GPU")
        return index

    def launch(self, batch: ScheduledBatch) -> "LaunchedStep":
        """Queue one step on the device (the forward, the logits, sampling, and the copy of the
        tokens to the host) and return without waiting for it."""
        # A graph left for first use is captured before the step's clock starts: the scheduler
        # learns step costs from that clock.
        if self.cudagraphs.deferred:
            self.cudagraphs.capture_for(batch.num_tokens, batch.uniform_decode)
        started = None
        if self.device.type == "cuda":  # the device's time for the step: LaunchedStep.seconds
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        begin = time.perf_counter()
        launched = self._launch(batch)
        launched.batch, launched.started, launched.launch_seconds = batch, started, time.perf_counter() - begin
        return launched

    @torch.inference_mode()
    def _launch(self, batch: ScheduledBatch) -> "LaunchedStep":
        step = self.prepare(batch)
        with set_forward_context(step.attn_metadata, self.kv_caches):
            hidden, head = self.cudagraphs.run(step.cudagraph, step.input_ids, step.positions)
        prompt_logprobs = self._prompt_logprobs(hidden, step.prompt_rows) if step.prompt_rows else []
        seqs = step.sample_seqs
        if not seqs:
            self._in_flight = None
            return LaunchedStep.of([], torch.empty(0, dtype=torch.long, device=self.device), None, prompt_logprobs)
        greedy = None
        params = [s.params for s in seqs]
        if step.sample_rows == list(range(len(seqs))):  # a decode batch samples every row
            if head is not None and self._sample_in_graph(step, params):
                tokens = self.sampling_graphs.sample(*head, params, [s.generator for s in seqs])
                if tokens is not None:  # None: this graph could not be captured, the eager sampler's
                    return self._launched(seqs, head[0][: len(seqs)], tokens, prompt_logprobs)
            if head is not None:
                logits, greedy = (t[: len(seqs)] for t in head)
            else:
                logits = self.model.compute_logits(hidden[: len(seqs)])
        else:
            logits = self.model.compute_logits(
                hidden.index_select(0, to_device(step.sample_rows, torch.long, self.device)))
        history = [self._history(s) for s in seqs] if any(needs_history(p) for p in params) else None
        in_flight = self._in_flight[0] if self._in_flight is not None else None
        matchers = [s.matcher for s in seqs]
        allowed = None
        if any(m is not None for m in matchers):  # structured output: what each grammar allows next
            allowed = host_to(token_bitmask(matchers, logits.shape[1]), self.device)
        tokens = sample(logits, params, [s.generator for s in seqs], history, in_flight, allowed, greedy)
        return self._launched(seqs, logits, tokens, prompt_logprobs)

    def _sample_in_graph(self, step: StepInputs, params: list) -> bool:
        """A decode step whose head ran in its full graph, with a sampled row and every row plain."""
        return (self.sampling_graphs is not None and self.cudagraphs.head_in_graph(step.cudagraph)
                and any(not p.greedy for p in params) and all(plain(p) for p in params)
                and all(s.matcher is None for s in step.sample_seqs))

    def _launched(self, seqs: list[Sequence], logits: torch.Tensor, tokens: torch.Tensor,
                  prompt_logprobs: list) -> "LaunchedStep":
        params = [s.params for s in seqs]
        logprobs = None
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            index = to_device(wanted, torch.long, self.device)
            logprobs = (wanted, TokenLogprobs.of(logits.index_select(0, index).float(), tokens.index_select(0, index),
                                                 max(params[i].logprobs for i in wanted)))
        self._in_flight = (tokens, {s: i for i, s in enumerate(seqs)})
        return LaunchedStep.of(seqs, tokens, logprobs, prompt_logprobs)

    def _history(self, seq: Sequence) -> RowHistory:
        pending = self._pending_index(seq, 1) if seq.num_pending_tokens else None
        return RowHistory(seq.token_ids[: seq.num_prompt_tokens], seq.output_token_ids, pending, seq.stop_ids,
                          seq.bad_words)

    def _prompt_logprobs(self, hidden: torch.Tensor, prompt_rows: list) -> list[tuple]:
        """(sequence, first position, TokenLogprobs of each row, the prompt tokens they predict) for
        every sequence of the step that asked for prompt_logprobs; computed in slices of rows, as a
        long prompt's logits at once would take gigabytes."""
        found = []
        for seq, row, begin, count in prompt_rows:
            targets = seq.token_ids[begin + 1: begin + 1 + count]
            parts = []
            for start in range(0, count, PROMPT_LOGITS_ROWS):
                rows = slice(row + start, row + min(count, start + PROMPT_LOGITS_ROWS))
                part_targets = to_device(targets[start:start + PROMPT_LOGITS_ROWS], torch.long, self.device)
                parts.append(TokenLogprobs.of(self.model.compute_logits(hidden[rows]), part_targets,
                                              seq.params.prompt_logprobs))
            found.append((seq, begin, parts, targets))
        return found

    def execute(self, batch: ScheduledBatch) -> list[SampledToken]:
        """Run one step; returns the next token of each sequence that caught up."""
        return self.launch(batch).results()


PROMPT_LOGITS_ROWS = 512  # prompt positions whose logits are computed at once (prompt_logprobs)


@dataclass
class SampledToken:
    seq: Sequence
    token: int
    logprobs: dict[int, Logprob] | None = None  # with SamplingParams.logprobs: the chosen and the top tokens


@dataclass
class LaunchedStep:
    """A step queued on the device: its sampled tokens (and log probabilities) are on their way
    to the host."""

    seqs: list[Sequence]  # those that sample, in the order of their tokens
    host_tokens: torch.Tensor | None
    copied: torch.cuda.Event | None  # None on the CPU, where the copy has already happened
    logprobs: tuple[list[int], TokenLogprobs] | None = None  # the rows that asked, and theirs
    prompt_logprobs: list[tuple] = dataclasses.field(default_factory=list)  # see ModelRunner._prompt_logprobs
    batch: ScheduledBatch | None = None  # what was launched
    started: torch.cuda.Event | None = None  # recorded before the step's first work was queued
    launch_seconds: float = 0.0  # the host's time in launch()

    @classmethod
    def of(cls, seqs: list[Sequence], tokens: torch.Tensor, logprobs: tuple[list[int], TokenLogprobs] | None = None,
           prompt_logprobs: list[tuple] = ()) -> "LaunchedStep":
        cuda = tokens.device.type == "cuda"
        if logprobs is not None:
            logprobs = (logprobs[0], logprobs[1].to("cpu", non_blocking=cuda))
        prompt_logprobs = [(seq, begin, [p.to("cpu", non_blocking=cuda) for p in parts], targets)
                           for seq, begin, parts, targets in prompt_logprobs]
        if not cuda:
            return cls(seqs, tokens, None, logprobs, prompt_logprobs)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event(enable_timing=True)
        copied.record()
        return cls(seqs, host, copied, logprobs, prompt_logprobs)

    def seconds(self) -> float:
        """After results(): the step's time. On a GPU the device's, from reaching the step's first
        work to its tokens' copy, so neither the wait behind the step before nor any idle time
        after it (the gaps while the host was still queueing the step count); on the CPU its
        launch's, which ran the forward."""
        if self.started is None or self.copied is None:
            return self.launch_seconds
        return self.started.elapsed_time(self.copied) / 1e3

    def results(self) -> list[SampledToken]:
        """Each sampled token (with its log probabilities, if asked for); waits for the step to
        finish on the device. Prompt log probabilities go onto their sequences here."""
        if self.copied is not None:
            self.copied.synchronize()
        for seq, begin, parts, targets in self.prompt_logprobs:
            _add_prompt_logprobs(seq, begin, parts, targets)
        if not self.seqs:
            return []
        tokens = self.host_tokens.tolist()
        sampled = [SampledToken(seq, token) for seq, token in zip(self.seqs, tokens)]
        if self.logprobs is not None:
            rows, values = self.logprobs
            for j, i in enumerate(rows):
                sampled[i].logprobs = values.row(j, tokens[i], self.seqs[i].params.logprobs)
        return sampled


def _add_prompt_logprobs(seq: Sequence, begin: int, parts: list[TokenLogprobs], targets: list[int]) -> None:
    """Append the log probabilities of the prompt tokens begin + 1, ... to seq.prompt_logprobs
    (whose first entry, for the first token, is None: nothing predicts it)."""
    if seq.prompt_logprobs is None:
        seq.prompt_logprobs = [None]
    if len(seq.prompt_logprobs) != begin + 1:  # recomputed after a preemption: kept from the first pass
        return
    num = seq.params.prompt_logprobs
    for start, part in zip(range(0, len(targets), PROMPT_LOGITS_ROWS), parts):
        for j in range(part.chosen.shape[0]):
            seq.prompt_logprobs.append(part.row(j, targets[start + j], num))
