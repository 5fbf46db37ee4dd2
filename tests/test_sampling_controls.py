"""Log probabilities, penalties, logit_bias, min_p and min_tokens with vLLM's semantics, checked
against the eager model's own logits step by step (tiny-llama, fp32), with the synchronous
engine and with async scheduling (where a row's newest token is still on the device)."""

import math

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.engine.sampler import sample
from kiln.forward_context import set_forward_context

ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=128, max_model_len=256,
              max_num_batched_tokens=16)
PROMPT = [1, 5, 9, 33, 100, 7, 8, 2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]


@pytest.fixture(scope="module")
def engines():
    return {mode: LLM("tiny-llama", async_scheduling=mode, **ENGINE) for mode in (False, True)}


def log_softmax_rows(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The eager model's log probabilities at every position of `ids`, in one forward."""
    model = llm.engine.runner.model
    with torch.inference_mode(), set_forward_context(None, {}):
        hidden = model(torch.tensor(ids), torch.arange(len(ids)))
        return model.compute_logits(hidden).log_softmax(dim=-1)


def reference_greedy(llm: LLM, prompt: list[int], p: SamplingParams, stop_ids: set[int]) -> list[int]:
    """vLLM's order: logit_bias, min_tokens' mask, repetition, frequency and presence penalties, argmax."""
    out, model = [], llm.engine.runner.model
    for _ in range(p.max_tokens):
        ids = prompt + out
        with torch.inference_mode(), set_forward_context(None, {}):
            logits = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))[-1]
        logits = logits.clone()  # a normal tensor, to edit
        for token, bias in p.logit_bias.items():
            logits[token] += bias
        if len(out) < p.min_tokens:
            for token in stop_ids:
                logits[token] = -math.inf
        seen = set(prompt) | set(out)
        for token in seen:
            value = logits[token]
            logits[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        for token in set(out):
            logits[token] -= p.frequency_penalty * out.count(token) + p.presence_penalty
        out.append(int(logits.argmax()))
        if out[-1] in stop_ids and len(out) >= p.min_tokens:
            break
    return out


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_bias_and_min_tokens_follow_vllms_rules(engines, async_scheduling):
    llm = engines[async_scheduling]
    p = SamplingParams(max_tokens=14, temperature=0, repetition_penalty=1.3, frequency_penalty=0.4,
                       presence_penalty=0.2, logit_bias={7: 3.0, 40: -2.0}, ignore_eos=True)
    assert llm.generate([PROMPT], p)[0].token_ids == reference_greedy(llm, PROMPT, p, set())
    # min_tokens: the token greedy picks first is a stop token, masked until 4 are out.
    first = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    p = SamplingParams(max_tokens=10, temperature=0, min_tokens=4, stop_token_ids=[first], ignore_eos=True)
    got = llm.generate([PROMPT], p)[0]
    assert got.token_ids == reference_greedy(llm, PROMPT, p, {first})
    assert len(got.token_ids) >= 4 and first not in got.token_ids[:4]


def test_logprobs_are_the_models_log_softmax_for_chosen_and_top_tokens(engines):
    llm = engines[False]
    p = SamplingParams(max_tokens=6, temperature=0.9, seed=7, logprobs=3, prompt_logprobs=2, ignore_eos=True,
                       repetition_penalty=1.2)
    out = llm.generate([PROMPT], p)[0]
    tokens, completion = out.token_ids, out.outputs[0]
    reference = log_softmax_rows(llm, PROMPT + tokens)
    assert len(completion.logprobs) == len(tokens)
    for step, (token, entry) in enumerate(zip(tokens, completion.logprobs)):
        row = reference[len(PROMPT) - 1 + step]
        # Before the penalty and the temperature: the model's own distribution.
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(3).indices.tolist()
        assert set(entry) == set(top) | {token} and all(entry[t].rank == r for r, t in enumerate(top, 1))
    assert completion.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(tokens, completion.logprobs)))
    # Prompt tokens (computed in chunks of 16): None for the first, then each token given those before.
    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    for position, entry in enumerate(out.prompt_logprobs[1:], 1):
        token = PROMPT[position]
        assert abs(entry[token].logprob - reference[position - 1][token].item()) < 1e-4
        assert len(entry) <= 3


def test_prompt_logprobs_are_computed_even_when_the_prefix_is_cached(engines):
    llm = engines[False]
    llm.generate([PROMPT], SamplingParams(max_tokens=2))  # caches the prompt's blocks
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert len(out.prompt_logprobs) == len(PROMPT) and all(len(e) == 1 for e in out.prompt_logprobs[1:])


def test_logprobs_on_the_embedded_model_carry_decoded_tokens():
    llm = LLM("smollm2", device="cpu", dtype="float32")
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=3, temperature=0, logprobs=2))[0]
    first = out.outputs[0].logprobs[0]
    assert first[out.token_ids[0]].rank == 1 and first[out.token_ids[0]].decoded_token == " Paris"


def test_min_p_drops_the_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for seed in range(60):
        token = sample(logits, [SamplingParams(min_p=0.35)], [torch.Generator().manual_seed(seed)]).item()
        assert token in (0, 1)  # 0.15 and 0.05 are below 0.35 * 0.5


