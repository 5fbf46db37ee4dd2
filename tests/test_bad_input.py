"""Bad input fails early, says what is wrong and how to fix it, and loses nothing."""

import pytest

from kiln import SamplingParams
from kiln.config import EngineConfig
from kiln.loader import load_source


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate("", SamplingParams(max_tokens=4))


def test_prompt_longer_than_context(llm):
    ids = [100] * llm.engine.max_model_len
    with pytest.raises(ValueError, match="max_model_len.*shorten the prompt"):
        llm.generate([ids], SamplingParams(max_tokens=4))


def test_bad_prompt_in_a_batch_queues_nothing(llm):
    with pytest.raises(ValueError):
        llm.generate(["fine prompt", ""], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()
    assert llm.generate("still serving", SamplingParams(max_tokens=2))[0].finished


def test_unknown_model_name():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'.*preset"):
        load_source("no-such-model")


def test_gguf_of_another_architecture(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        load_source(str(path))


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"max_tokens": -5}, "max_tokens must be an integer >= 1"),
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"top_p": 0.0}, "top_p must be in"),
    ({"top_k": -2}, "top_k must be 0 or -1"),
    ({"temperature": float("nan")}, "temperature must be >= 0 and finite"),
    ({"temperature": float("inf")}, "temperature must be >= 0 and finite"),
    ({"temperature": 1e-300}, "temperature must be 0 .greedy. or >= 1e-05"),
    ({"top_p": float("nan")}, "top_p must be in"),
    ({"max_tokens": True}, "max_tokens must be an integer"),
    ({"n": 0}, r"n must be an integer in \[1, 64\]"),
    ({"best_of": 3}, "best_of=3 is not supported by kiln yet"),
    ({"logprobs": 25}, r"logprobs must be an integer in \[0, 20\]"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
    ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
    ({"allowed_token_ids": [3, -1]}, "allowed_token_ids must be a non-empty list of token ids"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be an integer >= 1"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be an integer >= 1"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens must be true or false"),
    ({"detokenize": False, "stop": ["."]}, "detokenize=False leaves no text"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("spec", [["+rms_norm"], ["all", "none"], ["none", "+no_such_op"], ["none", "rms_norm"]])
def test_bad_custom_ops(spec):
    with pytest.raises(ValueError, match=r"custom_ops.*for example custom_ops=\[\"none\", \"\+rms_norm\"\]"):
        EngineConfig(custom_ops=spec)


def test_cache_too_small_for_context_fails_at_start():
    with pytest.raises(ValueError, match="fewer than max_model_len.*num_kv_blocks"):
        from kiln import LLM

        LLM("tiny-llama", device="cpu", num_kv_blocks=2, block_size=4, max_model_len=64)
