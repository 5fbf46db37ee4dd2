"""The engine's settings (EngineConfig) and the command-line flags that set them;
contradictions fail here, at start-up. The compilation settings are kiln.compile.config's."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

import torch

from kiln.compile.config import (CompilationConfig, add_compilation_arguments, compilation_config_from_args,
                                 compilation_config_from_dict)

# Measured with benchmarks/engine_throughput.py, cudagraphs.py and compile_time.py
# (benchmarks/results/): on this CPU -O2 gains 1-9% a step for ~15 s of cold compile. On the
# H200 an eager decode step is host-bound (~18-23 ms for ~4.5 ms of kernels); one CUDA graph
# per decode bucket brings it to ~4.8 ms, and neither Inductor's pieces nor piecewise graphs
# beat that yet (the step is the weights' GEMVs). Full decode graphs take ~2.7 s to capture;
# breakable graphs for mixed batches cost 10 s more and only help small mixed steps. So by
# default no compiler runs: the forward is eager and decode batches replay full CUDA graphs.
DEFAULT_FORWARD_REASON = ("eager forward by default (compiling does not pay off for decode yet; -O2 "
                          "compiles, -O3 compiles everything ahead); on CUDA, decode batches replay "
                          "full CUDA graphs")
DEFAULT_GPU_GRAPHS = {"cudagraph_mode": "FULL_DECODE_ONLY"}

# Every op with a kernel path beside its native one (kiln.ops). Each CustomOp subclass lists
# the names it answers to, and one not declared here fails when its module is imported, so
# this list and the ops cannot drift apart.
CUSTOM_OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "rotary_embedding",
              "skinny_linear")
CUSTOM_OP_BASES = ("all", "none")
CUSTOM_OPS_EXAMPLE = '["none", "+rms_norm"]'
CPU_STEP_SECONDS = 1.0  # max_step_seconds' default on the CPU
# What sample_in_graph=None means on a GPU with full decode graphs (one process): on since the
# sampling graphs' GPU check (benchmarks/gpu_kernels.py check_sampling_graphs) passed and the
# same-run sampled decode benchmark showed them no slower at any batch size (H100, 2026-12-05).
SAMPLE_IN_GRAPH_BY_DEFAULT = True
# The dtypes whose linear weights the CPU prepacks for oneDNN (kiln/ops/cpu/packed_linear.py).
CPU_PACKED_LINEAR_DTYPES = (torch.bfloat16,)


def has_cuda_gpu() -> bool:
    """torch.cuda.is_available() without starting the CUDA driver: the count comes from NVML
    where it can. A process that started the driver cannot fork a child that uses CUDA, and the
    compile workers are forked (kiln.compile.compile_workers)."""
    return torch.cuda.device_count() > 0


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    block_size: int = 16  # tokens per KV-cache block
    kv_cache_gib: float = 1.0  # CPU: memory for the KV cache
    cpu_threads: int | None = None  # CPU: intra-op threads per process; None: kiln.engine.cpu_threads decides
    gpu_memory_utilization: float = 0.9  # CUDA: share of the GPU kiln may fill, cache included
    num_kv_blocks: int | None = None  # overrides both budgets (tests, small-memory runs)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Prefill chunks are also cut to fit this many seconds a step (kiln.engine.scheduler), so a
    # shutdown deadline or the decodes beside a long prompt wait at most about that long. None:
    # 1 s on the CPU, no time budget on a GPU (whose steps take milliseconds); inf: none.
    max_step_seconds: float | None = None
    max_model_len: int | None = None  # None: the model's context length
    # Schedule and pack step n+1 while step n runs on the device; a sequence's stop is then seen
    # one step late (its extra token is dropped). None: on for one CUDA process, off on the CPU
    # (whose steps run as they are launched: there is nothing to overlap) and under tensor parallelism.
    async_scheduling: bool | None = None
    # Sample a decode step in a CUDA graph of its own after the forward's (kiln.engine.sampling_graphs);
    # needs a GPU's full decode graphs. None: SAMPLE_IN_GRAPH_BY_DEFAULT where those run, one process.
    sample_in_graph: bool | None = None
    # Automatic prefix caching (vLLM's name): full KV blocks keyed by their tokens are shared
    # between sequences and kept after a request ends, so a prompt starting with a cached
    # prefix prefills only the rest (kiln.engine.block_manager).
    enable_prefix_caching: bool = True
    custom_ops: list[str] = field(default_factory=list)  # e.g. ["none", "+rms_norm"]
    seed: int = 0
    # None: what is measured to pay off today (DEFAULT_FORWARD_REASON). A dict is
    # read as -cc keys over the -O2 preset.
    compilation: CompilationConfig | dict | None = None
    enforce_eager: bool = False
    # Processes that share the model, each with a shard of every layer: one per GPU on CUDA,
    # gloo processes on CPU. kiln starts them itself (kiln.distributed.launcher).
    tensor_parallel_size: int = 1
    # "auto": the checkpoint's weights; "dummy": random ones of the same shapes (vLLM's name),
    # for prewarming and benchmarks: compiled code and kernels depend on shapes, not values.
    load_format: str = "auto"

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_step_seconds is not None and not self.max_step_seconds > 0:  # NaN fails too
            raise ValueError(f"max_step_seconds must be > 0 (inf: no time budget), got {self.max_step_seconds}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy' (random weights), got {self.load_format!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of auto, {', '.join(_DTYPES)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_threads is not None and (isinstance(self.cpu_threads, bool) or not isinstance(self.cpu_threads, int)
                                             or self.cpu_threads < 1):
            raise ValueError(f"cpu_threads must be an integer >= 1 (or None: kiln decides), got {self.cpu_threads!r}")
        if self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.device == "cuda" and not has_cuda_gpu():
            raise ValueError("device='cuda' but torch sees no CUDA GPU; use device='cpu' or 'auto'")
        if isinstance(self.compilation, dict):
            self.compilation = compilation_config_from_dict(self.compilation)
        if self.enforce_eager:
            if self.compilation is not None and self.compilation.mode != 0:
                raise ValueError(f"enforce_eager contradicts compilation mode {self.compilation.mode}; drop one")
            self.compilation = CompilationConfig.level(0)
        resolve_custom_ops(self.custom_ops, "none")  # a bad list fails now, not at build time
        cc = self.compilation
        if cc is not None and cc.debug_guards and cc.dynamic_shapes_mark == "backed" and cc.mode in (2, 3):
            # Dynamo specialises a backed count of 1, so the first one-sequence decode step
            # would fail the guard check mid-request.
            raise ValueError("debug_guards with backed dynamic shapes fails every 1-token step (a decode of "
                             "one sequence); add -cc.dynamic_shapes_mark=unbacked to debug the engine")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if tp > 1 and self.async_scheduling:
            raise ValueError("async_scheduling is not supported with tensor_parallel_size > 1 (the ranks run each "
                             "step as it is sent); drop --async-scheduling or use one process")
        if tp > 1 and self.torch_device.type == "cuda" and tp > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={tp} needs {tp} GPUs (one process each) but torch sees "
                             f"{torch.cuda.device_count()}; lower it to at most {torch.cuda.device_count()}")

    @property
    def uses_async_scheduling(self) -> bool:
        if self.async_scheduling is None:
            return self.torch_device.type == "cuda" and self.tensor_parallel_size == 1
        return self.async_scheduling

    @property
    def step_time_budget(self) -> float | None:
        """The seconds a step's prefill chunks are cut to fit, or None (no time budget)."""
        budget = self.max_step_seconds
        if budget is None:
            budget = CPU_STEP_SECONDS if self.torch_device.type == "cpu" else math.inf
        return None if math.isinf(budget) else budget

    @property
    def compilation_config(self) -> CompilationConfig:
        """The compilation settings in force (eager when none were given)."""
        if self.compilation is not None:
            return self.compilation
        graphs = DEFAULT_GPU_GRAPHS if self.torch_device.type == "cuda" else {}
        return CompilationConfig.level(0, **graphs)

    @property
    def default_custom_ops(self) -> list[str]:
        return default_custom_ops(self.compilation_config, self.torch_device.type)

    def resolved_custom_ops(self) -> frozenset[str]:
        """The ops whose kernel path the model takes: `custom_ops`, or the default list."""
        enabled = resolve_custom_ops(self.custom_ops or self.default_custom_ops, "none")
        # The linear op's CPU kernel multiplies by weights prepacked for oneDNN, which only bf16
        # does (kiln/ops/cpu/packed_linear.py); in fp32 the op would be F.linear behind a
        # dispatcher call (6 us more a matmul on the 2-core CPU), so only an explicit
        # +skinny_linear keeps it there.
        if (self.torch_device.type != "cuda" and self.torch_dtype not in CPU_PACKED_LINEAR_DTYPES
                and "+skinny_linear" not in self.custom_ops):
            enabled -= {"skinny_linear"}
        return enabled

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if has_cuda_gpu() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """The engine's flags (those of kiln serve, generate, prewarm, inspect) and the compile flags."""
        p = parser
        p.add_argument("--model", default=None,
                       help="'smollm2' (embedded default), a .gguf file, an HF folder, or a random preset")
        p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
        p.add_argument("--dtype", default="auto")
        p.add_argument("--max-model-len", type=int, default=None)
        p.add_argument("--max-num-seqs", type=int, default=64)
        p.add_argument("--max-num-batched-tokens", type=int, default=2048)
        p.add_argument("--max-step-seconds", type=float, default=None,
                       help="cut prefill chunks to fit this many seconds a step (default: 1 on the CPU, none on a "
                            "GPU; inf: none)")
        p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="prepare the next step while the device runs this one (default: on for one CUDA "
                            "process, off on the CPU and with tensor parallelism)")
        p.add_argument("--sample-in-graph", action=argparse.BooleanOptionalAction, default=None,
                       help="sample decode steps (no logit_bias, penalties, min_tokens or grammar) in a CUDA graph "
                            "per batch size and set of cuts, captured when first needed (needs a GPU's full "
                            "decode graphs; default: on where those run, in one process)")
        p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="share the KV blocks of a prompt's cached prefix instead of computing it again, and "
                            "keep finished requests' blocks until the memory is needed (default: on)")
        p.add_argument("--block-size", type=int, default=16)
        p.add_argument("--kv-cache-gib", type=float, default=1.0)
        p.add_argument("--cpu-threads", type=int, default=None,
                       help="CPU: intra-op threads per process (default: the CPUs no other process keeps busy "
                            "at start, shared by the ranks; OMP_NUM_THREADS, if set, wins)")
        p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        p.add_argument("--custom-ops", default="", help="e.g. 'none,+rms_norm' (one base: all or none)")
        p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                       help="dummy: random weights of the checkpoint's shapes (prewarming, benchmarks)")
        p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="shard the model over N processes kiln starts itself: one per GPU, or gloo processes on CPU")
        add_compilation_arguments(p)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> "EngineConfig":
        """The config the flags ask for; `overrides` (e.g. compilation=...) win over them."""
        values = dict(
            compilation=compilation_config_from_args(args), model=args.model, device=args.device, dtype=args.dtype,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, max_step_seconds=args.max_step_seconds,
            async_scheduling=args.async_scheduling, sample_in_graph=args.sample_in_graph,
            enable_prefix_caching=args.enable_prefix_caching,
            block_size=args.block_size,
            kv_cache_gib=args.kv_cache_gib, cpu_threads=args.cpu_threads,
            gpu_memory_utilization=args.gpu_memory_utilization,
            custom_ops=[s for s in args.custom_ops.split(",") if s], tensor_parallel_size=args.tensor_parallel_size,
            load_format=args.load_format)
        return cls(**{**values, **overrides})