@pytest.mark.parametrize("field, value, message", [
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", float("nan"), "frequency_penalty must be in [-2, 2]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be in (0, 2]"),
    ("min_p", 1.5, "min_p must be in [0, 1]"),
    ("min_tokens", 20, "min_tokens must be an integer in [0, max_tokens]"),
    ("logprobs", 21, "logprobs must be an integer in [0, 20]"),
    ("prompt_logprobs", -1, "prompt_logprobs must be an integer in [0, 20]"),
    ("logit_bias", {"7": 101}, "logit_bias must map token ids to numbers in [-100, 100]"),
])
def test_bad_values_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        SamplingParams(max_tokens=16, **{field: value})


def test_a_logit_bias_outside_the_vocabulary_is_refused(engines):
    with pytest.raises(ValueError, match=r"logit_bias token ids must lie in \[0, 512\)"):
        engines[False].engine.add_request(PROMPT, SamplingParams(logit_bias={512: 1.0}))
    assert SamplingParams(logit_bias={"7": 2}).logit_bias == {7: 2.0}  # OpenAI's string keys


def test_penalties_on_fixed_logits_match_the_formula():
    from kiln.engine.sampler import RowHistory, apply_controls

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, logit_bias={5: 1.5},
                       min_tokens=4, stop_token_ids=[4])
    history = [RowHistory(prompt=[0, 1], output=[3, 3, 2], pending=None, stop_ids=frozenset({4}))]
    got = apply_controls(logits, [p], history, None)[0].tolist()
    # bias on 5; 4 masked (3 outputs < min_tokens 4); seen tokens 0, 1, 2, 3 divided / multiplied by 2;
    # output counts 3: 2, 2: 1 -> minus 0.5 * count and 0.25 once.
    want = [2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.5 - 0.25, 3.0 / 2 - 1.0 - 0.25, -math.inf, 1.0 + 1.5]
    assert got == pytest.approx(want)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]]))  # the input is untouched


def test_logprobs_equal_hf_transformers_on_smollm2(hf_smollm2):
    llm = LLM("smollm2", device="cpu", dtype="float32")
    prompt = llm.get_tokenizer().encode("The capital of France is")
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, logprobs=5, prompt_logprobs=5))[0]
    with torch.no_grad():
        reference = hf_smollm2(torch.tensor([prompt + out.token_ids])).logits[0].float().log_softmax(dim=-1)
    for step, (token, entry) in enumerate(zip(out.token_ids, out.outputs[0].logprobs)):
        assert abs(entry[token].logprob - reference[len(prompt) - 1 + step][token].item()) < 1e-4
    for position, entry in enumerate(out.prompt_logprobs[1:], 1):
        assert abs(entry[prompt[position]].logprob - reference[position - 1][prompt[position]].item()) < 1e-4


def test_bad_words_mask_a_words_last_token_after_the_rest():
    """_ban_words on hand-made histories: the last token of a word is banned where the output ends
    with the rest of it, the newest token (pending on the device) compared there."""
    from kiln.engine.sampler import RowHistory, apply_controls

    def banned(output, words=((5, 7),), pending=None):
        history = RowHistory([1], list(output), None if pending is None else 0, frozenset(), tuple(words))
        in_flight = None if pending is None else torch.tensor([pending])
        out = apply_controls(torch.zeros(1, 10), [SamplingParams(temperature=0, bad_words=["x"])], [history],
                             in_flight)
        return set((out[0] == -math.inf).nonzero().flatten().tolist())

    assert banned([], words=((4,),)) == {4} and banned([3]) == set() and banned([5]) == {7}
    assert banned([3], pending=5) == {7} and banned([5], pending=6) == set()
    three = ((3, 5, 7),)
    assert banned([2, 3], three, pending=5) == {7} and banned([2, 4], three, pending=5) == set()
    assert banned([], three, pending=5) == set() and banned([3, 5], three) == {7}
    two = ((5, 7), (6, 7))  # one banned token after either of two pending ones
    assert banned([1], two, pending=6) == {7} and banned([1], two, pending=5) == {7}
    assert banned([1], two, pending=4) == set()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_bad_words_follow_vllms_rule_in_the_engine(async_scheduling):
    """Greedy with bad_words equals the model's own greedy with the words' last tokens masked where
    the output ends with the rest (SmolLM2, fp32; async: the newest token still on the device)."""
    from kiln.engine.llm_engine import bad_word_ids

    llm = LLM("smollm2", device="cpu", dtype="float32", async_scheduling=async_scheduling, max_model_len=256)
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    words = ["Paris", "capital of"]
    banned_ids = bad_word_ids(tokenizer, words)
    assert any(len(w) > 1 for w in banned_ids)
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0].token_ids
    got = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, bad_words=words))[0].token_ids
    model, out = llm.engine.runner.model, []
    while len(out) < 12:
        ids = prompt + out
        with torch.inference_mode(), set_forward_context(None, {}):
            logits = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))[-1]
        logits = logits.clone()  # a normal tensor, to edit
        for word in banned_ids:
            if len(out) >= len(word) - 1 and tuple(out[len(out) - len(word) + 1:]) == word[:-1]:
                logits[word[-1]] = -math.inf
        out.append(int(logits.argmax()))
        if out[-1] in llm.engine.eos_token_ids:
            break
    assert got == out and got != free
    assert not any(tuple(got[i:i + len(w)]) == w for w in banned_ids for i in range(len(got)))
