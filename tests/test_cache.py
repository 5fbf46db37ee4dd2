"""The compile cache: warm starts without Dynamo or Inductor, damage detected and rebuilt,
concurrent fills, keys that follow the traced code, misses that are counted and logged.

One entry is filled once (tiny-llama, one range [1, 32]); each test that damages or extends
it works on a copy. "Second process" tests run tests/cache_process.py in a subprocess.
"""

import gc
import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from cache_process import MAX_TOKENS, max_error, run_python as _run, start, tiny

from kiln.compile import compile_model
from kiln.compile.cache import CacheRoot, CompileCache, cache_disabled
from kiln.compile.cache.key import env_factor
from kiln.compile.cache.preload import Preload, isa_probes_ahead_due, preload_if_warm
from kiln.compile.cache.root import NOT_ENTRIES
from kiln.compile.config import CompilationConfig
from kiln.tools import cache_cli

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A cache root holding one complete entry, filled cold in this process."""
    root = tmp_path_factory.mktemp("cache") / "root"
    model, compiled, timeline = start(root)
    return root, compiled.entry.key, compiled.stats, timeline.as_dict()["phases_s"]


@pytest.fixture
def copy_of(filled, tmp_path):
    root, key, _, _ = filled
    copy = tmp_path / "root"
    shutil.copytree(root, copy)
    return copy, key


def test_cold_start_fills_one_entry_with_every_file_checked(filled):
    root, key, stats, phases = filled
    assert stats["graphs_seen"] == 1 and stats["inductor_compiles"] == 3 and stats["pieces_loaded"] == 0
    assert phases["dynamo"] > 0 and phases["inductor"] > 0 and "cache_load" not in phases
    # The compile phase is the whole capture: the backend's splitting is counted too.
    assert phases["split"] > 0
    assert phases["dynamo"] + phases["split"] + phases["inductor"] == pytest.approx(stats["total_s"], abs=0.01)
    assert oct(root.stat().st_mode & 0o777) == "0o700"
    entry = CacheRoot(root).entry(key)
    manifest = json.loads((entry.path / "manifest.json").read_text())
    assert manifest["ranges"] == [[1, MAX_TOKENS]] and manifest["sizes"] == []
    assert manifest["model"] == "tiny-llama" and manifest["torch"] == torch.__version__
    for name in ("env.json", "config.json", "code.json", "compiler.json", "graph.pkl", "computation_graph.py"):
        assert name in manifest["files"], name
    assert sum(f.startswith("pieces/") for f in manifest["files"]) == 3
    # On CPU the built kernels are the entry's own: an artifact alone does not carry them.
    assert any(f.startswith("inductor/") and f.endswith(".so") for f in manifest["files"])
    code = json.loads((entry.path / "code.json").read_text())
    assert "kiln.models.llama" in code and "kiln.ops.norm" in code
    assert "class SplitGraph" in (entry.path / "computation_graph.py").read_text()


def test_second_process_starts_warm_without_dynamo_or_inductor(filled):
    root, key, _, _ = filled
    built = sorted(p.name for p in (root / key / "inductor").rglob("*.so"))
    run = _run(str(HERE / "cache_process.py"), str(root))
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    stats = out["stats"]
    assert out["key"] == key
    assert stats["inductor_compiles"] == 0 and stats["graphs_seen"] == 0  # neither Inductor nor Dynamo ran
    assert stats["pieces_loaded"] == 3 and stats["cache_hits"] == 3 and stats["cache_misses"] == 0
    assert set(out["phases"]) - {"compile_calls"} == {"cache_load"}  # no Dynamo, no Inductor
    assert out["max_error"] <= 1e-4
    assert sorted(p.name for p in (root / key / "inductor").rglob("*.so")) == built  # no C++ build either
    assert "Loaded the compiled forward from compile cache entry" in run.stderr


def test_a_warm_start_with_the_preload_loads_every_piece_and_compiles_nothing(filled):
    root, key, _, _ = filled
    run = _run(str(HERE / "cache_process.py"), str(root), "", "--preload")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    stats, preload = out["stats"], out["preload"]
    assert out["key"] == key and set(out["phases"]) - {"compile_calls"} == {"cache_load"}
    assert stats["inductor_compiles"] == 0 and stats["graphs_seen"] == 0 and stats["pieces_loaded"] == 3
    assert preload is not None and not preload["errors"] and preload["parts"]["torch_key"] > 0
    assert "preload_wait" in stats["warm_phases_s"] and "background.imports" in stats["warm_phases_s"]
    # Inductor's ISA probes ran in the preload, inside this entry, so the warm start ran none;
    # and it loaded the pieces once (the warm start's own loads then find them in Inductor's caches).
    assert preload["parts"]["isa_probe"] > 0 and "pieces.isa_probe" not in stats["warm_phases_s"]
    assert preload["parts"]["pieces"] > 0
    assert out["max_error"] <= 1e-4


# An engine start that records what its main thread imports while the compile preload runs.
_IMPORTS_BESIDE_THE_PRELOAD = """
import json, sys, threading
from kiln import LLM

