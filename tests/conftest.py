"""Shared, expensive things are built once per test session."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
# One Inductor cache per test session: compiled-model tests share artifacts with each other,
# never with an earlier session (whose cache would hide compile failures).
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="kiln-test-inductor-")
# Likewise kiln's compile cache: engines built by tests start cold, and write nothing to ~/.cache.
os.environ["KILN_CACHE_ROOT"] = tempfile.mkdtemp(prefix="kiln-test-cache-")

import pytest  # noqa: E402
import torch  # noqa: E402

# The Triton kernels run through Triton's CPU interpreter where there is no GPU. Triton reads
# this once, at its first import (torch._dynamo imports it), so it is set before anything else.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)


def _patch_interpreter_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter turns a 1-element array into a loop bound with int(), which
    numpy >= 2.4 rejects (triton-lang/triton#9171, fixed upstream in #9172); without this
    the attention kernel's `for ... in range(runtime bound)` fails in interpret mode."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "kiln_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.kiln_patched = True
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    try:
        _patch_interpreter_for_numpy_2_4()
    except ImportError:  # no triton here: the Triton tests skip themselves
        pass


@pytest.fixture(scope="session")
def cpu_kernels_dir(tmp_path_factory) -> Path | None:
    """kiln's C++ CPU kernels built once a session (a build takes ~25-70 s), by another process so
    that this one keeps running the reference; None where they do not build (no compiler)."""
    from kiln.compile.cache.root import CPU_KERNELS

    root = tmp_path_factory.mktemp("cpu-kernels-root")
    done = subprocess.run([sys.executable, "-c", "from kiln.ops.cpu import extension; extension.build()"],
                          env=dict(os.environ, KILN_CACHE_ROOT=str(root)), capture_output=True, text=True,
                          timeout=900)
    return root / CPU_KERNELS if done.returncode == 0 else None


@pytest.fixture
def seed_cpu_kernels(cpu_kernels_dir):
    """seed(root): the session's CPU-kernel build copied into a fresh cache root (times kept),
    so that a `kiln prewarm --device cpu` there only loads it instead of compiling for a minute.
    The tests that use it are about the cache entry, not the build (tests/test_cpu_kernels.py)."""
    from kiln.compile.cache.root import CPU_KERNELS

    def seed(root: Path) -> None:
        if cpu_kernels_dir is not None:
            shutil.copytree(cpu_kernels_dir, root / CPU_KERNELS, dirs_exist_ok=True)

    return seed


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2 checkpoint (config, tokenizer, weights)."""
    from kiln.loader import load_source

    return load_source("smollm2")


@pytest.fixture(scope="session")
def llm():
    """An eager fp32 CPU engine on the embedded SmolLM2, shared by the engine tests."""
    from kiln import LLM

    return LLM("smollm2", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own Llama on the same GGUF weights: the reference implementation."""
    transformers = pytest.importorskip("transformers")
    from kiln.loader import embedded_gguf_path

    path = embedded_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    return model.eval()


def _tiny_llama(num_layers: int = 2, **arch):
    import dataclasses

    from kiln.models import build_model
    from kiln.models.presets import PRESETS

    cfg = dataclasses.replace(PRESETS["tiny-llama"], num_layers=num_layers, **arch)
    return build_model(cfg, torch.float32, torch.device("cpu"), frozenset(), None)


@pytest.fixture(scope="session")
def tiny_llama():
    """The 2-layer toy Llama, fp32, random weights, native op paths (what Inductor fuses)."""
    return _tiny_llama()


@pytest.fixture(scope="session")
def tiny_llama_factory():
    """Build a toy Llama with a given number of layers (and other architecture overrides)."""
    return _tiny_llama


@pytest.fixture(scope="session")
def compiled_tiny_llama(tiny_llama):
    """tiny-llama through kiln's piecewise Inductor pipeline, eager strategy: two compile
    ranges ([1, 8], [9, 64]) and two exact sizes (4, 16), all compiled at the first call."""
    from kiln.compile import compile_model
    from kiln.compile.config import CompilationConfig

    config = CompilationConfig(mode=3, piece_compiler="inductor", strategy="eager",
                               compile_ranges=[8], compile_sizes=[4, 16])
    compiled = compile_model(tiny_llama, config, max_num_batched_tokens=64)
    compiled.warm_up(lambda n: (torch.randint(0, 512, (n,)), torch.arange(n)))
    return compiled


@pytest.fixture(scope="session")
def app_client():
    """The HTTP app on the embedded model in-process (TestClient), ready: a short context, so
    that any request ends quickly."""
    import time

    from fastapi.testclient import TestClient

    from kiln.config import EngineConfig
    from kiln.server.app import build_app

    with TestClient(build_app(EngineConfig(device="cpu", max_model_len=48, num_kv_blocks=64),
                              served_model_name="smollm2")) as client:
        for _ in range(3000):
            if client.get("/health").status_code == 200:
                break
            time.sleep(0.05)
        yield client


@pytest.fixture
def gpu_draw(monkeypatch):
    """The sampler draws as on the GPU (Gumbel-max, its Triton kernel interpreted), with none of
    the CPU's own ways (draw_from_picks: a top-k batch's inverse CDF over its picks)."""
    from kiln.engine import sampler

    monkeypatch.setattr(sampler, "draw", sampler.gumbel)
    monkeypatch.setattr(sampler, "draw_from_picks", lambda *args: None)

