"""The sampler's rules on hand-made logits."""

import pytest
import torch

from kiln.engine import sampler
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


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_top_k_past_the_vocabulary_keeps_every_token(top_p):
    """Even one past what fp32 holds (the API's fuzz sent 2**63 - 1: it indexed out of bounds)."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    for k in (301, 2**40, 2**63 - 1):
        params = [SamplingParams(top_k=k, top_p=top_p, seed=i) for i in range(4)]
        drawn = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(4)])
        every = sample(logits, [SamplingParams(top_p=top_p, seed=i) for i in range(4)],
                       [torch.Generator().manual_seed(i) for i in range(4)])
        assert drawn.tolist() == every.tolist()


def test_sampling_follows_the_distribution():
    """The CPU's draw (the GPU's Gumbel kernel: test_triton_kernels.py)."""
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


def _kept_by_the_book(logits, top_k, top_p, min_p):
    """The sampling rules written plainly over vocabulary ids, as probabilities (0: cut): min_p
    drops a token below min_p times the likeliest one's probability; top-k keeps ties with the
    k-th logit; top-p keeps a token while the tokens with larger logits hold less than top_p of
    what is left."""
    kept = logits.clone()
    full = logits.softmax(-1)
    kept[full < min_p * full.max()] = float("-inf")
    if top_k > 0:
        kept[kept < kept.sort(descending=True).values[top_k - 1]] = float("-inf")
    probs = kept.softmax(-1)
    if top_p < 1:
        values, which = kept.unique(return_inverse=True)  # ascending
        mass = torch.zeros(len(values)).scatter_add_(0, which, probs)
        larger = mass.flip(0).cumsum(0).flip(0) - mass  # held by the values above each
        probs[larger[which] >= top_p] = 0
    return probs


def _running_sum_by_the_book(probs, generator):
    running = probs.double().cumsum(-1)
    return int((running > torch.rand(1, dtype=torch.float64, generator=generator) * running[-1]).nonzero()[0])


@pytest.mark.parametrize("method", ["gumbel", "running sum"])
@pytest.mark.parametrize("coarse", [False, True])
def test_top_k_and_top_p_draw_what_the_rules_say_with_tied_logits(coarse, method, request):
    """bf16-rounded logits tie often (at the k-th one too), rounded ones in long runs. The CPU's
    running sum: every seeded draw equals the plain rules' draw from the same generator. The GPU's
    Gumbel-max (its Triton kernel, interpreted here): every draw is a token the rules keep. Both:
    a seeded row draws the same token alone or batched beside rows that change the batch's largest
    k or its way of cutting (a row without top-k sorts)."""
    if method == "gumbel":  # the GPU's draw, here on the CPU
        request.getfixturevalue("gpu_draw")
    torch.manual_seed(0)
    logits = (torch.randn(8, 3000) * 3).to(torch.bfloat16).float()
    if coarse:
        logits = (logits / 2).round()
    cases = [(50, 0.95, 0), (50, 1.0, 0), (0, 0.9, 0), (7, 0.5, 0.1), (1000, 0.99, 0.01), (1, 1.0, 0),
             (3, 0.95, 0), (600, 0.3, 0)]
    kept = [_kept_by_the_book(logits[i], k, p, m) for i, (k, p, m) in enumerate(cases)]
    for seed in range(5):
        params = [SamplingParams(top_k=k, top_p=p, min_p=m, seed=seed) for k, p, m in cases]
        alone = [sample(logits[i:i + 1], [params[i]], [torch.Generator().manual_seed(seed)]).item()
                 for i in range(len(cases))]
        if method == "running sum":
            assert alone == [_running_sum_by_the_book(kept[i], torch.Generator().manual_seed(seed))
                             for i in range(len(cases))]
        assert all(kept[i][t] > 0 for i, t in enumerate(alone))
        for rows in (range(8), [0, 1, 3, 4, 5, 6, 7]):  # with a row without top-k, and without one
            rows = list(rows)
            drawn = sample(logits[rows], [params[i] for i in rows], [torch.Generator().manual_seed(seed) for _ in rows])
            assert drawn.tolist() == [alone[i] for i in rows]


def test_the_graph_program_draws_what_the_sampler_draws(request):
    """sample_rows (what a decode step's sampling CUDA graph captures: every row's settings and
    seed in tensors, greedy rows and padding among them, topk at the GPU's fixed width) against
    sample() with the Gumbel draw (interpreted here) on the same tied logits: the same tokens, the
    same seeds consumed; greedy and padding rows take the argmax they are given."""
    request.getfixturevalue("gpu_draw")
    torch.manual_seed(1)
    logits = (torch.randn(10, 3000) * 3).to(torch.bfloat16).float()
    cases = [(50, 0.95, 0), (0, 1.0, 0), (0, 0.9, 0.05), (7, 0.5, 0.1), (1000, 0.99, 0.01), (1, 1.0, 0),
             (600, 0.3, 0)]
    params = [SamplingParams(top_k=k, top_p=p, min_p=m, temperature=0.5 + i / 10, seed=i)
              for i, (k, p, m) in enumerate(cases)]
    params.insert(2, SamplingParams(temperature=0.0, top_p=0.5, seed=99))  # greedy: cuts nothing
    n = len(params)  # rows n.. are padding
    for seed in range(3):
        gens = [[torch.Generator().manual_seed(seed * 100 + i) for i in range(n)] for _ in range(2)]
        eager = sample(logits[:n], params, gens[0])
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        seeds = torch.zeros(10, dtype=torch.long)
        seeds[sampled] = torch.tensor(sampler.seeds_of([gens[1][i] for i in sampled]))
        settings = sampler.settings_of(params + [SamplingParams(temperature=0.0)] * (10 - n))
        greedy = sampler.greedy_tokens(logits)
        cuts = sampler.Cuts.of(params, torch.device("cuda"))
        assert cuts.picks == 0 and cuts.sort  # a row with top-p and no top-k
        in_graph = sampler.sample_rows(logits, greedy, settings, seeds, cuts)
        assert in_graph[:n].tolist() == eager.tolist()
        assert in_graph[n:].tolist() == greedy[n:].tolist()
        assert [g.initial_seed() for g in gens[0]] == [g.initial_seed() for g in gens[1]]
        assert [int(torch.randint(9, (1,), generator=g)) for g in gens[0]] == \
            [int(torch.randint(9, (1,), generator=g)) for g in gens[1]]
    without_sort = [p for p in params if p.top_k > 0 or p.top_p == 1]
    assert sampler.Cuts.of(without_sort, torch.device("cuda")).picks == sampler.TOP_K_SELECT_MAX
    assert sampler.Cuts.of(without_sort, torch.device("cpu")).picks == 1000


def test_the_cpu_draws_a_top_k_or_top_p_batch_from_its_picks_as_from_whole_rows(monkeypatch):
    """draw_from_picks (a CPU batch whose every row has a top-k or a top-p) gives the whole-row
    draw's tokens, seeded or not, on fp32, bf16-rounded and coarsely tied logits, with top-k on
    every row, on some, or on none; a row whose ties with its k-th, or whose top-p, reach past the
    picks, or that holds inf, is drawn over its whole row, beside rows drawn from their picks."""
    whole_rows = []  # per draw_from_picks call: how many of its rows it drew over their whole rows
    picks, over_whole_rows = sampler.draw_from_picks, sampler._draw_whole_rows

    def counted(x, threshold, u):
        whole_rows[-1] += x.shape[0]
        return over_whole_rows(x, threshold, u)

    def recorded(*args):
        whole_rows.append(0)
        with monkeypatch.context() as m:
            m.setattr(sampler, "_draw_whole_rows", counted)
            return picks(*args)

    monkeypatch.setattr(sampler, "draw_from_picks", recorded)
    gen = torch.Generator().manual_seed(3)
    for trial in range(24):
        logits = torch.randn(8, 3000, generator=gen) * 3
        if trial % 3:
            logits = logits.to(torch.bfloat16).float()
        if trial % 3 == 2:
            logits = (logits / 2).round()
        # Every row a top-k; some rows top-p alone; every row top-p alone (a model's peaked rows
        # at low temperature, whose top-p fits the picks, and flatter ones, whose does not).
        with_k = (lambda i: True, lambda i: i % 3 != 1, lambda i: False)[trial // 8]
        params = [SamplingParams(top_k=int(torch.randint(1, 300, (1,), generator=gen)) if with_k(i) else 0,
                                 top_p=(0.9, 0.5, 0.95)[i % 3] if not with_k(i) else (1.0, 0.9, 0.5)[i % 3],
                                 min_p=(0.0, 0.05)[i % 2], seed=i if i % 2 else None,
                                 temperature=(0.1 if trial % 2 else 0.6) + float(torch.rand(1, generator=gen)))
                  for i in range(8)]
        seeds = [trial * 10 + i for i in range(8)]
        torch.manual_seed(trial)
        fast = sample(logits, params, [torch.Generator().manual_seed(s) for s in seeds])
        with monkeypatch.context() as m:
            m.setattr(sampler, "draw_from_picks", lambda *a: None)
            torch.manual_seed(trial)
            whole = sample(logits, params, [torch.Generator().manual_seed(s) for s in seeds])
        assert fast.tolist() == whole.tolist()
    assert whole_rows[:8].count(0) >= 6 and whole_rows[8:].count(0) >= 4  # both kinds drew from picks alone
    assert sum(0 < n < 8 for n in whole_rows) >= 4  # and batches mixed picks with whole rows
    logits = torch.full((2, 3000), -1.0)
    logits[:, :10] = torch.arange(11.0, 1.0, -1.0)
    logits[0, 10:700] = 1.0  # the 20th logit is one of 690 equal ones: past the picks
    logits[1, 5] = float("inf")
    # A top-k past the vocabulary ranks every logit.
    assert sample(logits[:1], [SamplingParams(top_k=5000)], [None]).item() in range(3000)
    for row in range(2):
        whole_rows.clear()
        token = sample(logits[row:row + 1], [SamplingParams(top_k=20)], [torch.Generator().manual_seed(1)]).item()
        assert whole_rows == [1]
        assert token in (range(700) if row == 0 else [5])


def test_the_fixed_topk_width_cuts_where_the_batchs_largest_k_does():
    """The GPU ranks TOP_K_SELECT_MAX logits whatever the batch's k (one program for every batch),
    the CPU the batch's largest k: the same thresholds, ties at the k-th and at the top-p edge too."""
    torch.manual_seed(2)
    logits = ((torch.randn(6, 5000) * 3).to(torch.bfloat16).float() / 2).round()
    params = [SamplingParams(top_k=k, top_p=p, min_p=m) for k, p, m in
              ((5, 1.0, 0), (50, 0.9, 0), (300, 0.99, 0.02), (1, 0.5, 0), (1024, 0.95, 0), (2, 1.0, 0.5))]
    for extra in ([], [SamplingParams(top_k=2000)], [SamplingParams()]):  # past the width: the GPU sorts
        rows = params + extra
        _, min_p, top_p, top_k, _ = sampler.settings_of(rows).unsqueeze(-1)
        gpu, cpu = (sampler.Cuts.of(rows, torch.device(d)) for d in ("cuda", "cpu"))
        assert (gpu.sort, gpu.picks, cpu.picks) == ((True, 0, 2000) if extra and extra[0].top_k else
                                                     (False, sampler.TOP_K_SELECT_MAX, 1024))
        x = logits[: len(rows)] if len(rows) <= 6 else torch.cat([logits, logits[:1] - 1])
        assert torch.equal(sampler.cut_threshold(x, gpu, None, min_p, top_k, top_p),
                           sampler.cut_threshold(x, cpu, None, min_p, top_k, top_p))
        # Ranked unscaled and divided after: the thresholds of the scaled rows, bit for bit.
        temperature = torch.linspace(0.3, 1.7, len(rows)).unsqueeze(-1)
        for cuts in (gpu, cpu):
            assert torch.equal(sampler.cut_threshold(x, cuts, temperature, min_p, top_k, top_p),
                               sampler.cut_threshold(x / temperature, cuts, None, min_p, top_k, top_p))


@pytest.mark.parametrize("top_p", [1.0, 0.999])
def test_top_k_keeps_the_logits_tied_with_the_kth(top_p):
    logits = torch.full((1, 50), -10.0)
    logits[0, :4] = torch.tensor([3.0, 2.0, 2.0, 2.0])
    drawn = {sample(logits, [SamplingParams(top_k=2, top_p=top_p)], [torch.Generator().manual_seed(s)]).item()
             for s in range(200)}
    assert drawn == {0, 1, 2, 3}


@pytest.mark.parametrize("u", [0.0, 1.0 - 2**-53])
def test_the_running_sum_never_draws_a_token_without_a_share(u, monkeypatch):
    """At u = 0 a left search would take the zero-share token at the front; u just below 1 takes
    the last token with a share, not the zero-share one after it."""
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.full(a[:2] if len(a) > 1 else a, u, dtype=torch.float64))
    probs = torch.tensor([[0.0, 0.0, 0.5, 0.0, 0.3, 0.7, 0.0]])
    assert sampler._inverse_cdf(probs, sampler._uniforms([None])).item() == (2 if u == 0 else 5)