def preload_running():
    return any(t.name == "kiln-compile-preload" and t.is_alive() for t in threading.enumerate())

class Audit:
    def find_spec(self, name, path, target=None):
        if threading.current_thread() is threading.main_thread() and preload_running():
            imported.append(name)
        return None

imported = []
sys.meta_path.insert(0, Audit())
llm = LLM("tiny-llama", device="cpu", compilation_config=2, max_num_batched_tokens=32)
stats = llm.engine.runner.compiled.stats
print(json.dumps({"imported": imported, "warm_phases": stats["warm_phases_s"],
                  "inductor_compiles": stats["inductor_compiles"]}))
"""


def test_the_main_thread_imports_no_compiler_module_while_the_preload_imports_them(tmp_path):
    # Two threads importing the same circular modules can deadlock, or one of them gets a module
    # half initialised; the engine imports Dynamo before the preload starts, and CompiledModel joins
    # the preload before it imports anything of Inductor's. Here a warm engine start proves it.
    env = {"KILN_CACHE_ROOT": str(tmp_path)}
    cold = _run("-c", _IMPORTS_BESIDE_THE_PRELOAD, env=env)
    assert cold.returncode == 0, cold.stderr
    warm = _run("-c", _IMPORTS_BESIDE_THE_PRELOAD, env=env)
    assert warm.returncode == 0, warm.stderr
    out = json.loads(warm.stdout.strip().splitlines()[-1])
    assert out["inductor_compiles"] == 0 and "background.imports" in out["warm_phases"]  # a preloaded warm start
    compiler = ("torch._dynamo", "torch._inductor", "torch._functorch", "torch.fx", "sympy", "triton")
    assert [name for name in out["imported"] if name.startswith(compiler)] == []


def _recorded_loads(monkeypatch) -> list[str]:
    from kiln.compile.cache.entry import CacheEntry

    loaded, load = [], CacheEntry._load_artifact
    monkeypatch.setattr(CacheEntry, "_load_artifact", lambda self, rel: (loaded.append(rel), load(self, rel))[1])
    return loaded


def test_the_preloads_piece_loads_leave_a_damaged_artifact_to_the_warm_start(copy_of, monkeypatch):
    from kiln.compile.cache.entry import load_pieces_in

    root, key = copy_of
    manifest = (root / key / "manifest.json").read_bytes()
    pieces = sorted((root / key / "pieces").iterdir())
    pieces[0].write_bytes(pieces[0].read_bytes()[:-1] + b"x")
    loaded = _recorded_loads(monkeypatch)
    # Loads the two good pieces, and neither raises nor repairs: the warm start reports and
    # rebuilds the damaged one (test_a_corrupted_artifact_byte_is_logged_and_rebuilt).
    load_pieces_in(root / key)
    assert sorted(Path(rel).name for rel in loaded) == [p.name for p in pieces[1:]]
    assert (root / key / "manifest.json").read_bytes() == manifest and pieces[0].exists()


def test_the_preload_does_not_wait_for_an_entry_another_process_is_writing(copy_of, monkeypatch):
    import fcntl

    from kiln.compile.cache.entry import load_pieces_in

    root, key = copy_of
    loaded = _recorded_loads(monkeypatch)
    fd = os.open(root / key / "lock", os.O_RDWR)  # a second descriptor: flock sees another holder
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        load_pieces_in(root / key)  # returns at once, loading nothing
        assert loaded == []
    finally:
        os.close(fd)
    load_pieces_in(root / key)
    assert len(loaded) == 3


def test_a_cold_cpu_capture_takes_the_isa_probes_run_ahead(filled, tmp_path, monkeypatch):
    """A cold capture's entry is known only after Dynamo traced: probe_isa_ahead runs Inductor's
    ISA probes before that, on a thread in a scratch dir, and the entry's first compile takes their
    files instead of probing again on the engine's thread (a warm start of the entry finds them)."""
    import threading

    from kiln.compile.cache import entry as entry_module

    root = tmp_path / "root"
    engine_thread, on_engine_thread = threading.get_ident(), []
    plain_probe = entry_module.probe_isa_here

    def probe():
        if threading.get_ident() == engine_thread:
            on_engine_thread.append(1)
        plain_probe()

    monkeypatch.setattr(entry_module, "probe_isa_here", probe)
    _, cache = tiny(root)
    o2, cpu = CompilationConfig.level(2), torch.device("cpu")
    assert isa_probes_ahead_due(o2, cache, cpu) and not isa_probes_ahead_due(CompilationConfig.level(0), cache, cpu)
    entry_module.probe_isa_ahead()
    scratch = entry_module._ahead[1]
    _, compiled, _ = start(root)
    assert on_engine_thread == [] and entry_module._ahead is None and not scratch.exists()
    assert not isa_probes_ahead_due(o2, cache, cpu)  # the next start is warm: its preload probes
    entry_module.probe_isa_in(tmp_path / "plain")  # what the probes leave in a dir of their own
    probes = {p.relative_to(tmp_path / "plain").as_posix() for p in (tmp_path / "plain").rglob("*.so")}
    taken = {p.relative_to(compiled.entry.path).as_posix() for p in compiled.entry.path.rglob("*.so")}
    assert probes and probes <= taken and compiled.stats["inductor_compiles"] == 3


