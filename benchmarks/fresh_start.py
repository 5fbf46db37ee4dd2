"""A fresh machine's start, three ways, beside stock torch.compile's first call (a benchmark,
not a test): prints, writes JSON.

    python benchmarks/fresh_start.py --out $OUT                       (on the GPU: llama-3-8b)
    OMP_NUM_THREADS=1 python benchmarks/fresh_start.py --device cpu --model smollm2 --modes O2 --no-reference

Per kiln mode (`default`: no compile flag, the eager forward with full decode graphs on a
GPU; `O2`; `O2-aot`: -O2 prewarmed with --aot, imported and warm only), each a fresh process
building the engine as `kiln serve` would:

    cold      every cache fresh: kiln's root, Inductor's and Triton's dirs
    imported  `kiln prewarm --export FILE` on one fresh root, then a second fresh root (and
              fresh Inductor and Triton dirs) that `kiln cache import FILE` filled
    warm      the imported root again: a restart on the same machine

and the first call of benchmarks/reference_decode.py (a static-cache decode loop under
torch.compile(mode="reduce-overhead", fullgraph=True)) at batch 1, in the same run.
Bytecode is cached under a prefix, primed untimed as a pip install leaves it: torch's, Triton's and
kiln's modules all compiled (compileall), and one import of the engine for the rest it uses.

--profile: each start under cProfile, its stats written to --out and its top functions printed.
--py-spy PY_SPY: each start sampled by py-spy instead (every thread, waiting ones too, 250 Hz; cProfile
sees the main thread only, and a start's preload and kernel threads hold the GIL beside it): collapsed
stacks in --out/pyspy_<device>_<mode>_<case>.txt, one line a stack, "thread (idx) ... ;frame;frame N".

For each start: engine_ready_s (the engine's own timeline, weights included), process_ready_s
(process spawned to engine ready: imports too), gaps_s (the set-up between the timeline's named
phases, by the phase that followed: where its "other" went), compile_phase_s (dynamo + split +
inductor + cache_load), capture_s (CUDA graphs; of it, capture_warm_up_runs taking
capture_warm_up_s: the ordinary runs before the first capture of each compiled code),
graphs_at_start and deferred_buckets (the buckets left for first use; after ready the child
captures them as an idle server would: deferred_capture_s, graphs_after_deferred),
triton_compiles (kernels Triton compiled in the process; of them triton_compiled_in_workers by
kiln's precompile, in precompile_workers processes over precompile_s, the compiles summing
precompile_kernel_s with precompile_launcher_s of C launchers, and precompile_kernels: each
kernel's name and when it was submitted and done, seconds after the precompile began),
inductor_compiles, dynamo_graphs, packages_loaded (AOT packages: mode O2-aot, prewarmed with --aot),
imported_dynamo and imported_inductor (whether the start imported them), compile_workers_warm_s
and compile_workers_jobs_s (a cold start with compile workers: seconds
from their spawn until the last was warm, and until the pieces were handed to them; 0 without
workers), kv_blocks (what the KV cache got: on a GPU, what the memory profile left),
warm_phases_s (a warm start's parts, the compile preload's own steps among them as background.*).
JSON:
--out/fresh_start_<device>.json.

Most of a start is Python on one core, and the GPU machine's hosts differ: the same start took
2.38 s on one lease and 5.87 s on another (2026-12-04). So the report also times a fixed
pure-Python loop before and after the starts (host_python_s): compare starts from different
runs only in proportion to it.
"""

from __future__ import annotations

import time

SPAWNED = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMPILE_PHASES = ("dynamo", "split", "inductor", "cache_load")
# O2-graphs-at-start: -O2 with its mixed-batch graphs captured before ready, as before they were
# left for first use (the default).
MODES = {"default": [], "O2": ["-O2"], "O2-aot": ["-O2"],
         "O2-graphs-at-start": ["-O2", '-cc.cudagraph_prefill={"capture": "start"}']}
# prewarm's flags for a mode: with no flag it prewarms -O2; the engine's default forward is
# -O0 with full decode graphs on a GPU. O2-aot: -O2 from an archive with AOTInductor packages
# (its cold start is O2's: not run again).
PREWARM_FLAGS = {"default": ["-O0", "-cc.cudagraph_mode=FULL_DECODE_ONLY"], "O2": ["-O2"], "O2-aot": ["-O2", "--aot"],
                 "O2-graphs-at-start": ["-O2"]}
