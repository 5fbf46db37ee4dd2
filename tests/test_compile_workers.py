"""Cold compiles in worker processes: same outputs as in-process, artifacts land in the
compile cache, a second start loads them all, a worker's failure falls back in-process."""

import logging

import pytest
import torch

from kiln.compile import compile_model, pieces
from kiln.compile.cache import CacheRoot, CompileCache
from kiln.compile.cache.entry import CacheEntry
from kiln.compile.compile_workers import PieceResult
from kiln.compile.config import CompilationConfig

# Once Inductor is imported, a CUDA build of torch marks every later fork unusable (the child's
# torch.cuda._is_in_bad_fork(): the 2.11.0+cu130 wheel, even without a GPU), so kiln spawns its
# workers there; the CPU build forks.
forks = pytest.mark.skipif(torch.version.cuda is not None,
                           reason="this CUDA build of torch poisons forks once Inductor is imported")
# One range [1, 64] and one exact size: 2 shapes x 3 unique pieces of the 2-layer toy.
CONFIG = dict(mode=3, piece_compiler="inductor", strategy="lazy", compile_sizes=[4])
TOKEN_COUNTS = (1, 4, 9, 64)


def _inputs(n):
    gen = torch.Generator().manual_seed(n)
    return torch.randint(0, 512, (n,), generator=gen), torch.arange(n)


def _start(model, root, workers, **overrides):
    config = CompilationConfig(**{**CONFIG, **overrides}, compile_workers=workers)
    compiled = compile_model(model, config, 64,
                             cache=CompileCache(CacheRoot(root), {"test": "workers"}, "tiny"))
    compiled.warm_up(_inputs)
    return compiled


@pytest.mark.parametrize("start_method", [pytest.param("fork", marks=forks), "spawn"])
def test_workers_compile_the_pieces_and_a_second_start_loads_them(tiny_llama, tmp_path, caplog, monkeypatch,
                                                                   start_method):
    # Forked where the parent has no other thread and no CUDA, else spawned: both ways here (the
    # test process may have threads other tests left).
    monkeypatch.setattr("kiln.compile.compile_workers._fork_is_safe", lambda: start_method == "fork")
    # While the workers compile, this process imports what loading their artifacts needs: before the first load.
    events = []
    prepare, load = pieces.prepare_loading, CacheEntry.load_piece
    monkeypatch.setattr(pieces, "prepare_loading", lambda *args: events.append(prepare(*args)))
    monkeypatch.setattr(CacheEntry, "load_piece", lambda *a: events.append("load") or load(*a))
    with caplog.at_level(logging.INFO, logger="kiln.compile"):
        cold = _start(tiny_llama, tmp_path, workers=2)
    assert f"compiling 6 pieces in 2 worker processes ({start_method})" in caplog.text
    prepared = [e for e in events if e != "load"]
    assert len(prepared) == 1 and set(prepared[0]) == {"imports", "torch_key"}
    # The loads before it are the look-ups that found nothing; the six after it, the workers' pieces.
    assert events[events.index(prepared[0]) + 1:] == ["load"] * 6
    stats = cold.stats
    assert stats["graphs_seen"] == 1 and stats["unique_pieces"] == 3
    assert stats["inductor_compiles"] == 6 and stats["compiles_after_capture"] == 0
    # Both ends of the workers' start-up are timed (warm-ups done, jobs handed over).
    assert stats["workers_ready_s"] > 0 and stats["workers_jobs_s"] > 0
    assert cold.backend.workers is None  # the processes are gone once the capture is done
    for n in TOKEN_COUNTS:
        ids, pos = _inputs(n)
        torch.testing.assert_close(cold(ids, pos), tiny_llama(ids, pos), rtol=1e-4, atol=1e-4)
    entry = cold.entry
    assert entry.complete() and entry.bad_files() == []
    assert not list(entry.path.rglob("*.worker.tmp"))

    warm = _start(tiny_llama, tmp_path, workers=2)
    assert warm.stats["graphs_seen"] == 0 and warm.stats["inductor_compiles"] == 0
    assert warm.stats["pieces_loaded"] == 6
    ids, pos = _inputs(9)
    torch.testing.assert_close(warm(ids, pos), cold(ids, pos), rtol=0, atol=0)


class FailingWorkers:
    """Stands in for the worker pool: every job fails, as a crashed compile would."""

    count = 2
    timing = None
    start_method = "spawn"

    def __init__(self):
        self.jobs = []

    def compile(self, jobs, meanwhile=None):
        self.jobs += jobs
        return [(job, PieceResult(job.index, job.shape, 0.0, False, "RuntimeError: boom")) for job in jobs]

    def close(self):
        pass


def test_a_failed_worker_compile_is_compiled_in_process(tiny_llama, tmp_path, caplog, monkeypatch):
    import kiln.compile.compiled_model as compiled_model

    workers = FailingWorkers()
    monkeypatch.setattr(compiled_model, "CompileWorkers", lambda count: workers)
    with caplog.at_level(logging.WARNING, logger="kiln.compile"):
        compiled = _start(tiny_llama, tmp_path, workers=2, compile_sizes=[])
    assert len(workers.jobs) == 3
    assert caplog.text.count("RuntimeError: boom); compiling it here") == 3
    assert compiled.stats["inductor_compiles"] == 3 and compiled.entry.complete()
    ids, pos = _inputs(4)
    torch.testing.assert_close(compiled(ids, pos), tiny_llama(ids, pos), rtol=1e-4, atol=1e-4)