def default_custom_ops(compilation: CompilationConfig, device_type: str = "cpu") -> list[str]:
    """The kernel ops a model gets on `device_type` when `custom_ops` is not set."""
    if not compilation.uses_inductor:
        return ["all"]  # the fused kernels are the only fusion there is
    if device_type == "cuda":
        # Every kernel under Inductor too: its rotary of q and of k beside kiln's KV write are three
        # launches where kiln's rotary writes the cache in one, and at one row the SiLU rides in
        # kiln's GEMV. -O2's decode step was 1-2% slower without them at batches 1-256 (H200,
        # llama-3-8b, decode_vs_reference_cuda_O2_kernels.json, 2026-12-04: "O2" against "O2 kernels").
        return ["all"]
    # Inductor fuses the native paths better than opaque kernels, but a norm it fuses sums its
    # row in another order than eager's kernel: in bf16 the rounding that follows flipped 22 of
    # 50 greedy SmolLM2 chats (benchmarks/greedy_agreement.py). The norms stay kernels, so
    # compiled tokens follow eager's.
    # The GEMV (CUDA only: resolved_custom_ops drops it elsewhere) for the same reason: cuBLAS sums
    # a row in another order; it is also faster below 64 rows (H200: 4.45 vs 4.74 ms at batch 1).
    return ["none", "+rms_norm", "+fused_add_rms_norm", "+skinny_linear"]