def test_the_preload_starts_only_where_a_warm_start_is_likely(filled, tmp_path, monkeypatch):
    root, key, _, _ = filled
    started = []
    monkeypatch.setattr(Preload, "start", lambda self: started.append(self) or self)
    cpu = torch.device("cpu")
    _, cache = tiny(root)
    assert preload_if_warm(CompilationConfig(mode=0), cache, cpu) is None  # eager: nothing compiles
    assert preload_if_warm(CompilationConfig(mode=2), cache, cpu) is None
    assert preload_if_warm(CompilationConfig(mode=3, piece_compiler="eager"), cache, cpu) is None
    assert preload_if_warm(CompilationConfig(mode=3, debug_guards=True), cache, cpu) is None
    assert preload_if_warm(CompilationConfig(mode=3), None, cpu) is None  # cache off
    assert preload_if_warm(CompilationConfig(mode=3), tiny(tmp_path / "empty")[1], cpu) is None  # nothing to load
    assert preload_if_warm(CompilationConfig(mode=3), cache, torch.device("meta")) is None  # no entry for it
    assert not started and cache.preload is None
    assert preload_if_warm(CompilationConfig(mode=3), cache, cpu) is cache.preload is started[0]
    assert started[0].probe_entry == root / key  # the CPU's ISA probes, in the entry last written
    # The engine's default (eager) start-up never starts it either.
    started.clear()
    monkeypatch.setenv("KILN_CACHE_ROOT", str(root))
    from kiln import LLM

    engine = LLM("tiny-llama", device="cpu", dtype="float32", max_num_batched_tokens=MAX_TOKENS).engine
    assert engine.runner.compiled.mode == 0 and not started


