"""The compilation settings: CompilationConfig, the per-phase CUDA-graph settings, the -O
levels, and the command-line flags that set them (-O<n>, -cc.<key>=<value>,
--compilation-config '<json>', --enforce-eager). Checked here, at start-up.

Data only: kiln.compile reads these settings, and so does kiln.cudagraph; graph-pass names
are checked against the pass registry when a config is made.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field

# The compile pipeline (kiln.compile). Modes:
#   0 none: the model's forward runs eagerly.
#   1 stock: torch.compile with Dynamo's guards checked on every call (the baseline).
#   2 once: Dynamo captures once, `backend` compiles the whole graph, later calls skip Dynamo.
#   3 piecewise: Dynamo captures once, the graph is split at opaque ops and every piece is
#     compiled per compile range and exact size; later calls skip Dynamo.
COMPILATION_MODES = (0, 1, 2, 3)
COMPILATION_LEVELS: dict[int, dict] = {
    0: {"mode": 0},
    # capture and split, no code generation
    1: {"mode": 3, "piece_compiler": "eager", "cudagraph_mode": "PIECEWISE"},
    2: {"mode": 3, "piece_compiler": "inductor", "strategy": "lazy", "cudagraph_mode": "FULL_AND_PIECEWISE"},
    # Everything ahead of serving, with static compiles for the smallest decode batches.
    3: {"mode": 3, "piece_compiler": "inductor", "strategy": "eager", "compile_sizes": [1, 2, 4, 8],
        "cudagraph_mode": "FULL_AND_PIECEWISE"},
}

# CUDA graphs. A step is a uniform decode batch (every sequence adds one token) or a mixed
# one (prefill chunks, maybe with decodes); each phase has its own graph setting. The modes
# are presets of the two: mode -> (mixed batches, uniform decode batches).
CUDAGRAPH_MODES = {
    "NONE": ("none", "none"),
    "PIECEWISE": ("piecewise", "piecewise"),
    "FULL": ("full", "full"),
    "FULL_DECODE_ONLY": ("none", "full"),
    "FULL_AND_PIECEWISE": ("piecewise", "full"),
}
PHASE_GRAPH_MODES = ("full", "piecewise", "breakable", "none")
PHASE_COMPILERS = ("inductor", "eager")
# When a phase's graphs are captured. Decode steps are most steps, so their graphs are ready
# with the engine; a mixed step comes once per prompt chunk, and its buckets (a capture per
# compiled piece each, in piecewise mode) would otherwise make most of an -O2 start's captures.
PHASE_CAPTURE_TIMES = ("start", "first_use")
DEFAULT_PHASE_CAPTURE = {"prefill": "first_use", "decode": "start"}

# Inductor settings of kiln's piece compiles unless inductor_compile_config says otherwise.
# A fused kernel keeps a bf16/fp16 op's result in fp32 for the next op where eager rounds it;
# rounding as eager does keeps compiled greedy tokens on eager's (without it 25 of 50 SmolLM2
# bf16 chats stayed equal, benchmarks/greedy_agreement.py; with it 50).
INDUCTOR_DEFAULTS = {"emulate_precision_casts": True}
# Set by kiln from other fields; inductor_compile_config may not set them.
INDUCTOR_KILN_OWNED = {"post_grad_custom_post_pass": "passes", "graph_partition": "splitting_mode",
                       "custom_should_partition_ops": "splitting_mode"}


@dataclass(frozen=True)
class PhaseGraphs:
    """How one phase (prefill = mixed batches, decode = uniform decode batches) runs.

    mode: full (one graph per bucket, attention inside), piecewise (a graph per compiled
    piece, attention eager between them), breakable (no compiler: the eager forward's
    stream capture is cut at each attention call) or none.
    compiler: inductor (kiln's compiled forward) or eager (the model's own forward).
    max_batch: largest bucket, in tokens (prefill) or sequences (decode); None: the global
    max. sizes: explicit buckets. static_compile (decode, full): SGLang's path, a whole
    forward compiled by Inductor with static shapes per bucket up to static_max_batch;
    larger decode batches run eagerly. capture: "start" (every bucket before the engine is
    ready) or "first_use" (a bucket when a step first needs it, or while the engine idles).
    """

    mode: str
    compiler: str
    max_batch: int | None = None
    sizes: tuple[int, ...] = ()
    static_compile: bool = False
    static_max_batch: int = 32
    capture: str = "start"
DEFAULT_COMPILATION_LEVEL = 2
SPLITTING_MODES = ("fx", "inductor_partition", "none")


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
    cudagraph_mode: str = "NONE"  # a CUDAGRAPH_MODES preset for both phases
    cudagraph_capture_sizes: list[int] = field(default_factory=list)  # buckets; []: the default ladder
    max_cudagraph_capture_size: int | None = None  # None: 2 * max_num_seqs, at most 512
    # Per-phase overrides of the preset: {"mode", "compiler", "max_batch", "sizes"} (decode
    # also "static_compile", "static_max_batch"); see PhaseGraphs.
    cudagraph_prefill: dict = field(default_factory=dict)
    cudagraph_decode: dict = field(default_factory=dict)
    cudagraph_debug: bool = False  # check on every replay that inputs sit where they were captured
    # Where the graph is cut at the split ops (mode 3): "fx" splits the FX graph and compiles
    # each piece on its own; "inductor_partition" compiles the whole graph (so whole-graph
    # passes see it) and Inductor partitions it at the same ops; "none" does not cut at all.
    splitting_mode: str = "fx"
    # FX splitting: consecutive split ops (the KV write right before attention) form one
    # opaque region (L regions, L+1 pieces for L layers); false gives SGLang's scan, each
    # split op its own region (2L regions).
    merge_consecutive_split_ops: bool = True
    # Graph passes run inside Inductor (kiln.compile.passes), in their fixed order, e.g.
    # ["noop_elimination", "fuse_add_rms_norm", "sequence_parallel", "reinplace"].
    passes: list[str] = field(default_factory=list)
    pass_dump_dir: str | None = None  # debug: the graph before and after each pass, under this dir
    # Processes that compile unique pieces side by side on a cold start (mode 3, Inductor
    # pieces, compile cache on); None: one per 4 cores, at most 4 (none below 8 cores); 0/1: in-process.
    compile_workers: int | None = None
    # Dynamo traces one call of each kind of @repeated_layer and kiln stamps the graph for the
    # others (kiln.compile.layer_stamping); false: trace every layer. stamp_mechanism: "auto"
    # (nested_compile_region where torch >= 2.12 has reuse_hash_fn, else kiln's own),
    # "nested_compile_region" or "kiln" (any torch).
    stamp_repeated_layers: bool = True
    stamp_mechanism: str = "auto"
    # torch._inductor.config settings patched around kiln's Inductor compiles (mode 3), over
    # INDUCTOR_DEFAULTS, e.g. {"emulate_precision_casts": false} (vLLM's name).
    inductor_compile_config: dict = field(default_factory=dict)

    _CHOICES = {"backend": None, "piece_compiler": ("inductor", "eager"), "strategy": ("eager", "lazy"),
                "dynamic_shapes_mark": ("backed", "unbacked"), "splitting_mode": SPLITTING_MODES,
                "stamp_mechanism": ("auto", "nested_compile_region", "kiln")}

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
        workers = self.compile_workers
        if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 0):
            raise ValueError(f"compilation compile_workers must be a count >= 0 (0 or 1: compile in-process) or "
                             f"null (one per 4 cores), got {workers!r}")
        for name in ("debug_guards", "cudagraph_debug", "stamp_repeated_layers", "merge_consecutive_split_ops"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"compilation {name} must be true or false, got {getattr(self, name)!r}")
        self._check_cudagraphs()
        self._check_passes()
        self._check_inductor_settings()
        if self.mode == 2:
            import torch._dynamo

            valid = torch._dynamo.list_backends(exclude_tags=())
            if self.backend not in valid:
                raise ValueError(f"compilation backend {self.backend!r} is unknown; valid: {', '.join(valid)}")

    def _check_passes(self) -> None:
        whole = []
        if self.passes:
            # Only here: the registry imports FX and fake-tensor code (sympy with them, 0.3 s on a
            # CPU core) that a config without passes, like the eager default's, need not load.
            from kiln.compile.passes.registry import check_pass_names, pass_class

            check_pass_names(self.passes)
            whole = [name for name in self.passes if pass_class(name).needs_whole_graph]
        inductor = self.mode == 3 and self.piece_compiler == "inductor"
        if self.passes and not inductor:
            raise ValueError(f"compilation passes {self.passes} run inside Inductor's piece compiler; use mode 3 "
                             f"with piece_compiler 'inductor' (-O2 or -O3)")
        if self.splitting_mode != "fx" and not inductor:
            raise ValueError(f"compilation splitting_mode {self.splitting_mode!r} hands the whole graph to "
                             f"Inductor; use mode 3 with piece_compiler 'inductor' (-O2 or -O3), or "
                             f"splitting_mode 'fx'")
        if self.splitting_mode == "none" and self.splitting_ops:
            raise ValueError(f"compilation splitting_ops {self.splitting_ops} cut nothing with splitting_mode "
                             f"'none'; drop them, or use splitting_mode 'inductor_partition' to partition there")
        if whole and self.splitting_mode == "fx":
            raise ValueError(f"the {', '.join(whole)} pass rewrites the graph across the split ops (attention), "
                             f"so it needs the whole graph, but splitting_mode 'fx' cuts the graph there before "
                             f"any pass runs. Set -cc.splitting_mode=inductor_partition (Inductor partitions at "
                             f"the same ops after the passes) or -cc.splitting_mode=none")
        if self.pass_dump_dir is not None and not isinstance(self.pass_dump_dir, str):
            raise ValueError(f"compilation pass_dump_dir must be a directory path, got {self.pass_dump_dir!r}")

    def _check_inductor_settings(self) -> None:
        settings = self.inductor_compile_config
        if not isinstance(settings, dict):
            raise ValueError(f"compilation inductor_compile_config must be a JSON object of torch._inductor.config "
                             f"settings like {{\"emulate_precision_casts\": false}}, got {settings!r}")
        if not settings:
            return
        import torch._inductor.config  # only here: most configs set nothing

        for name, value in settings.items():
            if name in INDUCTOR_KILN_OWNED:
                raise ValueError(f"compilation inductor_compile_config sets {name!r}, which kiln sets from "
                                 f"compilation {INDUCTOR_KILN_OWNED[name]}; use that setting instead")
            if not hasattr(torch._inductor.config, name.split(".")[0]):
                raise ValueError(f"compilation inductor_compile_config: {name!r} is not a torch._inductor.config "
                                 f"setting of torch {torch.__version__}")
            if not isinstance(value, (bool, int, float, str, type(None), list)):
                raise ValueError(f"compilation inductor_compile_config[{name!r}] must be a JSON value, got {value!r}")

    def inductor_settings(self) -> dict:
        """The Inductor settings of kiln's piece compiles that this config chooses: the defaults,
        then inductor_compile_config (the passes and partitioning are the compiler's to add)."""
        return {**INDUCTOR_DEFAULTS, **self.inductor_compile_config}

    def _check_cudagraphs(self) -> None:
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"compilation cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, "
                             f"got {self.cudagraph_mode!r}")
        sizes = self.cudagraph_capture_sizes
        if any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in sizes) or list(sizes) != sorted(set(sizes)):
            raise ValueError(f"compilation cudagraph_capture_sizes must be strictly increasing positive "
                             f"integers, got {sizes!r}")
        top = self.max_cudagraph_capture_size
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or top < 1):
            raise ValueError(f"compilation max_cudagraph_capture_size must be a positive integer, got {top!r}")
        for phase in ("prefill", "decode"):
            self.phase_graphs(phase)  # a bad override fails here, at start-up

    def phase_graphs(self, phase: str) -> PhaseGraphs:
        """The graph setting of `phase` ("prefill" or "decode"): the preset, then the overrides."""
        overrides = getattr(self, f"cudagraph_{phase}")
        where = f"compilation cudagraph_{phase}"
        if not isinstance(overrides, dict):
            raise ValueError(f"{where} must be a JSON object like {{\"mode\": \"full\"}}, got {overrides!r}")
        valid = ["mode", "compiler", "max_batch", "sizes", "capture"] + (["static_compile", "static_max_batch"]
                                                             if phase == "decode" else [])
        unknown = sorted(set(overrides) - set(valid))
        if unknown:
            raise ValueError(f"{where} has unknown key(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
        preset = CUDAGRAPH_MODES[self.cudagraph_mode][phase == "decode"]
        mode = overrides.get("mode", preset)
        compiler = overrides.get("compiler", "eager" if self.mode == 0 else "inductor")
        if mode not in PHASE_GRAPH_MODES:
            raise ValueError(f"{where} mode must be one of {', '.join(PHASE_GRAPH_MODES)}, got {mode!r}")
        if compiler not in PHASE_COMPILERS:
            raise ValueError(f"{where} compiler must be one of {', '.join(PHASE_COMPILERS)}, got {compiler!r}")
        static = overrides.get("static_compile", False)
        static_max = overrides.get("static_max_batch", 32)
        max_batch = overrides.get("max_batch")
        sizes = overrides.get("sizes", [])
        capture = overrides.get("capture", DEFAULT_PHASE_CAPTURE[phase])
        if not isinstance(static, bool):
            raise ValueError(f"{where} static_compile must be true or false, got {static!r}")
        if capture not in PHASE_CAPTURE_TIMES:
            raise ValueError(f"{where} capture must be one of {', '.join(PHASE_CAPTURE_TIMES)}, got {capture!r}")
        for name, value in (("max_batch", max_batch), ("static_max_batch", static_max)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{where} {name} must be a positive integer, got {value!r}")
        if (not isinstance(sizes, list) or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in sizes)
                or sizes != sorted(set(sizes))):
            raise ValueError(f"{where} sizes must be strictly increasing positive integers, got {sizes!r}")
        if compiler == "inductor" and self.mode == 0 and not static:
            raise ValueError(f"{where} compiler 'inductor' needs a compiled forward, but compilation mode "
                             f"is 0; use -O2 or set the phase's compiler to 'eager'")
        if mode == "piecewise" and (compiler != "inductor" or self.mode != 3):
            raise ValueError(f"{where}: piecewise graphs replay the pieces of kiln's split graph, which "
                             f"needs compilation mode 3 (-O1..-O3) and compiler 'inductor' (got mode "
                             f"{self.mode}, compiler {compiler!r}); use mode 'breakable' to graph the "
                             f"eager forward, or 'full'")
        if mode == "piecewise" and self.splitting_mode == "none":
            raise ValueError(f"{where}: piecewise graphs replay the compiled regions between attention calls "
                             f"(FX pieces, or Inductor's partitions), but splitting_mode 'none' cuts nothing and "
                             f"leaves attention inside the compiled graph, where a piecewise graph would freeze "
                             f"one step's metadata; use cudagraph_mode FULL or FULL_DECODE_ONLY (full graphs "
                             f"hold static metadata), or splitting_mode 'fx' or 'inductor_partition'")
        if static and mode != "full":
            raise ValueError(f"{where}: static_compile captures whole-forward graphs; it needs mode "
                             f"'full', got {mode!r}")
        return PhaseGraphs(mode, compiler, max_batch, tuple(sizes), static, static_max, capture)

    @classmethod
    def level(cls, n: int, **overrides) -> "CompilationConfig":
        """The -O<n> preset, with `overrides` on top."""
        if n not in COMPILATION_LEVELS:
            raise ValueError(f"optimisation level -O{n} is unknown; valid: "
                             f"{', '.join(f'-O{k}' for k in COMPILATION_LEVELS)}")
        values = {**COMPILATION_LEVELS[n], **overrides}
        whole_graph = values.get("mode", 3) != 3 or values.get("splitting_mode", "fx") == "none"
        if "cudagraph_mode" not in overrides and whole_graph:
            # Piecewise graphs need mode 3's regions between the split ops; a graph cut nowhere gets whole graphs.
            values["cudagraph_mode"] = "NONE" if values.get("mode") == 0 else "FULL"
        return cls(**values)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        add_compilation_arguments(parser)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "CompilationConfig | None":
        return compilation_config_from_args(args)

    def static_decode(self, sizes: list[int]) -> "CompilationConfig":
        """SGLang's static decode compile (cudagraph_decode static_compile) as a kiln compile: the
        whole forward, uncut (attention inside Inductor's code), for each decode bucket's exact
        token count. SGLang traces once per bucket; here Dynamo captures once and Inductor
        specialises per size, and the compile cache keeps every size."""
        return dataclasses.replace(self, mode=3, piece_compiler="inductor", splitting_mode="none", splitting_ops=[],
                                   compile_ranges=[], compile_sizes=list(sizes), strategy="lazy",
                                   cudagraph_mode="NONE", cudagraph_prefill={}, cudagraph_decode={})

    @property
    def uses_inductor(self) -> bool:
        """Whether Inductor generates the code (then native op paths fuse better than kernels)."""
        return (self.mode == 1 or (self.mode == 2 and self.backend == "inductor")
                or (self.mode == 3 and self.piece_compiler == "inductor"))


def _compilation_value(key: str, raw):
    """A -cc.<key>=<value> string (or a JSON value) converted to the field's type."""
    if not isinstance(raw, str):
        return raw
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


def add_compilation_arguments(parser: argparse.ArgumentParser) -> None:
    """The compile flags, as `kiln serve --help` shows them. -cc.<key>=<value> is not
    argparse-shaped: `expand_compilation_flags` turns it into `-cc <key>=<value>` first."""
    group = parser.add_argument_group("compilation", "no flag: eager forward (full CUDA graphs for decode "
                                                     "on a GPU); keys set with -cc win over the -O preset")
    levels = ", ".join(f"-O{k}" for k in COMPILATION_LEVELS)
    group.add_argument("-O", dest="compile_level", metavar="N", default=None,
                       help=f"optimisation level: {levels} (-O2 kiln piecewise, -O3 everything ahead)")
    group.add_argument("-cc", "--compilation-config", dest="compile_settings", action="append", default=[],
                       metavar="KEY=VALUE|JSON",
                       help="one CompilationConfig field (-cc.mode=3, -cc.compile_ranges=8,64) or a JSON object")
    group.add_argument("--enforce-eager", action="store_true", help="mode 0, no CUDA graphs")


def expand_compilation_flags(argv: list[str]) -> list[str]:
    """-cc.<key>=<value> as `-cc <key>=<value>`, the shape argparse reads."""
    out = []
    for arg in argv:
        if arg.startswith("-cc."):
            key, sep, raw = arg[4:].partition("=")
            if not sep:
                raise ValueError(f"{arg!r} must look like -cc.<key>=<value>, e.g. -cc.mode=3")
            out += ["-cc", f"{key}={raw}"]
        else:
            out.append(arg)
    return out


def compilation_config_from_args(args: argparse.Namespace) -> CompilationConfig | None:
    """The settings the compile flags ask for; None when no flag was given (the engine then
    runs its default forward). --enforce-eager contradicts any explicit other mode."""
    level, values = None, {}
    if args.compile_level is not None:
        text = str(args.compile_level)
        if not text.isdigit():
            raise ValueError(f"-O takes a level, one of {', '.join(f'-O{k}' for k in COMPILATION_LEVELS)}; "
                             f"got -O{text!r}")
        level = int(text)
    for setting in args.compile_settings:
        if setting.lstrip().startswith("{"):
            try:
                parsed = json.loads(setting)
            except json.JSONDecodeError as e:
                raise ValueError(f"--compilation-config takes a JSON object, got {setting!r}: {e}") from None
            if not isinstance(parsed, dict):
                raise ValueError(f"--compilation-config takes a JSON object, got {setting!r}")
            values.update(parsed)
        else:
            key, sep, raw = setting.partition("=")
            if not sep:
                raise ValueError(f"-cc {setting!r} must look like -cc.<key>=<value> or a JSON object, e.g. "
                                 f"-cc.mode=3")
            values[key] = raw
    if args.enforce_eager:
        if (level or 0) != 0 or _compilation_value("mode", values.get("mode", 0)) != 0:
            raise ValueError("--enforce-eager contradicts the requested compilation level or mode; drop one")
        level = 0
    if level is None and not values:
        return None
    return compilation_config_from_dict(values, level)


def parse_compilation_args(argv: list[str]) -> tuple[list[str], CompilationConfig]:
    """Take the compile flags out of argv: (the other arguments, the settings). No flag gives
    the default level's preset."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_compilation_arguments(parser)
    parser.error = _raise  # a bad flag is a ValueError here, as everywhere in the config
    args, rest = parser.parse_known_args(expand_compilation_flags(argv))
    return rest, compilation_config_from_args(args) or CompilationConfig.level(DEFAULT_COMPILATION_LEVEL)


def _raise(message: str):
    raise ValueError(message)
