"""Every user-facing knob, one dataclass per concern; contradictions fail here, at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.ops.custom_op import resolve_custom_ops

# Measured with benchmarks/engine_throughput.py, profile_step.py and compile_time.py
# (benchmarks/results/): on this CPU -O2 gains 1-9% a step for ~15 s of cold compile; on
# the H200 a decode step is host-bound either way (~5 ms of kernels in ~20 ms) and the
# compiled pieces add host time until CUDA graphs replay them. So eager is the default.
DEFAULT_FORWARD_REASON = ("eager by default: compiling does not pay off for decode until CUDA graphs "
                          "land (-O2 compiles, -O3 compiles everything ahead)")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    block_size: int = 16  # tokens per KV-cache block
    kv_cache_gib: float = 1.0  # CPU: memory for the KV cache
    gpu_memory_utilization: float = 0.9  # CUDA: share of the GPU kiln may fill, cache included
    num_kv_blocks: int | None = None  # overrides both budgets (tests, small-memory runs)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context length
    custom_ops: list[str] = field(default_factory=list)  # e.g. ["none", "+rms_norm"]
    seed: int = 0
    # None: eager, where it is measured to pay off today (DEFAULT_FORWARD_REASON). A dict is
    # read as -cc keys over the -O2 preset.
    compilation: CompilationConfig | dict | None = None
    enforce_eager: bool = False

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of auto, {', '.join(_DTYPES)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA GPU; use device='cpu' or 'auto'")
        if isinstance(self.compilation, dict):
            self.compilation = compilation_config_from_dict(self.compilation)
        if self.enforce_eager:
            if self.compilation is not None and self.compilation.mode != 0:
                raise ValueError(f"enforce_eager contradicts compilation mode {self.compilation.mode}; drop one")
            self.compilation = CompilationConfig.level(0)
        resolve_custom_ops(self.custom_ops, "none")  # a bad list fails now, not at build time

    @property
    def compilation_config(self) -> CompilationConfig:
        """The compilation settings in force (eager when none were given)."""
        return self.compilation if self.compilation is not None else CompilationConfig.level(0)

    @property
    def default_custom_ops_base(self) -> str:
        # Inductor fuses the native paths better than opaque kernels; without it the fused
        # kernels are the only fusion there is.
        return "none" if self.compilation_config.uses_inductor else "all"

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]


# The compile pipeline (kiln.compile). Modes:
#   0 none: the model's forward runs eagerly.
#   1 stock: torch.compile with Dynamo's guards checked on every call (the baseline).
#   2 once: Dynamo captures once, `backend` compiles the whole graph, later calls skip Dynamo.
#   3 piecewise: Dynamo captures once, the graph is split at opaque ops and every piece is
#     compiled per compile range and exact size; later calls skip Dynamo.
COMPILATION_MODES = (0, 1, 2, 3)
COMPILATION_LEVELS: dict[int, dict] = {
    0: {"mode": 0},
    1: {"mode": 3, "piece_compiler": "eager"},  # capture and split, no code generation
    2: {"mode": 3, "piece_compiler": "inductor", "strategy": "lazy"},
    # Everything ahead of serving, with static compiles for the smallest decode batches.
    3: {"mode": 3, "piece_compiler": "inductor", "strategy": "eager", "compile_sizes": [1, 2, 4, 8]},
}
DEFAULT_COMPILATION_LEVEL = 2


@dataclass
class CompilationConfig:
    mode: int = 3
    backend: str = "inductor"  # mode 2: any torch.compile backend name ("inductor", "eager", "aot_eager")
    piece_compiler: str = "inductor"  # mode 3: "inductor" | "eager" (pieces run as captured)
    compile_ranges: list[int] = field(default_factory=list)  # endpoints cutting [1, max_num_batched_tokens]
    compile_sizes: list[int] = field(default_factory=list)  # token counts that get their own static compile
    strategy: str = "lazy"  # "eager": compile every range and size at capture | "lazy": on first use
    splitting_ops: list[str] = field(default_factory=list)  # op names split at, besides @split_op ones
    dynamic_shapes_mark: str = "backed"  # "backed" (mark_dynamic) | "unbacked" (mark_unbacked)
    # Keep Dynamo's shape guards, check them on every call (through Dynamo: slower), and fail
    # on a recompile. With backed marking a 1-token call fails too: Dynamo assumes >= 2 tokens
    # (kiln runs such calls on the general graph); use unbacked marking to debug decode.
    debug_guards: bool = False

    _CHOICES = {"backend": None, "piece_compiler": ("inductor", "eager"), "strategy": ("eager", "lazy"),
                "dynamic_shapes_mark": ("backed", "unbacked")}

    def __post_init__(self):
        if isinstance(self.mode, bool) or self.mode not in COMPILATION_MODES:
            raise ValueError(f"compilation mode must be one of {COMPILATION_MODES} (0 none, 1 stock "
                             f"torch.compile, 2 Dynamo once + backend, 3 kiln piecewise), got {self.mode!r}")
        for name, choices in self._CHOICES.items():
            value = getattr(self, name)
            if not isinstance(value, str) or (choices and value not in choices):
                raise ValueError(f"compilation {name} must be one of {', '.join(choices or ['a backend name'])}, "
                                 f"got {value!r}")
        for name in ("compile_ranges", "compile_sizes"):
            values = getattr(self, name)
            if any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
                raise ValueError(f"compilation {name} must be positive integers, got {values!r}")
            if list(values) != sorted(set(values)):
                raise ValueError(f"compilation {name} must be strictly increasing, got {values!r}")
        if any(not isinstance(op, str) or not op for op in self.splitting_ops):
            raise ValueError(f"compilation splitting_ops must be op names like 'kiln::attention', "
                             f"got {self.splitting_ops!r}")
        if not isinstance(self.debug_guards, bool):
            raise ValueError(f"compilation debug_guards must be true or false, got {self.debug_guards!r}")
        if self.mode == 2:
            import torch._dynamo

            valid = torch._dynamo.list_backends(exclude_tags=())
            if self.backend not in valid:
                raise ValueError(f"compilation backend {self.backend!r} is unknown; valid: {', '.join(valid)}")

    @classmethod
    def level(cls, n: int, **overrides) -> "CompilationConfig":
        """The -O<n> preset, with `overrides` on top."""
        if n not in COMPILATION_LEVELS:
            raise ValueError(f"optimisation level -O{n} is unknown; valid: "
                             f"{', '.join(f'-O{k}' for k in COMPILATION_LEVELS)}")
        return cls(**{**COMPILATION_LEVELS[n], **overrides})

    @property
    def uses_inductor(self) -> bool:
        """Whether Inductor generates the code (then native op paths fuse better than kernels)."""
        return (self.mode == 1 or (self.mode == 2 and self.backend == "inductor")
                or (self.mode == 3 and self.piece_compiler == "inductor"))


def _compilation_value(key: str, raw):
    """A -cc.<key>=<value> string (or a JSON value) converted to the field's type."""
    if not isinstance(raw, str):
        return raw
    import json

    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    kind = CompilationConfig.__dataclass_fields__[key].type
    if kind.startswith("list") and isinstance(value, (str, int)):
        items = [s.strip() for s in str(value).split(",") if s.strip()]
        value = [int(s) if s.lstrip("-").isdigit() else s for s in items] if "int" in kind else items
    if kind == "bool" and isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    return value