def test_a_corrupted_artifact_byte_is_logged_and_rebuilt(copy_of, caplog):
    root, key = copy_of
    artifact = sorted((root / key / "pieces").iterdir())[1]
    data = bytearray(artifact.read_bytes())
    data[len(data) // 2] ^= 0xFF
    artifact.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="kiln.compile"):
        model, compiled, _ = start(root)
    assert f"{artifact} fails its checksum" in caplog.text
    stats = compiled.stats
    assert stats["graphs_seen"] == 0 and stats["pieces_loaded"] == 2 and stats["inductor_compiles"] == 1
    assert max_error(model, compiled) <= 1e-4
    ok, lines = cache_cli.verify(CacheRoot(root), [key])
    assert ok, lines


def test_a_truncated_manifest_rebuilds_the_entry(copy_of, caplog):
    root, key = copy_of
    manifest = root / key / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[: manifest.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="kiln.compile"):
        model, compiled, _ = start(root)
    assert f"manifest {manifest} is unreadable" in caplog.text
    stats = compiled.stats
    assert compiled.entry.key == key and stats["graphs_seen"] == 1 and stats["inductor_compiles"] == 3
    assert max_error(model, compiled) <= 1e-4
    assert cache_cli.verify(CacheRoot(root), [key])[0]
    assert CacheRoot(root).entry(key).read_manifest()["graph"]["direct_call"]


def test_without_a_usable_graph_dynamo_runs_but_every_piece_still_loads(copy_of, caplog):
    root, key = copy_of
    graph = root / key / "graph.pkl"
    graph.write_bytes(graph.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="kiln.compile"):
        model, compiled, _ = start(root)
    assert f"{graph} fails its checksum" in caplog.text
    stats = compiled.stats
    assert stats["graphs_seen"] == 1 and stats["inductor_compiles"] == 0 and stats["pieces_loaded"] == 3
    assert max_error(model, compiled) <= 1e-4
    assert cache_cli.verify(CacheRoot(root), [key])[0]  # the graph was written again


def test_a_warm_start_rebuilds_the_programs_graphs_from_their_nodes_without_tracing(copy_of, monkeypatch):
    # torch pickles a GraphModule as its code and traces that again at load; the entry keeps nodes.
    root, key = copy_of
    monkeypatch.setattr(torch.fx.Tracer, "trace", lambda *a, **k: pytest.fail("a graph was traced again"))
    model, compiled, _ = start(root)
    assert compiled.stats["graphs_seen"] == 0 and compiled.stats["pieces_loaded"] == 3
    assert max_error(model, compiled) <= 1e-4


def test_a_program_this_torch_cannot_rebuild_is_captured_again(copy_of, monkeypatch, caplog):
    from kiln.compile.cache import graph_pickle

    def cannot(*args):
        raise ImportError("cannot import name '_LazyGraphModule'")

    root, key = copy_of
    monkeypatch.setattr(graph_pickle, "_rebuild", cannot)
    with caplog.at_level(logging.WARNING, logger="kiln.compile"):
        model, compiled, _ = start(root)
    assert "could not be loaded (ImportError" in caplog.text and "capturing again" in caplog.text
    stats = compiled.stats
    assert stats["graphs_seen"] == 1 and stats["inductor_compiles"] == 0 and stats["pieces_loaded"] == 3
    assert max_error(model, compiled) <= 1e-4