def resolve_custom_ops(spec: list[str] | tuple[str, ...] | str, default_base: str) -> frozenset[str]:
    """Turn a `custom_ops` list into the set of op names whose kernel path is on.

    The list holds exactly one base, `all` or `none`, plus `+name` / `-name` overrides;
    an empty list means `[default_base]`.
    """
    if isinstance(spec, str):
        spec = [s.strip() for s in spec.split(",") if s.strip()]
    spec = list(spec) or [default_base]
    bases = [s for s in spec if s in CUSTOM_OP_BASES]
    if len(bases) != 1:
        raise ValueError(
            f"custom_ops must hold exactly one base ('all' or 'none'), got {len(bases)} in {spec!r}; "
            f"for example custom_ops={CUSTOM_OPS_EXAMPLE}"
        )
    enabled = set(CUSTOM_OPS) if bases[0] == "all" else set()
    for item in spec:
        if item in CUSTOM_OP_BASES:
            continue
        sign, name = item[:1], item[1:]
        if sign not in "+-" or not sign or name not in CUSTOM_OPS:
            raise ValueError(
                f"custom_ops entry {item!r} is not '+name' or '-name' with a known op "
                f"({', '.join(sorted(CUSTOM_OPS))}); for example custom_ops={CUSTOM_OPS_EXAMPLE}"
            )
        (enabled.add if sign == "+" else enabled.discard)(name)
    return frozenset(enabled)
