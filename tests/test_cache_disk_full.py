"""A compile cache on a volume with no room: the start goes on uncached, with one warning."""

import errno
import logging
import os
import resource
import subprocess
import sys

from cache_process import max_error, start

from kiln.compile.cache import store

# Below kiln's split graph of SmolLM2 (~170 KB), above its manifest and index (a few KB).
LIMIT = 64 * 1024


def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


def test_a_file_size_limit_during_cache_writes_leaves_the_start_uncached_with_one_warning(tmp_path):
    # Eager pieces: Inductor (whose C++ compiler a file-size limit kills too) stays out of it.
    root = tmp_path / "root"
    env = dict(os.environ, KILN_CACHE_ROOT=str(root), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "kiln.cli", "generate", "What is the capital of France?",
                          "--max-tokens", "8", "--temperature", "0", "-O1"], capture_output=True, text=True, env=env, timeout=600,
                         preexec_fn=_limit_file_size)
    # Without kiln ignoring SIGXFSZ the first oversized write would kill it (return code -25).
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Paris" in run.stdout
    warnings = [line for line in run.stderr.splitlines() if "compile cache: cannot write" in line]
    assert len(warnings) == 1, run.stderr[-3000:]
    assert "File too large" in warnings[0] and "Free space under" in warnings[0]
    entries = [p for p in root.iterdir() if (p / "manifest.json").exists()]
    assert entries and not any((e / "graph.pkl").exists() for e in entries)
    assert not [p for p in root.rglob("*") if p.is_file() and p.stat().st_size >= LIMIT]


def test_no_room_for_a_piece_artifact_compiles_on_without_the_cache(tmp_path, monkeypatch, caplog):
    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    from torch._inductor.standalone_compile import AOTCompiledArtifact, CacheCompiledArtifact

    for artifact in (CacheCompiledArtifact, AOTCompiledArtifact):
        monkeypatch.setattr(artifact, "save", full)
    monkeypatch.setattr(store, "_warned_no_room", False)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        model, compiled, _ = start(tmp_path)
    warnings = [r.message for r in caplog.records if "compile cache: cannot write" in r.message]
    assert len(warnings) == 1 and "No space left on device" in warnings[0]
    assert not any("cannot keep" in r.message for r in caplog.records)
    assert not list(tmp_path.rglob("*.inductor.bin"))
    assert compiled.stats["inductor_compiles"] > 0
    assert max_error(model, compiled) < 1e-5