def test_a_program_whose_nodes_do_not_pickle_is_kept_as_torch_pickles_it(copy_of, monkeypatch):
    from kiln.compile.cache import graph_pickle

    root, key = copy_of
    entry = CacheRoot(root).entry(key)
    entry.manifest = entry.read_manifest()
    program = entry.load_program()
    before = (entry.path / "graph.pkl").read_bytes()

    def unpicklable(obj):
        raise TypeError("cannot pickle a node's target")

    monkeypatch.setattr(graph_pickle, "dumps", unpicklable)
    entry.save_program(program, program.readable())
    after = (entry.path / "graph.pkl").read_bytes()
    assert after != before and b"reduce_graph_module" in after and b"reduce_graph_module" not in before
    assert cache_cli.verify(CacheRoot(root), [key])[0]
    # (torch's re-trace does not give the captured graph back node for node: it spells out
    # F.embedding's defaults, which the entry's own format keeps as captured.)
    model, compiled, _ = start(root)
    assert compiled.stats["graphs_seen"] == 0 and compiled.stats["pieces_loaded"] == 3
    assert max_error(model, compiled) <= 1e-4


def test_a_shape_missing_from_a_warm_entry_is_a_logged_and_counted_miss(copy_of, caplog):
    from kiln.forward_context import set_forward_context

    root, key = copy_of
    model, cache = tiny(root)
    # Compile sizes are not in the key: this plan finds the entry, which lacks size 4.
    compiled = compile_model(model, CompilationConfig(mode=3, strategy="lazy", compile_sizes=[4]), MAX_TOKENS,
                             cache=cache)
    with caplog.at_level(logging.WARNING, logger="kiln.compile"), torch.inference_mode(), \
            set_forward_context(None, {}):
        compiled(torch.randint(0, 512, (7,)), torch.arange(7))
        assert compiled.stats["pieces_loaded"] == 3 and not [r for r in caplog.records if r.levelno >= logging.WARNING]
        compiled(torch.randint(0, 512, (4,)), torch.arange(4))
    assert f"compile cache miss: size 4 of tiny-llama is not in cache entry {key}" in caplog.text
    stats = compiled.stats
    assert stats["inductor_compiles"] == 3 and stats["cache_misses"] == 3 and stats["graphs_seen"] == 0
    assert CacheRoot(root).entry(key).read_manifest()["sizes"] == [4]  # kept for the next start


def test_two_concurrent_prewarms_both_succeed_into_one_entry(tmp_path, seed_cpu_kernels):
    root = tmp_path / "root"
    seed_cpu_kernels(root)
    args = ["-m", "kiln.cli", "prewarm", "--model", "tiny-llama", "--max-num-batched-tokens", str(MAX_TOKENS)]
    env = dict(os.environ, OMP_NUM_THREADS="1", KILN_CACHE_ROOT=str(root),
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (stdout, stderr) in zip(procs, outs):
        assert p.returncode == 0, stderr
        assert "-> complete" in stdout
    entries = [p.name for p in root.iterdir() if p.name not in NOT_ENTRIES]
    assert len(entries) == 1
    compiles = [int(stdout.split("this run: ")[1].split(" Inductor")[0]) for stdout, _ in outs]
    assert sorted(compiles) == [0, 3]  # one compiled, the other waited and loaded its artifacts
    verify = _run("-m", "kiln.cli", "cache", "verify", env={"KILN_CACHE_ROOT": str(root)})
    assert verify.returncode == 0 and f"{entries[0]}: OK" in verify.stdout


def test_a_prewarm_killed_mid_compile_leaves_a_partial_entry_the_next_start_rebuilds(tmp_path, seed_cpu_kernels):
    root = tmp_path / "root"
    seed_cpu_kernels(root)
    args = ["-m", "kiln.cli", "prewarm", "--model", "tiny-llama", "--max-num-batched-tokens", str(MAX_TOKENS)]
    env = dict(os.environ, OMP_NUM_THREADS="1", KILN_CACHE_ROOT=str(root),
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    killed = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    # SIGKILL as soon as the entry's folder exists: capture and compiles take seconds after that.
    for _ in range(6000):
        if root.exists() and any(p.is_dir() and p.name not in NOT_ENTRIES for p in root.iterdir()):
            break
        assert killed.poll() is None, "prewarm ended before its entry appeared"
        time.sleep(0.01)
    killed.kill()
    killed.wait()
    listed = _run("-m", "kiln.cli", "cache", "ls", env={"KILN_CACHE_ROOT": str(root)})
    # Killed before or after its first files: either way not complete.
    assert ("partial" in listed.stdout or "empty" in listed.stdout) and "complete" not in listed.stdout, listed.stdout
    again = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "-> complete" in again.stdout
    assert int(again.stdout.split("this run: ")[1].split(" Inductor")[0]) > 0  # rebuilt, not trusted
    verify = _run("-m", "kiln.cli", "cache", "verify", env={"KILN_CACHE_ROOT": str(root)})
    entry = next(p.name for p in root.iterdir() if p.is_dir() and p.name not in NOT_ENTRIES)
    assert verify.returncode == 0 and f"{entry}: OK" in verify.stdout, verify.stdout


def test_prewarm_reports_what_the_entry_covers(copy_of, tmp_path, seed_cpu_kernels):
    root, key = copy_of
    seed_cpu_kernels(root)
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"compile_sizes": [2], "cudagraph_capture_sizes": [1, 2]}))
    run = _run("-m", "kiln.cli", "prewarm", "--model", "tiny-llama", "--max-num-batched-tokens", str(MAX_TOKENS),
               "--manifest", str(shapes), env={"KILN_CACHE_ROOT": str(root)})
    assert run.returncode == 0, run.stderr
    assert f"cache entry {key}" in run.stdout
    assert f"ranges: [1, {MAX_TOKENS}]" in run.stdout and "sizes: 2" in run.stdout
    assert "decode full 1, 2; prefill piecewise 1, 2" in run.stdout and "this run: 3 Inductor compiles, 3 artifacts loaded" in run.stdout


