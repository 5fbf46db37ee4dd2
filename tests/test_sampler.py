"""The sampler's rules on hand-made logits."""

import pytest
import torch

from kiln.engine.sampler import sample
from kiln.engine.sampling_params import SamplingParams


def test_greedy_takes_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    assert sample(logits, [SamplingParams(temperature=0)] * 2, [None, None]).tolist() == [1, 0]


def test_top_k_and_top_p_restrict_the_choice():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for seed in range(50):
        gen = torch.Generator().manual_seed(seed)
        assert sample(logits, [SamplingParams(top_k=2)], [gen]).item() in (0, 1)
        gen = torch.Generator().manual_seed(seed)
        # top_p=0.7: 0.5 alone is short of it, 0.5+0.3 reaches it, so tokens 0 and 1 stay.
        assert sample(logits, [SamplingParams(top_p=0.7)], [gen]).item() in (0, 1)


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(4000, 1)
    tokens = sample(logits, [SamplingParams()] * 4000, [None] * 4000)
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04, rtol=0)


def test_seeded_rows_repeat():
    logits = torch.randn(3, 100)
    params = [SamplingParams(temperature=1.0, seed=5)] * 3
    a = sample(logits, params, [torch.Generator().manual_seed(5) for _ in range(3)])
    b = sample(logits, params, [torch.Generator().manual_seed(5) for _ in range(3)])
    assert a.tolist() == b.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_are_torchs_argmax(dtype):
    """The first index of a row's maximum, as argmax has it: ties, NaN, -inf rows, the last column."""
    from kiln.engine.sampler import greedy_tokens

    x = torch.randn(6, 5000).to(dtype)
    x[1] = 0.5
    x[2, [100, 4000]] = 100
    x[3, [7, 9]] = float("nan")
    x[4] = float("-inf")
    x[5, 4999] = 100
    assert torch.equal(greedy_tokens(x), x.argmax(dim=-1))
    assert greedy_tokens(x).tolist()[1:] == [0, 100, 7, 0, 4999]
