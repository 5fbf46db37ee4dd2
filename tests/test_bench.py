"""kiln bench: the floor arithmetic, op counts read from a profiler trace, and one small run."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from kiln.models.presets import PRESETS
from kiln.tools.bench import Floor, Workload, floor_for, outermost_ops, plot, render, run_bench
from kiln.tools.traffic import decode_weight_bytes


def test_floor_reproduces_the_llama_3_8b_batch_1_number():
    # FIELD_NOTES: 15.0 GB of bf16 weights a decode step reads, at 4.25 TB/s: ~3.53 ms.
    cfg = PRESETS["llama-3-8b"]
    floor = Floor(copy_bytes_per_s=4.25e12, matmul_flops_per_s=989e12, weight_bytes=decode_weight_bytes(cfg, 2))
    one = floor_for(cfg, 2, floor, batch=1, seq_len=128)
    assert one["bound"] == "memory"
    assert one["step_ms"] == pytest.approx(3.53, abs=0.01)
    # 256 sequences of 128 tokens add 4.3 GB of KV cache reads and 2 x 7.5 G x 256 FLOPs.
    big = floor_for(cfg, 2, floor, batch=256, seq_len=128)
    assert big["bytes"] / 1e9 == pytest.approx(15.0 + 4.29, abs=0.02)
    assert big["flops"] / 1e12 == pytest.approx(3.86, abs=0.01)


def test_ops_are_counted_from_the_trace_outermost_only():
    x, w = torch.randn(4, 8), torch.randn(16, 8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y = torch.nn.functional.linear(x, w)  # aten::linear runs aten::t and aten::mm inside
        y = y.view(2, 32)  # a view: no work
        torch.relu(y)
    counts = outermost_ops(prof)
    assert counts == {"aten::linear": 1, "aten::relu": 1}


@pytest.fixture(scope="module")
def small_run():
    w = Workload.default("cpu", "tiny-llama", batches=[1, 2], context=16, modes=["eager", "O2"],
                         timed_steps=3)
    w.warmup_steps, w.profiled_steps = 1, 1
    return run_bench(w)


def test_one_run_side_by_side(small_run):
    modes = {m["name"]: m for m in small_run["modes"]}
    assert set(modes) == {"eager", "O2"} and not any(m["error"] for m in modes.values())
    for m in modes.values():
        assert [p["batch"] for p in m["points"]] == [1, 2]
        assert all(p["step_ms"] > 0 and p["ops_per_step"] > 0 for p in m["points"])
    # The compiled step runs Inductor's C++ kernels, seen in the trace; eager runs none.
    assert any("cpp_fused" in name for name in modes["O2"]["points"][0]["top_ops"])
    assert not any("cpp_fused" in name for name in modes["eager"]["points"][0]["top_ops"])
    assert modes["O2"]["compile_stats"]["pieces"] == 3
    floor = small_run["floor"]
    assert floor["copy_bytes_per_s"] > 0 and floor["matmul_flops_per_s"] > 0
    assert [f["batch"] for f in floor["per_batch"]] == [1, 2]
    text = render(small_run)
    assert "vs eager" in text and "vs floor" in text and "floor" in text
    assert "outermost aten/kiln ops" in text  # the CPU count says what it is
    if small_run["vllm"].startswith("vLLM not installed"):
        assert "vLLM not installed, skipped" in text
    json.dumps(small_run)


def test_plot_writes_a_png(small_run, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    plot(small_run, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_extra(small_run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match=r"pip install kiln\[bench\]"):
        plot(small_run, str(tmp_path / "bench.png"))


def test_cli_writes_json(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "kiln.cli", "bench", "--model", "tiny-llama", "--modes", "eager",
                          "--batches", "1", "--context", "8", "--steps", "2", "--out", str(tmp_path), "--no-plot"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "kiln -O0 (eager)" in run.stdout and "floor" in run.stdout
    result = json.loads((tmp_path / "bench_tiny-llama_cpu.json").read_text())
    assert result["modes"][0]["points"][0]["batch"] == 1