# -- the key ------------------------------------------------------------------------------

TOY_SOURCE = '''
import torch
from kiln.compile import compile_dynamic


@compile_dynamic(dynamic_arg_dims={"x": 0})
class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.proj(x)) * SCALE
'''


def _toy_start(root: Path, toy):
    cache = CompileCache(CacheRoot(root), {"toy": True}, "toy")
    compiled = compile_model(toy, CompilationConfig(mode=3, piece_compiler="eager"), 16, cache=cache)
    with torch.inference_mode():
        x = torch.randn(5, 8)
        torch.testing.assert_close(compiled(x), toy(x))
    return compiled


def test_editing_a_traced_source_changes_the_key_and_a_log_level_does_not(tmp_path, monkeypatch, caplog):
    module_dir = tmp_path / "src"
    module_dir.mkdir()
    source = module_dir / "kiln_cache_toy.py"
    source.write_text(textwrap.dedent(TOY_SOURCE) + "SCALE = 2.0\n")
    monkeypatch.syspath_prepend(str(module_dir))
    toy = importlib.import_module("kiln_cache_toy").Toy()
    root = tmp_path / "root"

    first = _toy_start(root, toy)
    assert first.stats["graphs_seen"] == 1
    key = first.entry.key
    monkeypatch.setenv("KILN_LOG_LEVEL", "DEBUG")
    caplog.set_level(logging.DEBUG)
    again = _toy_start(root, toy)
    assert again.entry.key == key and again.stats["graphs_seen"] == 0  # warm: no Dynamo

    source.write_text(source.read_text() + "# an edit Dynamo's trace covers\n")
    edited = _toy_start(root, toy)
    assert edited.entry.key != key and edited.stats["graphs_seen"] == 1
    lines = cache_cli.diff(CacheRoot(root), key, edited.entry.key)
    assert "  env: same" in lines and "  config: same" in lines and "  compiler: same" in lines
    assert "  code: 1 difference(s)" in lines and any("kiln_cache_toy" in line for line in lines)


