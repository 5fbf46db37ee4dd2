"""`kiln inspect`: the split ops and where each came from, pieces, ranges and sizes, capture
sizes, custom ops, the cache entry with its factor hashes, and the split graph's path; a warm
start when an entry exists, a compile (or, with --no-compile, a capture only) when none does."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from kiln.compile.config import CompilationConfig
from kiln.config import EngineConfig
from kiln.tools.inspect_cmd import inspect_model, render

HERE = Path(__file__).resolve().parent
TINY = ["--model", "tiny-llama", "--max-num-batched-tokens", "32"]


def kiln(*args, root: Path, **env):
    env = dict(os.environ, OMP_NUM_THREADS="1", KILN_CACHE_ROOT=str(root), **env)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-m", "kiln.cli", *args], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_no_compile_shows_every_split_op_with_its_source_and_the_pieces(tmp_path):
    root = tmp_path / "root"
    out = kiln("inspect", *TINY, "--no-compile", "--custom-ops", "none,+silu_and_mul",
               "-cc.splitting_ops=kiln::silu_and_mul", root=root)
    assert re.search(r"kiln::attention\s+decorator at \S+attention\.py:\d+: attention over", out)
    assert re.search(r"kiln::kv_cache_write\s+decorator at ", out)
    assert re.search(r"kiln::silu_and_mul\s+config", out)
    # Two layers cut at the KV write + attention and at the MLP's activation: the two
    # attention-to-activation stretches are the same piece.
    assert "pieces: 5 (4 unique) around 4 opaque regions" in out
    assert "unique piece 1: 2 piece(s): submod_2, submod_6" in out
    assert "repeated layers: 2 of 1 kind(s)" in out and "kind 0: model.layers.{0, 1}" in out
    assert "compile ranges: [1, 32]" in out and "compile sizes: none" in out
    assert ("CUDA graphs, decode (uniform decode batches): full over the inductor forward; "
            "7 buckets: 1, 2, 4, 8, 16, 24, 32") in out
    assert "CUDA graphs, prefill (mixed batches): piecewise" in out and "graphs pass through" in out
    assert "custom ops enabled: silu_and_mul (of fused_add_rms_norm, gelu_tanh_and_mul, rms_norm" in out
    assert "--no-compile" in out and "cache entry: no entry yet" in out
    graph = Path(re.search(r"split graph as Python: (\S+)", out).group(1))
    assert "class SplitGraph" in graph.read_text() and "# unique piece 3:" in graph.read_text()
    graph.unlink()
    assert not root.exists() or not [p for p in root.iterdir() if p.name != "index"]  # nothing compiled or kept


def test_compiles_once_then_starts_warm_and_names_the_entry_and_its_factors(tmp_path):
    root = tmp_path / "root"
    cold = kiln("inspect", *TINY, root=root)
    assert "no cache entry had these settings: captured and compiled now" in cold and "3 Inductor compiles" in cold
    key = re.search(r"cache entry: ([0-9a-f]{16})", cold).group(1)

    warm = json.loads(kiln("inspect", *TINY, "--json", root=root))
    assert warm["run"]["how"] == "loaded"
    assert warm["run"]["stats"]["graphs_seen"] == 0 and warm["run"]["stats"]["inductor_compiles"] == 0
    assert warm["pieces"]["pieces"] == 3 and warm["pieces"]["unique_pieces"] == 3
    assert warm["plan"] == {"ranges": [[1, 32]], "sizes": []} and warm["cuda_graphs"]["decode"]["mode"] == "full"
    entry = warm["cache"]["entry"]
    assert entry["key"] == key and entry["path"] == str(root / key) and entry["complete"]
    assert sorted(entry["factor_hashes"]) == ["code", "compiler", "config", "env"]
    assert all(re.fullmatch(r"[0-9a-f]{16}", h) for h in entry["factor_hashes"].values())
    assert entry["key_matches_factors"] and entry["code_files"] > 0
    assert warm["split_graph"] == {"path": str(root / key / "computation_graph.py"), "where": "cache entry"}

    # -O3 shares the entry (sizes are not in the key) and lists what it lacks, compiling nothing.
    more = kiln("inspect", *TINY, "-O3", root=root)
    assert "started warm from the compile cache" in more and f"cache entry: {key}" in more
    assert "compile sizes: 1, 2, 4, 8" in more and "eager strategy" in more
    assert "missing: size-1, size-2, size-4, size-8 -> incomplete" in more
    assert re.search(r"factor hashes: env [0-9a-f]{16}, config [0-9a-f]{16}, code [0-9a-f]{16} \(\d+ files\), "
                     r"compiler [0-9a-f]{16}", more)


def test_eager_has_nothing_to_split_and_says_so():
    report = inspect_model(EngineConfig(model="tiny-llama", compilation=CompilationConfig.level(0)))
    assert report["pieces"] is None and report["cache"] is None and report["run"]["how"] == "none"
    text = render(report)
    assert "eager: the forward runs as the model's own Python" in text and "(the default is -O2)" in text
    assert "CUDA graphs, decode (uniform decode batches): none over the eager forward; no buckets" in text
    assert "custom ops enabled: fused_add_rms_norm, gelu_tanh_and_mul, rms_norm, rotary_embedding, silu_and_mul" in text


def test_with_the_cache_off_the_split_graph_is_written_for_the_run(monkeypatch):
    monkeypatch.setenv("KILN_DISABLE_COMPILE_CACHE", "1")
    config = EngineConfig(model="tiny-llama", device="cpu", max_num_batched_tokens=16,
                          compilation=CompilationConfig.level(2))
    report = json.loads(json.dumps(inspect_model(config, compile_missing=False)))  # plain JSON all through
    assert report["run"]["how"] == "captured" and report["run"]["stats"]["inductor_compiles"] == 0
    assert report["cache"]["off"] and report["cache"]["entry"] is None
    assert [op["name"] for op in report["split_ops"]] == ["kiln::kv_cache_write", "kiln::rotary_kv_cache_write",
                                                          "kiln::attention"]
    graph = Path(report["split_graph"]["path"])
    assert report["split_graph"]["where"] == "written for this run" and "class SplitGraph" in graph.read_text()
    graph.unlink()
    assert "the compile cache is off" in render(report)