@pytest.mark.parametrize("method", ["gumbel", "running sum"])
@pytest.mark.parametrize("cuts", [{}, {"min_p": 0.1}, {"top_p": 0.5}, {"top_k": 3, "min_p": 0.2, "top_p": 0.9}])
def test_rows_without_probabilities_take_their_argmax(method, cuts, request):
    """A row of -inf (a grammar allowing only a token min_tokens masks), or one holding inf or NaN
    (a broken model), draws its argmax on both devices rather than an arbitrary token, with or
    without cuts of its own, and beside a row whose cuts the batch's program runs (min_p's and
    top-p's arithmetic on inf gives NaN thresholds, which kept nothing on the GPU: column 0)."""
    if method == "gumbel":
        request.getfixturevalue("gpu_draw")
    x = torch.zeros(4, 10)
    x[0] = float("-inf")
    x[1, 2] = float("inf")
    x[2, 4] = float("nan")
    x[3] = torch.linspace(-1, 1, 10)
    for params in ([SamplingParams(**cuts)] * 4, [SamplingParams()] * 3 + [SamplingParams(**cuts)]):
        assert sample(x, params, [None] * 4).tolist()[:3] == [0, 2, 4]


def test_gumbel_draws_past_the_kernels_row_limit(monkeypatch):
    """A batch larger than the Triton launch's row counters is drawn in slices, not refused."""
    from kiln.ops.triton import argmax

    monkeypatch.setattr(argmax, "MAX_ROWS", 4)
    x = torch.full((10, 20), float("-inf"))
    x[torch.arange(10), torch.arange(10)] = 0.0  # row i keeps only column i
    drawn = argmax.gumbel_argmax(x, torch.full((10,), -1.0), torch.arange(10))
    assert drawn.tolist() == list(range(10))


