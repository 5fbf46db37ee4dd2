"""Checkpoints in: the embedded GGUF, HF folders written by transformers, random presets."""

import copy

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.loader import load_source
from kiln.models.presets import PRESETS

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\nnewlines", "Ünïcödé — 日本語 🙂",
         "<|im_start|>user\nhi<|im_end|>", "don't they'll we've"]


def test_gguf_config(smollm2):
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.eos_token_ids == (2,)


def test_gguf_tokenizer_matches_transformers(smollm2):
    transformers = pytest.importorskip("transformers")
    from kiln.loader import embedded_gguf_path

    path = embedded_gguf_path()
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        assert smollm2.tokenizer.encode(text) == hf.encode(text), text
        assert smollm2.tokenizer.decode(smollm2.tokenizer.encode(text), skip_special_tokens=False) == text
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert smollm2.tokenizer.apply_chat_template(chat) == hf.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True)


def test_smollm_pretokenizer_splits_digits(smollm2):
    # llama.cpp's 'smollm' pre-tokenizer (and SmolLM2's own tokenizer.json) split every digit.
    ids = smollm2.tokenizer.encode("2024")
    assert len(ids) == 4 and smollm2.tokenizer.decode(ids) == "2024"


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, hf_smollm2):
    """SmolLM2 saved by transformers itself: sharded safetensors, config.json, tokenizer.json."""
    transformers = pytest.importorskip("transformers")
    from kiln.loader import embedded_gguf_path

    folder = tmp_path_factory.mktemp("smollm2-hf")
    # A model loaded from GGUF refuses to save itself, so copy it into a plain one first.
    config = copy.deepcopy(hf_smollm2.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.LlamaForCausalLM(config)
    plain.load_state_dict(hf_smollm2.state_dict())
    plain.save_pretrained(folder, max_shard_size="200MB")
    path = embedded_gguf_path()
    transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(folder)
    return folder


def test_hf_folder_is_sharded_and_loads(hf_folder, llm):
    assert len(list(hf_folder.glob("*.safetensors"))) > 1
    source = load_source(str(hf_folder))
    assert source.config.num_layers == 30 and source.config.tie_word_embeddings
    assert source.tokenizer.chat_template and source.tokenizer.eos_token_ids == (2,)
    from_folder = LLM(str(hf_folder), device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=16, temperature=0)
    chat = [{"role": "user", "content": "Name a large city in Japan."}]
    assert from_folder.chat(chat, params)[0].token_ids == llm.chat(chat, params)[0].token_ids


def test_random_preset_builds_without_tokenizer():
    source = load_source("tiny-llama")
    assert source.weights is None and source.config == PRESETS["tiny-llama"]
    tiny = LLM("tiny-llama", device="cpu")
    out = tiny.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    assert len(out[0].token_ids) == 3
    with pytest.raises(ValueError, match="has no tokenizer; pass token ids"):
        tiny.generate("text", SamplingParams())


def test_random_weights_are_deterministic():
    from kiln.models import build_model

    a = build_model(PRESETS["tiny-llama"], torch.float32, torch.device("cpu"), frozenset(), None)
    b = build_model(PRESETS["tiny-llama"], torch.float32, torch.device("cpu"), frozenset(), None)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_kiln_s_dequantization_gives_gguf_s_bits_for_every_tensor_of_the_embedded_model():
    import numpy as np
    from gguf import GGUFReader
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    from kiln.loader import embedded_gguf_path
    from kiln.loader.gguf_file import dequantized

    kinds = set()
    for t in GGUFReader(str(embedded_gguf_path())).tensors:
        kind = GGMLQuantizationType(t.tensor_type)
        want = np.asarray(dequantize(t.data, kind), dtype=np.float32).reshape(-1)
        got = dequantized(t.data, kind, dequantize).reshape(-1)
        assert np.array_equal(want.view(np.uint32), got.view(np.uint32)), t.name
        kinds.add(kind.name)
    assert {"Q4_1", "Q8_0"} <= kinds  # both torch paths ran