def compilation_config_from_dict(values: dict, level: int | None = None) -> CompilationConfig:
    """A CompilationConfig from `values` over the -O`level` preset (the default level if None)."""
    valid = [f for f in CompilationConfig.__dataclass_fields__ if not f.startswith("_")]
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise ValueError(f"unknown compilation config key(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
    typed = {k: _compilation_value(k, v) for k, v in values.items()}
    return CompilationConfig.level(DEFAULT_COMPILATION_LEVEL if level is None else level, **typed)


def parse_compilation_args(argv: list[str]) -> tuple[list[str], CompilationConfig]:
    """Take -O<n>, -cc.<key>=<value>, --compilation-config '<json>' and --enforce-eager out of argv.

    Keys set explicitly win over the -O preset, whatever their order. --enforce-eager is mode 0
    and contradicts any explicit request for another mode.
    """
    import json

    rest, values, level, eager = [], {}, None, False
    args = iter(argv)
    for arg in args:
        if arg.startswith("-O") and not arg.startswith("--"):
            text = arg[2:] or next(args, "")
            if not text.isdigit():
                raise ValueError(f"-O takes a level, one of {', '.join(f'-O{k}' for k in COMPILATION_LEVELS)}; "
                                 f"got {arg!r}")
            level = int(text)
        elif arg.startswith("-cc."):
            key, sep, raw = arg[4:].partition("=")
            if not sep:
                raise ValueError(f"{arg!r} must look like -cc.<key>=<value>, e.g. -cc.mode=3")
            values[key] = raw
        elif arg == "--compilation-config" or arg.startswith("--compilation-config="):
            text = arg.partition("=")[2] if "=" in arg else next(args, "")
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"--compilation-config takes a JSON object, got {text!r}: {e}") from None
            if not isinstance(parsed, dict):
                raise ValueError(f"--compilation-config takes a JSON object, got {text!r}")
            values.update(parsed)
        elif arg == "--enforce-eager":
            eager = True
        else:
            rest.append(arg)
    if eager:
        if (level or 0) != 0 or _compilation_value("mode", values.get("mode", 0)) != 0:
            raise ValueError("--enforce-eager contradicts the requested compilation level or mode; drop one")
        level = 0
    return rest, compilation_config_from_dict(values, level)
