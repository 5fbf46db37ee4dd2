"""Shared, expensive things are built once per test session."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


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
