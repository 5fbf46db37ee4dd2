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


def test_chat_template_options_match_transformers(smollm2):
    """add_generation_prompt, continue_final_message and template variables (vLLM's
    chat_template_kwargs) render as transformers renders them."""
    transformers = pytest.importorskip("transformers")
    from kiln.loader import embedded_gguf_path

    path = embedded_gguf_path()
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = smollm2.tokenizer
    chat = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "The answer is"}]
    for options in (dict(add_generation_prompt=False), dict(add_generation_prompt=False, continue_final_message=True)):
        assert ours.apply_chat_template(chat, **options) == hf.apply_chat_template(chat, tokenize=False, **options)
    trailing = chat[:1] + [{"role": "assistant", "content": "The answer is "}]  # the template keeps the space
    continued = ours.apply_chat_template(trailing, add_generation_prompt=False, continue_final_message=True)
    assert continued.endswith("The answer is ") and continued == hf.apply_chat_template(
        trailing, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ValueError, match="add_generation_prompt"):
        ours.apply_chat_template(chat, continue_final_message=True)

    template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if not enable_thinking %} /no_think{% endif %}"
    custom = copy.copy(ours)
    custom.chat_template, custom._template = template, None
    for kwargs in ({}, {"enable_thinking": True}):
        assert custom.apply_chat_template(chat[:1], template_kwargs=kwargs) == hf.apply_chat_template(
            chat[:1], chat_template=template, tokenize=False, add_generation_prompt=True, **kwargs)
    assert custom.apply_chat_template(chat[:1], template_kwargs={"enable_thinking": False}).endswith("/no_think")


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
        got = dequantized(t.data, int(t.tensor_type)).reshape(-1)
        assert np.array_equal(want.view(np.uint32), got.view(np.uint32)), t.name
        kinds.add(kind.name)
    assert {"Q4_1", "Q8_0"} <= kinds  # both torch paths ran


def _llama_gguf(path, rope_freqs=None, **metadata):
    """A tiny llama-architecture GGUF holding its config and the tensors given (no tokenizer)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(4096)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(256)
    for key, value in metadata.items():
        writer.add_string(key, value) if isinstance(value, str) else writer.add_float32(key, value)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_rope_freqs_give_llama31_rope(tmp_path):
    """Llama 3.1 GGUF files carry their rope scaling as rope_freqs, one divisor per frequency,
    computed by llama.cpp's converter from the llama3 settings (as below): kiln must give the
    frequencies that the llama3 settings give."""
    import math

    from kiln.loader.gguf_file import GGUFCheckpoint
    from kiln.ops.rotary import rope_inv_freq

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    base, dim = 500000.0, 16
    factors = []
    for freq in (1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))).tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4.0:
            factors.append(1.0)
        elif wavelen > 8192 / 1.0:
            factors.append(8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / 8.0 + smooth))
    cfg = GGUFCheckpoint(_llama_gguf(tmp_path / "l31.gguf", rope_freqs=factors)).config()
    assert cfg.rope_scaling["rope_type"] == "freq_factors"
    torch.testing.assert_close(rope_inv_freq(dim, cfg.rope_theta, cfg.rope_scaling), rope_inv_freq(dim, base, scaling),
                               rtol=1e-6, atol=0)
    assert not torch.allclose(rope_inv_freq(dim, base, None), rope_inv_freq(dim, base, scaling))


def test_gguf_rope_scaling_metadata(tmp_path):
    from kiln.loader.gguf_file import GGUFCheckpoint

    linear = GGUFCheckpoint(_llama_gguf(tmp_path / "linear.gguf", **{"llama.rope.scaling.type": "linear",
                                                                      "llama.rope.scaling.factor": 4.0})).config()
    assert linear.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    yarn = _llama_gguf(tmp_path / "yarn.gguf", **{"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0})
    with pytest.raises(ValueError, match="rope scaling 'yarn' is not supported"):
        GGUFCheckpoint(yarn).config()