def test_env_factor_keeps_code_changing_variables_only():
    env = {"KILN_LOG_LEVEL": "DEBUG", "KILN_CACHE_ROOT": "/x", "KILN_DISABLE_COMPILE_CACHE": "0",
           "TORCHINDUCTOR_CACHE_DIR": "/y", "TORCHINDUCTOR_COMPILE_THREADS": "4", "HOME": "/root",
           "TORCHINDUCTOR_MAX_AUTOTUNE": "1", "KILN_SOMETHING_NEW": "on"}
    assert env_factor(env) == {"KILN_SOMETHING_NEW": "on", "TORCHINDUCTOR_MAX_AUTOTUNE": "1"}


def test_disable_switch(monkeypatch):
    monkeypatch.setenv("KILN_DISABLE_COMPILE_CACHE", "1")
    assert cache_disabled() and CompileCache.from_env({"m": 1}) is None
    monkeypatch.setenv("KILN_DISABLE_COMPILE_CACHE", "0")
    assert not cache_disabled() and CompileCache.from_env({"m": 1}) is not None


# -- the engine and the CLI ---------------------------------------------------------------

def test_engine_starts_warm_and_reports_cache_load(copy_of, monkeypatch):
    from kiln import LLM
    from kiln.server.metrics import _compile_cache_counters

    root, key = copy_of
    monkeypatch.setenv("KILN_CACHE_ROOT", str(root))
    llm = LLM("tiny-llama", device="cpu", max_num_batched_tokens=MAX_TOKENS, num_kv_blocks=16, max_model_len=64,
              compilation={"mode": 3, "strategy": "eager"})
    phases = llm.engine.timeline.as_dict()["phases_s"]
    assert phases["cache_load"] > 0 and "dynamo" not in phases and "inductor" not in phases
    assert llm.engine.runner.compiled.entry.key == key
    assert _compile_cache_counters(llm.engine) == (3, 0)
    assert len(llm.generate([[1, 5, 9]])[0].token_ids) > 0
    assert gc.isenabled()  # paused while it imported and loaded (kiln.compile.gc_pause), on again


def test_cache_ls_and_clear(copy_of):
    root, key = copy_of
    cache_root = CacheRoot(root)
    listing = "\n".join(cache_cli.ls(cache_root))
    assert key in listing and "tiny-llama" in listing and "complete" in listing and f"[1,{MAX_TOKENS}]" in listing
    with pytest.raises(ValueError, match="not both and not neither"):
        cache_cli.clear(cache_root, [], False)
    assert cache_cli.clear(cache_root, [key[:6]], False) == [f"removed {key}"]
    assert cache_root.entries() == [] and not (root / key).exists()


def test_tensor_parallel_ranks_do_not_share_an_entry(tiny_llama, tmp_path):
    """Generated code pins its CUDA device: rank 1 (cuda:1) loading rank 0's artifacts ran
    them on cuda:0 and failed, so the device index is part of the key."""
    cache = CompileCache(CacheRoot(tmp_path), {"test": "ranks"}, "tiny")
    compiled = compile_model(tiny_llama, CompilationConfig(mode=3, piece_compiler="eager"), 16, cache=cache)
    rank0, rank1 = (compiled._config_factor(torch.device("cuda", i)) for i in (0, 1))
    assert rank0 != rank1 and rank0["device_type"] == rank1["device_type"] == "cuda"
    assert compiled._config_factor(torch.device("cpu")) == compiled._config_factor(torch.device("cpu"))


# -- who may write the cache --------------------------------------------------------------

def test_every_file_and_folder_of_a_filled_entry_is_private(filled):
    root, key, _, _ = filled
    assert oct(root.stat().st_mode & 0o777) == "0o700"
    loose = [f"{p.relative_to(root)} {oct(p.stat().st_mode & 0o777)}" for p in (root / key).rglob("*")
             if p.name != "lock" and p.stat().st_mode & 0o077]
    loose += [f"{p.relative_to(root)} {oct(p.stat().st_mode & 0o777)}" for p in (root / "index").rglob("*")
              if p.stat().st_mode & 0o077]
    assert loose == []


