"""`kiln generate` and `kiln serve`'s flags as a user runs them: a fresh process, the embedded
model, no network."""

import os
import subprocess
import sys


def _kiln(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "kiln.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_generate_prints_text_and_speed():
    run = _kiln("generate", "What is the capital of France?", "--max-tokens", "12")
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout
    assert "tokens/s" in run.stderr and "model smollm2" in run.stderr


def test_generate_bad_input_is_a_clear_error():
    run = _kiln("generate", "hi", "--custom-ops", "+rms_norm")
    assert run.returncode == 2
    assert "exactly one base" in run.stderr and "Traceback" not in run.stderr


def test_generate_o1_runs_the_kernel_path_ops_captured():
    # -O1 keeps the opaque kernel-path ops (no Inductor to fuse the native ones)
    run = _kiln("generate", "What is the capital of France?", "--max-tokens", "8", "-O1")
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout and "eager pieces" in run.stderr


def test_generate_a_preset_without_tokenizer_is_a_clear_error():
    run = _kiln("generate", "hi", "--model", "tiny-llama")
    assert run.returncode == 2
    assert "has no tokenizer" in run.stderr and "Traceback" not in run.stderr


def test_serve_takes_vllms_positional_model_and_shows_its_flags():
    run = _kiln("serve", "--help")
    assert run.returncode == 0
    for flag in ("MODEL", "--enable-prefix-caching", "--no-enable-prefix-caching", "-O", "-cc",
                 "--compilation-config", "--served-model-name"):
        assert flag in run.stdout, flag
    twice = _kiln("serve", "tiny-llama", "--model", "smollm2")
    assert twice.returncode != 0 and "the model is given twice" in twice.stderr