def test_workers_started_before_a_cold_start_compile_its_capture(tiny_llama, tmp_path, monkeypatch):
    """The engine starts the workers before the weights load where no entry of the model is in
    the cache; the capture then uses those, and starts none of its own."""
    import kiln.compile.compile_workers as compile_workers
    import kiln.compile.compiled_model as compiled_model

    early = FailingWorkers()
    monkeypatch.setattr(compile_workers, "CompileWorkers", lambda count: early)
    monkeypatch.setattr(compiled_model, "CompileWorkers", lambda count: pytest.fail("a second pool started"))
    config = CompilationConfig(**CONFIG, compile_workers=2)
    cache = CompileCache(CacheRoot(tmp_path), {"test": "workers"}, "tiny")
    compile_workers.start_before_cold_start(config, cache, "cpu")
    assert cache.workers is early
    compiled = compile_model(tiny_llama, config, 64, cache=cache)
    compiled.warm_up(_inputs)
    assert len(early.jobs) == 6 and cache.workers is None
    assert compiled.entry.complete()

    # Now an entry of the model is there: the next start is likely warm, and starts none early.
    again = CompileCache(CacheRoot(tmp_path), {"test": "workers"}, "tiny")
    compile_workers.start_before_cold_start(config, again, "cpu")
    assert again.workers is None
    # Nor with graph passes (they run in-process) or one worker.
    fresh = CompileCache(CacheRoot(tmp_path / "fresh"), {"test": "workers"}, "tiny")
    compile_workers.start_before_cold_start(CompilationConfig(**CONFIG, compile_workers=1), fresh, "cpu")
    assert fresh.workers is None


@forks
def test_workers_started_ahead_are_forked_there_and_taken_by_an_engine_built_on_another_thread(tiny_llama, tmp_path,
                                                                                            monkeypatch):
    """`kiln serve` builds its engine on a thread beside uvicorn's loop, where workers could only
    be spawned: it starts a cold start's workers first (start_ahead), and the engine's own
    start_before_cold_start takes them."""
    import threading

    import kiln.compile.compile_workers as compile_workers

    config = CompilationConfig(**CONFIG, compile_workers=2)
    root = CacheRoot(tmp_path)
    fork_is_safe = compile_workers._fork_is_safe
    with monkeypatch.context() as patch:  # as in a fresh `kiln serve` process, whatever threads this one has
        patch.setattr(compile_workers, "_fork_is_safe", lambda: True)
        compile_workers.start_ahead(config, CompileCache(root, {"test": "workers"}, "tiny"), "cpu")
    seen = {}

    def engine_thread():
        seen["fork_here"] = fork_is_safe()
        cache = CompileCache(root, {"test": "workers"}, "tiny")
        compile_workers.start_before_cold_start(config, cache, "cpu")
        seen["workers"] = cache.workers
        seen["compiled"] = compile_model(tiny_llama, config, 64, cache=cache)
        seen["compiled"].warm_up(_inputs)

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    assert seen["fork_here"] is False  # a second thread runs: this one could only spawn them
    assert seen["workers"].start_method == "fork" and not compile_workers._ahead
    compiled = seen["compiled"]
    assert compiled.stats["inductor_compiles"] == 6 and compiled.entry.complete()
    for n in TOKEN_COUNTS:
        ids, pos = _inputs(n)
        torch.testing.assert_close(compiled(ids, pos), tiny_llama(ids, pos), rtol=1e-4, atol=1e-4)


def test_kiln_serve_starts_a_cold_start_s_workers_before_the_engine_thread(tmp_path, monkeypatch):
    """What kiln.server.run.serve does before uvicorn starts: the -O2 engine of a model with no
    entry in the cache gets its workers; with an entry there, none start."""
    import kiln.compile.compile_workers as compile_workers
    from kiln.config import EngineConfig
    from kiln.engine.runner import compile_cache, start_compile_workers_ahead
    from kiln.loader import load_source

    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path))
    config = EngineConfig(model="smollm2", device="cpu", compilation={"mode": 3, "compile_workers": 2})
    source = load_source(config.model)
    start_compile_workers_ahead(config, source)
    try:
        assert len(compile_workers._ahead) == 1
    finally:
        for workers in compile_workers._ahead.values():
            workers.close()
        compile_workers._ahead.clear()
    cache = compile_cache(source, config.torch_dtype, config.resolved_custom_ops())
    monkeypatch.setattr(cache.root, "has_entry_for", lambda name, device_type: True)
    monkeypatch.setattr("kiln.engine.runner.compile_cache", lambda *args: cache)
    start_compile_workers_ahead(config, source)
    assert not compile_workers._ahead


@pytest.mark.parametrize("bad", [-1, 1.5, True, "two"])
def test_compile_workers_must_be_a_count(bad):
    with pytest.raises(ValueError, match="compile_workers must be a count"):
        CompilationConfig(mode=3, compile_workers=bad)


def test_a_worker_is_told_where_the_ops_of_its_piece_are_defined():
    import kiln.ops  # noqa: F401  registers torch.ops.kiln.*
    from kiln.compile.compile_workers import op_modules

    def piece(x, w):  # the overload and the packet, as Dynamo may record either
        return torch.ops.kiln.rms_norm.default(x, w, 1e-5) + torch.ops.kiln.silu_and_mul(x) + x.sin()

    assert op_modules(torch.fx.symbolic_trace(piece)) == ["kiln.ops.activation", "kiln.ops.norm"]


def test_workers_do_not_run_the_parents_main_script(tmp_path):
    """A spawned process runs its parent's main script first unless told otherwise: a user's
    script without an `if __name__ == "__main__"` guard would build an engine in every worker."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "unguarded.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
        "print('main ran', flush=True)\n"
        "from kiln.compile.compile_workers import CompileWorkers\n"
        "workers = CompileWorkers(1)\n"
        "print('worker pid differs:', workers.pool.submit(os.getpid).result() != os.getpid(), flush=True)\n"
        "workers.close()\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["main ran", "worker pid differs: True"]