def test_a_root_others_could_write_is_refused_naming_the_fix(tmp_path, monkeypatch):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    monkeypatch.setenv("KILN_CACHE_ROOT", str(root))
    with pytest.raises(ValueError, match=rf"writable by group or others \(mode 0o777\).*chmod 700 {root}"):
        CompileCache.from_env({"architecture": "x"})
    os.chmod(root, 0o700)
    assert CompileCache.from_env({"architecture": "x"}) is not None
    if os.geteuid() == 0:  # only root can hand the folder to another user
        os.chown(root, 12345, -1)
        with pytest.raises(ValueError, match="belongs to another user .uid 12345"):
            CompileCache.from_env({"architecture": "x"})


def test_cache_ls_says_complete_only_when_every_listed_file_is_there(copy_of):
    root, key = copy_of
    entry = CacheRoot(root).entry(key)
    entry.manifest = entry.read_manifest()
    assert entry.complete()
    piece = next(r for r in entry.manifest["files"] if r.startswith("pieces/"))
    (root / key / piece).write_bytes((root / key / piece).read_bytes()[:-10])  # truncated
    assert not entry.complete() and entry.absent_files() == [piece]
    assert f"{key:16}" in "\n".join(cache_cli.ls(CacheRoot(root))) and "partial" in "\n".join(cache_cli.ls(CacheRoot(root)))
    (root / key / piece).unlink()
    assert entry.absent_files() == [piece]


def test_a_damaged_index_is_a_warning_and_is_rebuilt(copy_of, caplog):
    root, key = copy_of
    (index,) = (root / "index").iterdir()
    index.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="kiln.compile"):
        assert CacheRoot(root).read_index(index.stem) is None
    assert f"index {index} is damaged" in caplog.text and not index.exists()


def test_the_preload_skips_a_module_this_torch_lacks_but_not_a_broken_one(tmp_path, monkeypatch):
    from kiln.compile.cache.preload import _import_if_present

    _import_if_present("torch._inductor.no_such_module_in_any_torch")  # skipped
    (tmp_path / "kiln_broken_probe.py").write_text("import kiln_missing_dependency_probe\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="kiln_missing_dependency_probe"):
        _import_if_present("kiln_broken_probe")


def test_a_triton_compile_after_start_up_is_logged_by_kernel_name(monkeypatch, caplog):
    """Triton's compile listener (a stand-in module here: the CPU has no Triton) counts every
    compile; once start-up is over, a compile is a kernel the warm-up missed and is named."""
    import types

    from kiln.compile.cache import triton_kernels

    compilation = types.SimpleNamespace(listener=None)
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(knobs=types.SimpleNamespace(
        compilation=compilation)))
    monkeypatch.setattr(triton_kernels, "_listening", False)
    monkeypatch.setattr(triton_kernels, "_start_up_done", False)
    monkeypatch.setattr(triton_kernels, "_counts", dict(triton_kernels._counts, compiled=0, cache_hits=0))
    triton_kernels.listen()

    def paged_attention_kernel():
        pass

    src = types.SimpleNamespace(fn=paged_attention_kernel, attrs={(17,): [["tt.divisibility", 16]]})
    with caplog.at_level(logging.WARNING, logger="kiln"):
        compilation.listener(src=src, metadata={}, metadata_group={}, times=None, cache_hit=False)
        assert not caplog.records  # during start-up: counted only
        triton_kernels.start_up(done=True)
        compilation.listener(src=src, metadata={}, metadata_group={}, times=None, cache_hit=True)
        assert not caplog.records  # a cache hit compiles nothing
        compilation.listener(src=src, metadata={}, metadata_group={}, times=None, cache_hit=False)
    assert triton_kernels.counts()["compiled"] == 2 and triton_kernels.counts()["cache_hits"] == 1
    (record,) = caplog.records
    assert "Triton compiled paged_attention_kernel after start-up" in record.getMessage()
    assert "tt.divisibility" in record.getMessage()
    triton_kernels.start_up(done=False)  # another engine's start-up: counted, not logged
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kiln"):
        compilation.listener(src=src, metadata={}, metadata_group={}, times=None, cache_hit=False)
    assert not caplog.records
