"""kiln's SmolLM2 against transformers' Llama on the same weights (fp32, CPU)."""

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