WARM_ONLY = {"O2-aot"}


def child(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    from kiln.compile.cache import triton_kernels
    from kiln.compile.config import parse_compilation_args
    from kiln.config import EngineConfig
    from kiln.engine import LLMEngine

    flags = MODES[args.mode]
    compilation = parse_compilation_args(flags)[1] if flags else None
    config = EngineConfig(model=args.model, device=args.device, compilation=compilation)
    profiler = None
    if args.profile_to:
        import cProfile

        profiler = cProfile.Profile()
    engine = profiler.runcall(LLMEngine, config) if profiler else LLMEngine(config)
    ready = time.time()
    if profiler:
        profiler.dump_stats(args.profile_to)
    # What the start left for first use: captured here as an idle server would, timed apart.
    deferred = engine.runner.cudagraphs.stats["deferred_buckets"]
    graphs_at_start = engine.runner.cudagraphs.stats["num_graphs"]
    start = time.perf_counter()
    while engine.capture_deferred_graph():
        pass
    deferred_capture_s = time.perf_counter() - start
    phases = engine.timeline.as_dict()["phases_s"]
    stats = engine.runner.compiled.stats
    print(json.dumps({
        "ready_wall": ready, "engine_ready_s": engine.timeline.ready_seconds, "phases_s": phases,
        "gaps_s": engine.timeline.gaps,
        "compile_phase_s": sum(phases.get(p, 0.0) for p in COMPILE_PHASES), "capture_s": phases.get("cudagraphs", 0.0),
        "capture_warm_up_runs": engine.runner.cudagraphs.stats["warm_up_runs"],
        "capture_warm_up_s": engine.runner.cudagraphs.stats["warm_up_s"],
        "graphs_at_start": graphs_at_start, "deferred_buckets": deferred, "deferred_capture_s": deferred_capture_s,
        "graphs_after_deferred": engine.runner.cudagraphs.stats["num_graphs"],
        "triton_compiles": triton_kernels.counts()["compiled"], "triton_cache_hits": triton_kernels.counts()["cache_hits"],
        "triton_compiled_in_workers": triton_kernels.counts()["compiled_in_workers"],
        "precompile_s": triton_kernels.counts()["precompile_s"],
        "precompile_kernel_s": triton_kernels.counts()["precompile_kernel_s"],
        "precompile_launcher_s": triton_kernels.counts()["precompile_launcher_s"],
        "precompile_workers": triton_kernels.counts()["precompile_workers"],
        "precompile_kernels": triton_kernels.counts()["precompile_kernels"],
        "inductor_compiles": stats["inductor_compiles"], "dynamo_graphs": stats["graphs_seen"],
        "compile_workers_warm_s": stats["workers_ready_s"], "compile_workers_jobs_s": stats["workers_jobs_s"],
        # A warm start's parts, the preload's own steps among them (background.*): what -O2's weights wait on.
        "warm_phases_s": stats.get("warm_phases_s", {}),
        "kv_blocks": engine.runner.num_blocks, "packages_loaded": stats["packages_loaded"],
        # What the start imported: one from AOT packages needs neither.
        "imported_dynamo": "torch._dynamo" in sys.modules, "imported_inductor": "torch._inductor" in sys.modules,
        "describe": engine.runner.compiled.describe()}))


class Sandbox:
    """Fresh cache directories for one case; the process environment that uses them."""

    def __init__(self, base: Path, name: str, pycache: Path):
        self.dir = base / name
        self.env = dict(os.environ, KILN_CACHE_ROOT=str(self.dir / "kiln"), PYTHONPYCACHEPREFIX=str(pycache),
                        TORCHINDUCTOR_CACHE_DIR=str(self.dir / "inductor"), PYTHONUNBUFFERED="1",
                        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.env.pop("PYTHONDONTWRITEBYTECODE", None)  # bytecode is written and read, as on a pip install
        # kiln keeps its kernels in its root; anything else Triton compiles goes to a fresh dir too.
        self.env.pop("TRITON_CACHE_DIR", None)
        self.env["TRITON_HOME"] = str(self.dir / "triton-home")

    def run(self, cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-4000:])
            raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({done.returncode})")
        return done

    def start(self, args, mode: str, case: str) -> dict:
        profile = Path(args.out) / f"profile_{args.device}_{mode}_{case}.pstats" if args.profile else None
        sampler = []
        if args.py_spy:
            stacks = Path(args.out) / f"pyspy_{args.device}_{mode}_{case}.txt"
            sampler = [args.py_spy, "record", "--threads", "--idle", "--rate", "250", "--format", "raw",
                       "--output", str(stacks), "--"]
        spawned = time.time()
        done = self.run([*sampler, sys.executable, __file__, "--child", "--mode", mode, "--model", args.model,
                         "--device", args.device, *(["--profile-to", str(profile)] if profile else [])], args.timeout)
        # The report is the child's last JSON line (py-spy adds lines of its own).
        out = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
        out["process_ready_s"] = out.pop("ready_wall") - spawned
        if profile:
            print_profile(profile, f"{mode} {case}")
        return out


def print_profile(path: Path, title: str) -> None:
    """Where a profiled start spent its time: kiln's functions by cumulative time, then every
    function by its own time."""
    import io
    import pstats

    text = io.StringIO()
    stats = pstats.Stats(str(path), stream=text)
    stats.sort_stats("cumulative").print_stats("kiln/", 40)
    stats.sort_stats("tottime").print_stats(25)
    print(f"--- profile of the {title} start (cProfile: slower than unprofiled; read in proportion)\n"
          + text.getvalue(), flush=True)


def package_dirs(*names: str) -> list[str]:
    """The folders of the installed packages among `names` (found without importing them)."""
    import importlib.util

    specs = [importlib.util.find_spec(name) for name in names]
    return [d for spec in specs if spec is not None for d in spec.submodule_search_locations or ()]


def kiln(*argv: str) -> list[str]:
    return [sys.executable, "-m", "kiln.cli", *argv]


def measure_mode(args, mode: str, base: Path, pycache: Path) -> dict:
    cold = mode not in WARM_ONLY and not args.warm_only
    cases = {"cold": Sandbox(base, f"{mode}-cold", pycache).start(args, mode, "cold")} if cold else {}
    if args.cold_only:
        return cases
    archive = base / f"{mode}.tar"
    made = Sandbox(base, f"{mode}-prewarm", pycache)
    start = time.perf_counter()
    made.run(kiln("prewarm", "--model", args.model, "--device", args.device, *PREWARM_FLAGS[mode],
                  "--export", str(archive)), args.timeout)
    prewarm_s = time.perf_counter() - start
    fresh = Sandbox(base, f"{mode}-imported", pycache)
    start = time.perf_counter()
    fresh.run(kiln("cache", "import", str(archive)), args.timeout)
    import_s = time.perf_counter() - start
    cases["imported"] = {**fresh.start(args, mode, "imported"), "import_s": import_s}
    cases["warm"] = fresh.start(args, mode, "warm")
    cases["prewarm_export"] = {"seconds": prewarm_s, "archive_bytes": archive.stat().st_size}
    return cases


def reference_first_call(args, base: Path, pycache: Path) -> dict:
    box = Sandbox(base, "reference", pycache)
    done = box.run([sys.executable, str(ROOT / "benchmarks" / "reference_decode.py"), "--device", args.device,
                    "--batches", "1", "--steps", "5", "--out", str(box.dir)], args.timeout)
    sys.stdout.write(done.stdout)
    return json.loads((box.dir / f"reference_decode_{args.device}.json").read_text())["results"][0]


def host_python_s() -> float:
    """Best of 5 of a fixed interpreter-bound loop: this host's speed at the kind of work a start is."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        total = 0
        for i in range(3_000_000):
            total += i % 7
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="default", choices=list(MODES))
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--cold-only", action="store_true",
                   help="each mode's cold start alone (about 15 s a mode on the GPU, not 100: for A/B runs)")
    p.add_argument("--warm-only", action="store_true",
                   help="each mode's imported and warm starts alone, no cold start")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default=".")
    p.add_argument("--profile-to", help=argparse.SUPPRESS)  # the child's: where its stats go
    p.add_argument("--profile", action="store_true",
                   help="run each start under cProfile: --out/profile_<device>_<mode>_<case>.pstats, and its top "
                        "functions printed (the times grow; compare the profiled starts with each other only)")
    p.add_argument("--py-spy", metavar="PY_SPY",
                   help="the py-spy binary: each start sampled by it (see the module's doc); the times grow a little")
    args = p.parse_args()
    if "O2-aot" in args.modes and not args.child:
        from kiln.compile.aot_piece import refused_on

        if why := refused_on(args.device):
            p.error(why)
    if args.cold_only and args.warm_only:
        p.error("--cold-only and --warm-only leave nothing to run: pass one")
    if args.profile and args.py_spy:
        p.error("--profile and --py-spy each slow a start their own way: pass one")
    if args.device == "cpu" and "default" in args.modes and not args.child:
        p.error("the default mode keeps nothing in the cache on the CPU (no kernels, no graphs), so it has no "
                "imported start: pass --modes O2 O2-aot")
    if args.child:
        child(args)
        return
    args.out = str(Path(args.out).resolve())
    Path(args.out).mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="kiln-fresh-"))
    pycache = base / "pycache"
    try:
        prime = Sandbox(base, "prime", pycache)
        # Without it each start compiled the source of the modules no earlier run had imported (0.3 s
        # of an -O2 cold start on an H200 host: Dynamo's repro tools, Triton's gluon, kiln's kernels).
        # Its status is not checked: a file written for another Python fails, as under pip.
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *package_dirs("torch", "triton", "kiln")],
                       env=prime.env, capture_output=True, timeout=args.timeout)
        prime.run([sys.executable, "-c", "import kiln.engine, kiln.compile.backend, torch._inductor.compile_fx"],
                  args.timeout)
        report = {"model": args.model, "device": args.device, "host_python_s": [host_python_s()], "modes": {}}
        path = Path(args.out) / f"fresh_start_{args.device}.json"
        for mode in args.modes:
            report["modes"][mode] = measure_mode(args, mode, base, pycache)
            path.write_text(json.dumps(report, indent=1))  # so far: a device call cut short keeps it
            for case in [c for c in ("cold", "imported", "warm") if c in report["modes"][mode]]:
                r = report["modes"][mode][case]
                kernels = sum(v for k, v in r["phases_s"].items() if k.startswith("kernels"))
                print(f"{mode:18s} {case:9s} engine ready {r['engine_ready_s']:6.2f} s, process ready "
                      f"{r['process_ready_s']:6.2f} s, compile {r['compile_phase_s']:5.2f} s, capture "
                      f"{r['capture_s']:5.2f} s ({r['graphs_at_start']} graphs; {r['deferred_buckets']} buckets "
                      f"deferred, {r['deferred_capture_s']:.2f} s after ready), Triton compiles "
                      f"{r['triton_compiles']} ({r['triton_compiled_in_workers']} in workers), kernels phases {kernels:.2f} s, Inductor compiles "
                      f"{r['inductor_compiles']}, Dynamo graphs {r['dynamo_graphs']}, AOT packages "
                      f"{r['packages_loaded']}, imported Dynamo/Inductor "
                      f"{r['imported_dynamo']}/{r['imported_inductor']}"
                      + (f", compile workers warm at {r['compile_workers_warm_s']:.2f} s, jobs at "
                         f"{r['compile_workers_jobs_s']:.2f} s" if r["compile_workers_warm_s"] else "")
                      + (f", last kernel submitted at {max(k[1] for k in r['precompile_kernels']):.2f} s and "
                         f"compiled at {max(k[2] for k in r['precompile_kernels']):.2f} s of the precompile's "
                         f"{r['precompile_s']:.2f} s" if r["precompile_kernels"] else ""), flush=True)
        if not args.no_reference:
            try:
                ref = reference_first_call(args, base, pycache)
                report["reference"] = ref
                report["reference_first_call_s"] = ref["first_call_s"]
            except RuntimeError as e:  # kiln's numbers are kept; the failure is in the report
                report["reference_error"] = str(e)
                print(f"reference failed: {e}", flush=True)
        report["host_python_s"].append(host_python_s())
        print(f"host: a fixed Python loop {report['host_python_s'][0]:.3f} s before the starts, "
              f"{report['host_python_s'][1]:.3f} s after", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    import torch

    report["torch"] = torch.__version__
    report["gpu"] = torch.cuda.get_device_name() if args.device == "cuda" else None
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