def test_a_zero_uniform_does_not_lose_the_only_kept_token(monkeypatch, gpu_draw):
    """Philox can give u = 0 exactly (noise -inf): the row's only kept token must still win."""
    import triton.language as tl

    rand = tl.rand
    monkeypatch.setattr(tl, "rand", lambda seed, offsets: tl.where(offsets == 7, 0.0, rand(seed, offsets)))
    x = torch.full((1, 20), float("-inf"))
    x[0, 7] = 2.0
    assert sample(x, [SamplingParams()], [None]).item() == 7


def test_the_memory_profiles_cuts_are_the_largest_program():
    """What the GPU's KV-cache profile runs: every cut on, whole rows sorted (the largest
    temporaries), the thresholds those settings give."""
    x = torch.randn(3, 2000)
    params = [SamplingParams(min_p=0.01, top_k=sampler.TOP_K_SELECT_MAX + 1, top_p=0.9)] * 3
    cuts = sampler.Cuts.of(params, torch.device("cuda"))
    assert cuts == sampler.Cuts(min_p=True, top_k=True, top_p=True, sort=True, picks=0)
    _, min_p, top_p, top_k, _ = sampler.settings_of(params).unsqueeze(-1)
    assert torch.equal(sampler.largest_cuts(x), sampler.cut_threshold(x, cuts, None, min_p, top_k, top_p))
    assert sampler.largest_cuts(x).isfinite().all()


def test_allowed_token_ids_keep_only_their_logits():
    """A row with allowed_token_ids keeps those logits as they were and every other token at -inf;
    a row without is untouched, and so is the input."""
    from kiln.engine.sampler import apply_controls

    logits = torch.randn(3, 50)
    before = logits.clone()
    params = [SamplingParams(allowed_token_ids=[49, 3, 7]), SamplingParams(), SamplingParams(allowed_token_ids=[0])]
    out = apply_controls(logits, params, None, None)
    want = torch.full_like(logits, float("-inf"))
    want[0, [3, 7, 49]] = logits[0, [3, 7, 49]]
    want[1] = logits[1]
    want[2, 0] = logits[2, 0]
    assert torch.equal(out, want) and torch.equal(logits, before)
