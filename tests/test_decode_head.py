"""A decode step's logits and greedy tokens are computed with its forward (inside the full decode
CUDA graph on a GPU; right after the forward on the CPU, through the same code): a greedy decode
step computes the logits once and takes the head's tokens; penalties, logit_bias, structured
output and sampled rows still go through the sampler, on the head's logits. Outputs must be
exactly those of the engine without the head. In bf16 the head's logits stay bf16 (their fp32
cast is exact, and only a step that reads them pays it)."""

import pytest
import torch

from kiln import LLM, SamplingParams

SMALL = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=40, max_model_len=96,
             max_num_batched_tokens=32, max_num_seqs=4)
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at"]


@pytest.fixture(scope="module")
def engines():
    return LLM("smollm2", **SMALL), LLM("smollm2", **SMALL)


def _generate(llm: LLM, params) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _without_head(llm: LLM) -> LLM:
    llm.engine.runner.cudagraphs.head = None
    return llm


def _mixed_params():
    return [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
            SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3, presence_penalty=0.5,
                           ignore_eos=True),
            SamplingParams(max_tokens=12, temperature=0, logit_bias={13: 100.0}, min_tokens=4, logprobs=3)]


def test_outputs_equal_the_engine_without_the_head(engines):
    with_head, plain = engines
    plain = _without_head(plain)
    assert with_head.engine.runner.cudagraphs.head is not None
    _outputs_match(with_head, plain, _mixed_params())


def _outputs_match(with_head: LLM, plain: LLM, params) -> None:
    ours = with_head.generate(PROMPTS, params, use_tqdm=False)
    theirs = plain.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]
    assert ours[3].token_ids.count(13) >= 8  # the bias took effect: the sampler saw the head's logits
    for a, b in zip(ours[3].outputs[0].logprobs, theirs[3].outputs[0].logprobs):
        assert a.keys() == b.keys() and all(a[t].logprob == b[t].logprob for t in a)


def test_a_greedy_decode_step_computes_its_logits_once_in_the_head(engines, monkeypatch):
    llm, _ = engines
    model = llm.engine.runner.model
    calls = []
    real = model.compute_logits
    monkeypatch.setattr(model, "compute_logits",
                        lambda hidden, **kw: calls.append(hidden.shape[0]) or real(hidden, **kw))
    head_calls = []
    real_head = llm.engine.runner.cudagraphs.head
    monkeypatch.setattr(llm.engine.runner.cudagraphs, "head", lambda h: head_calls.append(1) or real_head(h))
    out = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    assert all(len(o.token_ids) == 6 for o in out)
    # One prefill step (logits of its 2 sampled rows), then 5 decode steps whose logits only the head computes.
    assert len(head_calls) == 5 and len(calls) == 1 + 5, (head_calls, calls)


def test_sampled_tokens_are_not_the_heads_buffer():
    """The head's outputs live in the graph's memory, which the next replay overwrites; a later
    step reads the tokens it sampled (its pending input ids, the penalties' history)."""
    import torch

    from kiln.engine.sampler import greedy_tokens, sample

    logits = torch.randn(3, 50)
    greedy = greedy_tokens(logits)
    tokens = sample(logits, [SamplingParams(temperature=0)] * 3, [None] * 3, greedy=greedy)
    assert torch.equal(tokens, greedy) and tokens.data_ptr() != greedy.data_ptr()


def test_bf16_head_logits_stay_bf16_and_every_output_is_the_fp32_paths(monkeypatch):
    """bf16: the head hands the sampler lm_head's bf16 output; greedy rows take its argmax, and
    sampled, penalised, biased and logprob rows read its fp32 cast: the same tokens and log
    probabilities as the engine without the head, whose logits are cast before anything reads them."""
    small = dict(SMALL, dtype="bfloat16")
    with_head, plain = LLM("smollm2", **small), _without_head(LLM("smollm2", **small))
    dtypes = []
    real_head = with_head.engine.runner.cudagraphs.head
    monkeypatch.setattr(with_head.engine.runner.cudagraphs, "head",
                        lambda h: (lambda out: dtypes.append(out[0].dtype) or out)(real_head(h)))
    _outputs_match(with_head, plain, _mixed_params())
    greedy = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * len(PROMPTS)
    assert _generate(with_head, greedy) == _generate(plain, greedy)
    assert dtypes and set(dtypes) == {torch.bfloat16}


def test_sample_casts_low_precision_logits_only_where_it_reads_them():
    from kiln.engine.sampler import greedy_tokens, sample

    torch.manual_seed(0)
    logits = torch.randn(4, 300).bfloat16()
    greedy = greedy_tokens(logits)
    assert torch.equal(greedy, greedy_tokens(logits.float()))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7),
              SamplingParams(temperature=0, logit_bias={5: 50.0}), SamplingParams(temperature=0.9, top_k=20)]
    for rows in ([0], [0, 1], [0, 2], [0, 1, 2, 3]):
        chosen = [params[i] for i in rows]
        low, full = (sample(x, chosen, [torch.Generator().manual_seed(i) for i in rows], greedy=greedy[rows])
                     for x in (logits[rows], logits[rows].float()))
        assert torch.equal(low, full), rows
