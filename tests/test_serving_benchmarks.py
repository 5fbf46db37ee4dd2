"""The GPU serving benchmarks, small on the CPU: they run end to end and write what the issue's
must-show reads (a GPU call wasted on a broken script costs a session's minutes)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.models.presets import PRESETS
from kiln.tools.bench import Floor
from kiln.tools.traffic import decode_weight_bytes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _run(script: str, out: Path, *args: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--out", str(out), *args],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = out.glob("*.json")
    return json.loads(path.read_text())


def test_throughput_runs_every_prompt_to_its_length(tmp_path):
    report = _run("throughput.py", tmp_path, "--model", "tiny-llama", "--num-prompts", "6", "--input-len", "20",
                  "--output-len", "5", "--max-num-seqs", "4", "--modes", "default", "O2")
    assert [m["mode"] for m in report["modes"]] == ["default", "O2"]
    for mode in report["modes"]:
        assert mode["total_tokens_per_s"] == pytest.approx(6 * 25 / mode["elapsed_s"])
        assert 0 < mode["of_floor"]
    assert report["floor"]["decode_steps_at_least"] == 2 * 5  # ceil(6 / 4) waves of 5 steps


def test_throughput_floor_counts_the_work():
    import throughput

    cfg = PRESETS["llama-3-8b"]
    floor = Floor(copy_bytes_per_s=4e12, matmul_flops_per_s=800e12, weight_bytes=decode_weight_bytes(cfg, 2))

    class Args:
        num_prompts, input_len, output_len, max_num_seqs = 1000, 512, 128, 256

    bound = throughput.workload_floor(cfg, 2, floor, Args)
    # ~2 x 7.5 G parameters x 640k tokens of matmuls, plus causal attention: compute-bound.
    assert bound["bound"] == "compute" and 9.6e15 < bound["flops"] < 9.8e15
    assert bound["decode_steps_at_least"] == 4 * 128


def test_serving_streams_token_ids_from_a_model_without_a_tokenizer(tmp_path):
    # tiny-llama has no tokenizer: only return_token_ids' chunks carry its tokens.
    report = _run("serving.py", tmp_path, "--model", "tiny-llama", "--rates", "50", "--num-prompts", "4",
                  "--input-len", "12", "--output-len", "4")
    (rate,) = report["rates"]
    assert (rate["completed"], rate["lost"]) == (4, 0)
    assert rate["ttft_s"]["p50"] > 0 and rate["tpot_s"]["p50"] > 0
    slowest = rate["slowest_ttft"]
    assert len(slowest) == 4 and slowest[0]["ttft_s"] == max(s["ttft_s"] for s in slowest) >= rate["ttft_s"]["p50"]
    assert rate["triton_kernels_while_serving"] == {"compiled": 0, "cached": 0}  # no Triton on the CPU
    assert report["floor"]["ttft_s"] > 0 and report["floor"]["tpot_s"] > 0
    (load,) = report["floor"]["under_load"].values()
    assert load["tpot_s"] is None or load["tpot_s"] >= report["floor"]["tpot_s"]
    assert load["compute_fraction"] > 0


def test_the_floor_under_load_holds_the_concurrency_a_rate_brings_and_says_when_none_is_sustainable():
    import serving

    cfg = PRESETS["llama-3-8b"]
    floor = Floor(copy_bytes_per_s=3e12, matmul_flops_per_s=800e12, weight_bytes=decode_weight_bytes(cfg, 2))
    alone = floor.weight_bytes / floor.copy_bytes_per_s
    load = serving.load_floor(cfg, 2, floor, 32.0, 512, 128, alone)
    # 32 x (512 prompt + 128 output tokens) x ~2 x 7.5 G parameters a second: ~36% of 800 TFLOP/s.
    assert 0.36 < load["compute_fraction"] < 0.40
    # ~4,096 sequence-steps a second, each reading 576 tokens' KV (75.5 MB): ~10% of the copy rate.
    assert 0.09 < load["kv_read_fraction"] < 0.12
    # A dense model's fixed point: the weights' read stretched by the share the caches add.
    assert load["tpot_s"] == pytest.approx(alone / (1 - load["kv_read_fraction"]), rel=1e-6)
    assert serving.load_floor(cfg, 2, floor, 1.0, 512, 128, alone)["tpot_s"] == pytest.approx(alone, rel=0.01)
    assert serving.load_floor(cfg, 2, floor, 32.0, 512, 128, 1.0)["tpot_s"] == 1.0  # never below one sequence's
    beyond = serving.load_floor(cfg, 2, floor, 100.0, 512, 128, alone)
    assert beyond["compute_fraction"] > 1 and beyond["tpot_s"] is None
    # A mixture of experts reads more experts the more sequences a step holds.
    moe = PRESETS["qwen3-30b-a3b"]
    moe_floor = Floor(copy_bytes_per_s=3e12, matmul_flops_per_s=800e12, weight_bytes=decode_weight_bytes(moe, 2))
    one = moe_floor.weight_bytes / moe_floor.copy_bytes_per_s
    under_load = serving.load_floor(moe, 2, moe_floor, 32.0, 512, 128, one)
    loaded, batch = under_load["tpot_s"], 32 * 128 * under_load["tpot_s"]
    assert loaded > one / (1 - under_load["kv_read_fraction"])
    assert loaded == pytest.approx((decode_weight_bytes(moe, 2, math.ceil(batch)) + batch * serving.kv_bytes(
        moe, 2, 512 + 64)) / 3e12, rel=1e-6)


def test_step_trace_records_every_token_computed(tmp_path):
    report = _run("step_trace.py", tmp_path, "--model", "tiny-llama", "--rate", "100", "--num-prompts", "6",
                  "--input-len", "20", "--output-len", "4", "--max-step-seconds", "1", "inf")
    assert [r["max_step_seconds"] for r in report["runs"]] == [1.0, None]
    for run in report["runs"]:
        run["steps"] = [dict(zip(report["step_columns"], row)) for row in run["steps"]]
        assert (run["sent"], run["cut_short"]) == (6, False)
        # Each prompt's 20 tokens, then 3 decodes: its last token is sampled, never fed back.
        assert sum(s["prefill"] + s["decodes"] for s in run["steps"]) == 6 * (20 + 3)
        assert sum(b["steps"] for b in run["buckets"]) == len(run["steps"])
    budgeted = report["runs"][0]["steps"]
    assert all(s["allowed"] is not None for s in budgeted) and budgeted[-1]["fixed_s"] > 0
