"""kiln against transformers on the same weights (fp32, CPU): SmolLM2 (Llama), and tiny random
Mistral, Qwen2, Qwen3 and Gemma 2 checkpoints saved with save_pretrained; what kiln cannot run is
refused."""

import pytest
import torch

from kiln import SamplingParams
from kiln.forward_context import set_forward_context

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for learning to program.",
    "Who wrote Pride and Prejudice, and when?",
    "Translate 'good morning' into Spanish and German.",
]


def test_logits_match_transformers(smollm2, llm, hf_smollm2):
    ids = smollm2.tokenizer.encode_chat([{"role": "user", "content": CHATS[0]}])
    model = llm.engine.runner.model
    with torch.inference_mode(), set_forward_context(None, {}):
        ours = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))
        theirs = hf_smollm2(torch.tensor([ids])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-3


def test_greedy_tokens_equal_transformers(smollm2, llm, hf_smollm2):
    prompts = [smollm2.tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    # ignore_eos: every prompt is compared over all 32 tokens, not just up to its stop.
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == _hf_greedy(hf_smollm2, ids, 32), smollm2.tokenizer.decode(ids)


@torch.inference_mode()
def _hf_greedy(model, ids: list[int], num_tokens: int) -> list[int]:
    """Greedy decoding with transformers' KV cache, through end-of-sequence tokens."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = []
    for _ in range(num_tokens):
        tokens.append(out.logits[0, -1].argmax().item())
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def _saved(tmp_path, config_class: str, model_class: str, **settings):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**TINY, **settings})
    model = getattr(transformers, model_class)(config).eval()
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("window, level", [(None, 0), (8, 0), (8, 2)])
def test_mistral_matches_transformers_past_its_window(tmp_path, window, level):
    from kiln import LLM

    hf = _saved(tmp_path, "MistralConfig", "MistralForCausalLM", sliding_window=window)
    # Blocks of 4 and chunks of 8: the window crosses blocks and prefill chunks.
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=8, compilation_config=level)
    assert llm.engine.runner.model.model.layers[0].self_attn.attn.window == (window or 0)
    prompt = torch.randint(3, 256, (17,), generator=torch.Generator().manual_seed(2)).tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == _hf_greedy(hf, prompt, 12)


def test_a_checkpoint_kiln_cannot_run_exactly_is_refused_naming_the_setting(tmp_path):
    from kiln import LLM

    for i, (config_class, model_class, settings, named) in enumerate([
            ("Qwen2Config", "Qwen2ForCausalLM", {"sliding_window": 8, "use_sliding_window": True,
                                                 "max_window_layers": 1}, "sliding_window=8"),
            ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True}, "attention_bias=true"),
            ("LlamaConfig", "LlamaForCausalLM", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
            ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                       "moe_intermediate_size": 32, "mlp_only_layers": [1]},
             "mlp_only_layers=\\[1\\]")]):
        folder = tmp_path / str(i)
        _saved(folder, config_class, model_class, **settings)
        with pytest.raises(ValueError, match=f"kiln cannot run this checkpoint exactly.*{named}"):
            LLM(str(folder), device="cpu")


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_matches(tmp_path, hf, level: int, moved, **engine):
    """Move the parameters `moved(name)` picks off their init (a family's own weights: biases, norms,
    routers), save, and compare kiln with transformers: logits within 1e-4 relative, greedy tokens
    equal. Returns kiln's engine and transformers' logits."""
    from kiln import LLM

    with torch.no_grad():
        for name, p in hf.named_parameters():
            if moved(name):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.5)
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=64, compilation_config=level, **engine)
    prompt = _prompt(19, seed=3)
    model = llm.engine.runner.model
    with torch.inference_mode(), set_forward_context(None, {}):
        ours = model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt))))
        theirs = hf(torch.tensor([prompt])).logits[0]
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-4
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == _hf_greedy(hf, prompt, 12)
    return llm, theirs


@pytest.mark.parametrize("config_class, model_class, settings", [
    ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}),
    ("Qwen3Config", "Qwen3ForCausalLM", {"use_sliding_window": False}),
])
@pytest.mark.parametrize("level", [0, 2])
def test_qwen_families_match_transformers(tmp_path, config_class, model_class, settings, level):
    hf = _saved(tmp_path, config_class, model_class, **settings)
    _assert_matches(tmp_path, hf, level, lambda name: name.endswith("bias") or "q_norm" in name or "k_norm" in name)


@pytest.mark.parametrize("level", [0, 2])
def test_gemma2_matches_transformers(tmp_path, level):
    """Alternating windows (8, then the whole context) over a longer prompt, the norms' 1 + w, the
    embedding scale, GELU-tanh, and both soft-caps set low enough to change the result."""
    hf = _saved(tmp_path, "Gemma2Config", "Gemma2ForCausalLM", sliding_window=8, query_pre_attn_scalar=1,
                attn_logit_softcapping=0.05, final_logit_softcapping=0.3, num_hidden_layers=3)
    # HF starts Gemma's norms at 0 (a scale of 1): moved. Blocks of 4 and chunks of 8 cross the window.
    llm, theirs = _assert_matches(tmp_path, hf, level, lambda name: "norm" in name, block_size=4,
                                  max_num_batched_tokens=8)
    assert [layer.self_attn.attn.window for layer in llm.engine.runner.model.model.layers] == [8, 0, 8]
    assert theirs.abs().max() < 0.3  # the final cap bites


@pytest.mark.parametrize("config_class, model_class, settings", [
    ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                               "norm_topk_prob": False}),
    ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                               "norm_topk_prob": True}),
])
@pytest.mark.parametrize("level", [0, 2])
def test_moe_families_match_transformers(tmp_path, config_class, model_class, settings, level):
    """Mixtral and Qwen3-MoE (with and without renormalised routing weights): kiln::fused_moe
    inside one capture, against transformers' expert loop. Routers moved, so routing varies."""
    hf = _saved(tmp_path, config_class, model_class, **settings)
    _assert_matches(tmp_path, hf, level, lambda name: name.endswith("gate.weight") or "q_norm" in name or "k_norm" in name)
