"""kiln's structured-trace artifacts: with TORCH_TRACE set, the trace log holds kiln's config,
split graph and per-piece compile and load events beside Dynamo's and Inductor's (what
tlparse renders); without it, no payload is built.

The subprocess runs are tests/cache_process.py (tiny-llama, Inductor, one range [1, 32]):
cold into a fresh cache root, then warm from it.
"""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cache_process import MAX_TOKENS, OPS
from torch._logging._internal import trace_log

from kiln.compile import compile_model, trace
from kiln.compile.config import CompilationConfig
from kiln.forward_context import set_forward_context

HERE = Path(__file__).resolve().parent


def read_trace(folder: Path) -> list[tuple[dict, str]]:
    """(metadata, payload) of every event in the trace logs under `folder`: a header line
    `<glog prefix>] {json}`, then the payload's lines, each indented by a tab."""
    events = []
    for log in sorted(folder.glob("*.log")):
        for line in log.read_text().splitlines():
            if line.startswith("\t"):
                meta, payload = events[-1]
                events[-1] = (meta, payload + line[1:] + "\n")
            else:
                events.append((json.loads(line.split("] ", 1)[1]), ""))
    return events


def kiln_artifacts(events, name: str) -> list[tuple[dict, str]]:
    return [(meta, payload) for meta, payload in events if meta.get("artifact", {}).get("name") == name]


def traced_start(root: Path, trace_dir: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_TRACE=str(trace_dir))
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(HERE / "cache_process.py"), str(root)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    base = tmp_path_factory.mktemp("trace")
    cold = traced_start(base / "root", base / "cold")
    warm = traced_start(base / "root", base / "warm")
    return read_trace(base / "cold"), read_trace(base / "warm"), cold, warm


def test_cold_trace_has_config_split_graph_and_a_compile_per_piece_under_dynamos_frame(traces):
    events, _, cold, _ = traces
    names = [meta.get("artifact", {}).get("name") for meta, _ in events]
    assert "dynamo_output_graph" in {next(iter(meta)) for meta, _ in events}  # Dynamo's own, beside kiln's
    assert names.count(trace.CONFIG) == 1 and names.count(trace.SPLIT_GRAPH) == 1
    (config_meta, config), = kiln_artifacts(events, trace.CONFIG)
    assert config_meta["artifact"]["encoding"] == "json" and config_meta["frame_id"] == 0
    config = json.loads(config)
    assert config["compilation_config"]["mode"] == 3 and config["compilation_config"]["piece_compiler"] == "inductor"
    sources = {op["name"]: op["source"] for op in config["split_ops"]}
    assert sources["kiln::attention"].startswith("decorator at ") and "kiln::kv_cache_write" in sources
    assert config["plan"] == {"ranges": [[1, MAX_TOKENS]], "sizes": []}
    assert config["engine"]["dtype"] == "float32" and config["engine"]["custom_ops"] == sorted(OPS)
    (graph_meta, graph), = kiln_artifacts(events, trace.SPLIT_GRAPH)
    assert graph_meta["artifact"]["encoding"] == "string"
    assert "class SplitGraph" in graph and "# unique piece 2: submod_4" in graph
    compiles = [json.loads(p) for _, p in kiln_artifacts(events, trace.PIECE_COMPILE)]
    assert len(compiles) == cold["stats"]["inductor_compiles"] == 3
    assert sorted(c["unique_piece"] for c in compiles) == [0, 1, 2]
    for c in compiles:
        assert c["shape"] == f"range [1, {MAX_TOKENS}]" and c["seconds"] > 0 and c["cache"] in ("hit", "miss")
    # Each piece was looked up in the (empty) entry first.
    loads = [json.loads(p) for _, p in kiln_artifacts(events, trace.PIECE_LOAD)]
    assert [x["cache"] for x in loads] == ["miss"] * 3 and {x["entry"] for x in loads} == {cold["key"]}


def test_warm_trace_loads_every_piece_and_compiles_none(traces):
    _, events, _, warm = traces
    assert warm["stats"]["graphs_seen"] == 0  # no Dynamo: these events carry no compile id
    assert len(kiln_artifacts(events, trace.CONFIG)) == 1
    (_, graph), = kiln_artifacts(events, trace.SPLIT_GRAPH)
    assert "def forward(" in graph and "# unique piece 2: submod_4" in graph  # as unpickled from graph.pkl
    assert kiln_artifacts(events, trace.PIECE_COMPILE) == []
    loads = [json.loads(p) for meta, p in kiln_artifacts(events, trace.PIECE_LOAD)]
    assert [x["cache"] for x in loads] == ["hit"] * 3 and {x["entry"] for x in loads} == {warm["key"]}
    assert all(x["cache_kind"] == "kiln compile cache" and x["seconds"] >= 0 for x in loads)


class Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.events = []

    def emit(self, record):
        self.events.append((getattr(record, "metadata", {}), getattr(record, "payload", None)))


def test_split_only_capture_traces_config_and_graph_in_process(tiny_llama):
    handler = Collect()
    trace_log.addHandler(handler)
    try:
        compiled = compile_model(tiny_llama, CompilationConfig.level(1), 16)
        with torch.inference_mode(), set_forward_context(None, {}):
            compiled(torch.zeros(8, dtype=torch.long), torch.arange(8))
    finally:
        trace_log.removeHandler(handler)
    names = [meta["artifact"]["name"] for meta, _ in handler.events if "artifact" in meta]
    assert names.count(trace.CONFIG) == 1 and names.count(trace.SPLIT_GRAPH) == 1
    config = next(json.loads(p) for meta, p in handler.events if meta.get("artifact", {}).get("name") == trace.CONFIG)
    assert config["compilation_config"]["piece_compiler"] == "eager" and config["engine"] is None
    assert trace.PIECE_COMPILE not in names  # eager pieces: nothing is compiled


def test_without_a_trace_handler_no_payload_is_built(monkeypatch):
    # What a process without TORCH_TRACE has (pytest attaches its own capture handlers to
    # torch's trace logger, so the test sets the empty list itself).
    monkeypatch.setattr(trace_log, "handlers", [])

    class Exploding:
        def readable(self):
            raise AssertionError("payload built without TORCH_TRACE")

    trace.split_graph(Exploding())
    trace.artifact("kiln_probe", "json", Exploding().readable)
