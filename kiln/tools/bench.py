"""`kiln bench`: eager, stock torch.compile and kiln's modes side by side, in one process.

One workload for every mode: `batch` sequences of `context` random tokens are prefilled
through kiln's engine, then decoded; the median decode step (scheduling, forward,
sampling: all of `LLMEngine.step`) is timed per batch size. A torch.profiler trace of a
few more steps counts what a step launches: CUDA kernels on a GPU; on a CPU, which has
no launches, the closest thing: the outermost ops the step runs (aten and kiln ops,
Inductor's C++ kernels), views and allocations left out.

The floor is what the hardware allows, measured in the same run: a decode step must read
every weight but the embedding table (only gathered) and each sequence's KV cache, at
best at the rate of a large copy, and must do its matmul FLOPs, at best at the rate of a
large square matmul. The larger of the two times is the floor.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from kiln.compile.config import CompilationConfig
from kiln.models.config import ModelArchConfig
from kiln.tools.traffic import decode_weight_bytes

# name -> (label, settings); "stock" is plain torch.compile with its guards, the baseline.
MODES = {
    "eager": ("kiln -O0 (eager)", lambda: CompilationConfig.level(0)),
    "stock": ("torch.compile (mode 1)", lambda: CompilationConfig(mode=1)),
    "once": ("kiln mode 2 (Dynamo once, Inductor)", lambda: CompilationConfig(mode=2, backend="inductor")),
    "O2": ("kiln -O2 (piecewise, lazy)", lambda: CompilationConfig.level(2)),
    "O3": ("kiln -O3 (piecewise, sizes 1-8 ahead)", lambda: CompilationConfig.level(3)),
}
# Metadata-only or allocating ops: on a GPU none of them is a kernel launch.
NOT_WORK = {"view", "reshape_alias", "_reshape_alias", "as_strided", "unsqueeze", "squeeze", "t", "transpose",
            "permute", "expand", "slice", "select", "split", "split_with_sizes", "chunk", "narrow", "flatten",
            "unflatten", "detach", "detach_", "alias", "lift_fresh", "resolve_conj", "resolve_neg", "empty",
            "empty_like", "empty_strided", "new_empty", "unbind"}


@dataclass
class Workload:
    model: str
    device: str
    dtype: str
    batches: list[int]
    context: int = 128
    warmup_steps: int = 3
    timed_steps: int = 10
    profiled_steps: int = 2
    modes: list[str] = field(default_factory=lambda: list(MODES))
    tensor_parallel_size: int = 1

    @classmethod
    def default(cls, device: str, model: str | None = None, **overrides) -> "Workload":
        if device == "cuda":
            base = cls(model or "llama-3-8b", "cuda", "bfloat16", [1, 8, 64, 256], warmup_steps=5,
                       timed_steps=20, profiled_steps=3)
        else:
            base = cls(model or "smollm2", "cpu", "float32", [1, 8, 32])
        for key, value in overrides.items():
            if value is not None:
                setattr(base, key, value)
        base.dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(base.dtype, base.dtype)
        if not isinstance(getattr(torch, base.dtype, None), torch.dtype):
            raise ValueError(f"dtype {base.dtype!r} is not one of bfloat16, float16, float32 (bf16, fp16, fp32)")
        unknown = sorted(set(base.modes) - set(MODES))
        if unknown:
            raise ValueError(f"unknown bench mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")
        return base

    @property
    def max_tokens(self) -> int:
        # Prefill chunks interleave with the first decodes; the margin keeps every sequence
        # running until the profiled steps are done.
        return self.warmup_steps + self.timed_steps + self.profiled_steps + 32


@dataclass
class Point:
    batch: int
    step_ms: float  # median decode step
    ops_per_step: float  # kernels (CUDA) or outermost ops (CPU), from the trace
    mean_seq_len: float  # tokens each sequence attends to, over the timed steps
    top_ops: dict[str, float]  # the most frequent names per step


@dataclass
class ModeResult:
    name: str
    label: str
    startup_s: float = 0.0
    compile_stats: dict = field(default_factory=dict)
    points: list[Point] = field(default_factory=list)
    error: str | None = None


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_mode(name: str, w: Workload) -> ModeResult:
    from kiln import LLM

    label, config = MODES[name]
    result = ModeResult(name, label)
    start = time.perf_counter()
    blocks_per_seq = -(-(w.context + w.max_tokens + 1) // 16)
    try:
        llm = LLM(w.model, device=w.device, dtype=w.dtype, max_num_seqs=max(w.batches),
                  max_num_batched_tokens=2048, max_model_len=w.context + w.max_tokens + 16,
                  num_kv_blocks=max(w.batches) * blocks_per_seq + 8, compilation=config(),
                  tensor_parallel_size=w.tensor_parallel_size)
    except Exception as e:  # one mode that cannot start must not lose the others' numbers
        result.error = f"{type(e).__name__}: {e}".splitlines()[0]
        return result
    result.startup_s = time.perf_counter() - start
    for batch in w.batches:
        result.points.append(decode_point(llm.engine, batch, w))
        p = result.points[-1]
        print(f"  {label}, batch {batch}: {p.step_ms:.2f} ms a decode step, {p.ops_per_step:.0f} ops", flush=True)
    result.compile_stats = llm.engine.runner.compiled.stats
    llm.shutdown()  # the next mode starts its own tensor-parallel workers
    del llm
    gc.collect()
    if w.device == "cuda":
        torch.cuda.empty_cache()
    return result


def decode_point(engine, batch: int, w: Workload) -> Point:
    from kiln import SamplingParams

    gen = torch.Generator().manual_seed(batch)
    vocab = engine.source.config.vocab_size
    params = SamplingParams(max_tokens=w.max_tokens, temperature=0, ignore_eos=True)
    ids = [engine.add_request(torch.randint(0, vocab, (w.context,), generator=gen).tolist(), params)
           for _ in range(batch)]
    seqs = [engine.seqs[i] for i in ids]
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
        engine.step()
    for _ in range(w.warmup_steps):
        engine.step()
    times, lens = [], []
    for _ in range(w.timed_steps):
        lens.append(sum(s.num_computed_tokens + 1 for s in seqs) / batch)
        sync(w.device)
        start = time.perf_counter()
        engine.step()
        sync(w.device)
        times.append(time.perf_counter() - start)
    ops, top = profile_steps(engine, w)
    for request_id in ids:
        engine.abort_request(request_id)
    return Point(batch, statistics.median(times) * 1e3, ops, statistics.mean(lens), top)


def profile_steps(engine, w: Workload) -> tuple[float, dict[str, float]]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if w.device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(w.profiled_steps):
            engine.step()
        sync(w.device)
    names = cuda_kernels(prof) if w.device == "cuda" else outermost_ops(prof)
    per_step = {k: v / w.profiled_steps for k, v in names.most_common(12)}
    return sum(names.values()) / w.profiled_steps, per_step


def cuda_kernels(prof) -> Counter:
    """Every kernel the GPU ran in the trace (memcpy and memset included), by name."""
    return Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def outermost_ops(prof) -> Counter:
    """CPU: ops not run inside another op, by name; what a GPU would launch as kernels."""

    def is_op(e) -> bool:
        return "::" in e.name or "cpp_fused" in e.name  # aten::mm, kiln::attention, graph_1_cpp_fused_...

    counts = Counter()
    for e in prof.events():
        if not is_op(e) or e.name.split("::")[-1] in NOT_WORK:
            continue
        parent = e.cpu_parent
        while parent is not None and not is_op(parent):
            parent = parent.cpu_parent
        if parent is None:
            counts[e.name] += 1
    return counts


@dataclass
class Floor:
    copy_bytes_per_s: float  # (bytes read + written) / s of a large copy
    matmul_flops_per_s: float  # of a large square matmul
    weight_bytes: int  # a decode step reads these whatever the batch
    per_batch: list[dict] = field(default_factory=list)


def measure_copy(device: str, dtype: torch.dtype) -> float:
    n = (1 << 30 if device == "cuda" else 1 << 28) // torch.empty(0, dtype=dtype).element_size()
    src, dst = torch.ones(n, dtype=dtype, device=device), torch.empty(n, dtype=dtype, device=device)
    return 2 * src.nbytes / _best_time(lambda: dst.copy_(src), device)


def measure_matmul(device: str, dtype: torch.dtype) -> float:
    n = 8192 if device == "cuda" else 1024
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / _best_time(lambda: torch.mm(a, b), device)


def _best_time(fn, device: str, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def matmul_params(cfg: ModelArchConfig) -> int:
    """Weights multiplied per token: every projection of every layer (of a mixture of experts,
    the router and the token's experts), and the LM head."""
    c = cfg
    attn = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
    if c.num_experts:
        mlp = c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size + c.num_experts * c.hidden_size
    else:
        mlp = 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * (attn + mlp) + c.vocab_size * c.hidden_size


def kv_bytes(cfg: ModelArchConfig, elem: int, tokens: float) -> float:
    """The KV cache of `tokens` tokens, every layer's keys and values."""
    return tokens * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elem


def floor_for(cfg: ModelArchConfig, elem: int, floor: Floor, batch: int, seq_len: float, ranks: int = 1) -> dict:
    """The floor of one step; with `ranks` devices each reads and multiplies its 1/ranks share
    at once (the all-reduces are left out: a floor, not a model)."""
    c = cfg
    kv_read = kv_bytes(cfg, elem, batch * seq_len)
    attn_flops = 4 * batch * seq_len * c.num_layers * c.num_heads * c.head_dim  # q.k and p.v
    flops = 2 * batch * matmul_params(cfg) + attn_flops
    # A mixture of experts reads more experts the larger the batch.
    weight_bytes = decode_weight_bytes(cfg, elem, batch) if cfg.num_experts else floor.weight_bytes
    memory_ms = (weight_bytes + kv_read) / ranks / floor.copy_bytes_per_s * 1e3
    compute_ms = flops / ranks / floor.matmul_flops_per_s * 1e3
    return {"batch": batch, "step_ms": max(memory_ms, compute_ms), "bound": "memory" if memory_ms >= compute_ms
            else "compute", "memory_ms": memory_ms, "compute_ms": compute_ms, "bytes": weight_bytes + kv_read,
            "flops": flops}


def vllm_status(w: Workload) -> str:
    """vLLM's CPU build on the same local checkpoint, when it is installed (not measured here)."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM not installed, skipped"
    if w.device != "cpu":
        return "vLLM runs here only as its CPU build, skipped on cuda"
    return run_vllm(w)


def run_vllm(w: Workload) -> str:
    # Never run on the development machine (vLLM is not installed there): treat as untested.
    from vllm import LLM as VLLM
    from vllm import SamplingParams as VSamplingParams

    from kiln.loader import embedded_gguf_path

    path = str(embedded_gguf_path()) if w.model in ("smollm2", None) else w.model
    if not os.path.exists(path):
        return f"vLLM needs a local checkpoint; {w.model!r} is a random preset, skipped"
    try:
        llm = VLLM(model=path, dtype=w.dtype, max_num_seqs=max(w.batches), max_model_len=w.context + w.max_tokens + 16)
        cells = []
        for batch in w.batches:
            prompts = [{"prompt_token_ids": list(range(10 + i, 10 + i + w.context))} for i in range(batch)]
            times = []
            for n in (1, 1 + w.timed_steps):
                start = time.perf_counter()
                llm.generate(prompts, VSamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                times.append(time.perf_counter() - start)
            cells.append(f"batch {batch}: {(times[1] - times[0]) / w.timed_steps * 1e3:.2f} ms")
        return "vLLM (CPU) decode step, from generate(1 + n) - generate(1): " + ", ".join(cells)
    except Exception as e:  # report it in the table; the kiln numbers stand without it
        return f"vLLM failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def run_bench(w: Workload) -> dict:
    import torch._inductor.config

    from kiln.loader import load_source

    dtype = getattr(torch, w.dtype)
    cfg = load_source(w.model).config
    print(f"kiln bench: {w.model} {w.dtype} on {w.device}, batches {w.batches}, context {w.context}", flush=True)
    # On CPU, Inductor's C++ kernels then record themselves in the profiler trace (when no
    # profiler runs, that costs one check a kernel).
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": w.device == "cpu"}):
        modes = [run_mode(name, w) for name in w.modes]
    elem = torch.empty(0, dtype=dtype).element_size()
    floor = Floor(measure_copy(w.device, dtype), measure_matmul(w.device, dtype), decode_weight_bytes(cfg, elem))
    lens = {p.batch: p.mean_seq_len for m in modes for p in m.points}
    floor.per_batch = [floor_for(cfg, elem, floor, b, lens.get(b, w.context), w.tensor_parallel_size)
                       for b in w.batches]
    return {"workload": asdict(w), "environment": environment(w), "floor": asdict(floor),
            "modes": [asdict(m) for m in modes], "vllm": vllm_status(w),
            "ops_per_step_means": ops_label(w.device)}


def ops_label(device: str) -> str:
    if device == "cuda":
        return "CUDA kernels per decode step (every GPU kernel event in a torch.profiler trace)"
    return ("CPU ops per decode step, the closest thing to kernel launches: outermost aten/kiln ops and "
            "Inductor C++ kernels in a torch.profiler trace, views and allocations left out")


def environment(w: Workload) -> dict:
    env = {"torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
           "threads": torch.get_num_threads(), "load_average": os.getloadavg()}
    if w.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    return env


def render(result: dict) -> str:
    w, floor = result["workload"], result["floor"]
    eager = {p["batch"]: p["step_ms"] for m in result["modes"] if m["name"] == "eager" for p in m["points"]}
    floors = {f["batch"]: f for f in floor["per_batch"]}
    env = result["environment"]
    unit = "kernels" if w["device"] == "cuda" else "ops*"
    lines = [
        f"kiln bench: {w['model']} {w['dtype']} on {env.get('gpu', w['device'])} ({env['threads']} threads"
        f"{', tensor parallel ' + str(w['tensor_parallel_size']) if w.get('tensor_parallel_size', 1) > 1 else ''}), "
        f"{w['context']}-token contexts, median of {w['timed_steps']} decode steps, {env['date']}",
        f"floor: {floor['weight_bytes'] / 1e6:,.1f} MB of weights a step + KV cache, at "
        f"{floor['copy_bytes_per_s'] / 1e9:.1f} GB/s (copy); matmul FLOPs at "
        f"{floor['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s (square matmul); both measured now",
        "",
        f"{'mode':<38} {'batch':>5} {'step ms':>9} {'vs eager':>9} {'vs floor':>9} {unit + '/step':>13} "
        f"{'start-up s':>11}",
    ]
    for m in result["modes"]:
        if m["error"]:
            lines.append(f"{m['label']:<38} failed to start: {m['error']}")
        for i, p in enumerate(m["points"]):
            b = p["batch"]
            first = i == 0
            ratio = f"{p['step_ms'] / eager[b]:.2f}x" if b in eager else "-"
            startup = f"{m['startup_s']:.1f}" if first else ""
            lines.append(f"{m['label'] if first else '':<38} {b:>5} {p['step_ms']:>9.2f} {ratio:>9} "
                         f"{p['step_ms'] / floors[b]['step_ms']:>8.2f}x {p['ops_per_step']:>13.0f} {startup:>11}")
    for i, f in enumerate(floor["per_batch"]):
        lines.append(f"{'floor' if i == 0 else '':<38} {f['batch']:>5} {f['step_ms']:>9.2f} "
                     f"{'':>9} {'1.00x':>9}   ({f['bound']}-bound)")
    lines.append(f"{'vLLM (CPU build)':<38} {result['vllm']}")
    lines += ["", f"{'*' if w['device'] != 'cuda' else 'kernels:'} {result['ops_per_step_means']}"]
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("the bench plot needs matplotlib: pip install kiln[bench] "
                           "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, NullLocator, ScalarFormatter

    w, env = result["workload"], result["environment"]
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    for m in result["modes"]:
        if m["points"]:
            ax.plot([p["batch"] for p in m["points"]], [p["step_ms"] for p in m["points"]], marker="o",
                    label=m["label"])
    per_batch = result["floor"]["per_batch"]
    ax.plot([f["batch"] for f in per_batch], [f["step_ms"] for f in per_batch], "k--",
            label="floor (measured bw, FLOP/s)")
    ax.set(xscale="log", yscale="log", xlabel="batch size (sequences decoding)", ylabel="decode step, ms (median)",
           title=f"kiln bench: {w['model']} {w['dtype']} on {env.get('gpu', w['device'])}, "
                 f"{w['context']}-token contexts, {env['date'][:10]}")
    ax.set_xticks(w["batches"], [str(b) for b in w["batches"]])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def register(commands) -> None:
    p = commands.add_parser("bench", help="decode step time: eager, stock torch.compile and kiln modes side by side")
    p.add_argument("--model", default=None, help="default: smollm2 on CPU, llama-3-8b (random bf16) on CUDA")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 8 32 (CPU), 1 8 64 256 (CUDA)")
    p.add_argument("--context", type=int, default=None, help="prompt tokens per sequence (default 128)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per batch size")
    p.add_argument("--modes", nargs="+", default=None, help="of eager stock once O2 O3 (default: all)")
    p.add_argument("--out", default=".", help="folder for bench_<model>_<device>.json and .png")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="run every mode on N processes (one per GPU; gloo processes on CPU)")
    p.set_defaults(func=run)


def run(args) -> int:
    import json
    from pathlib import Path

    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    workload = Workload.default(device, args.model, batches=args.batches, context=args.context, modes=args.modes,
                                timed_steps=args.steps, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size)
    result = run_bench(workload)
    print(render(result))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"bench_{Path(workload.model).name}_{device}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    print(f"wrote {stem.with_suffix('.json')}")
    if not args.no_plot:
        plot(result, str(stem.with_suffix(".png")))
        print(f"wrote {stem.with_suffix('.png')}")
    return 0
