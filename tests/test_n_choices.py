"""n > 1 (vLLM's SamplingParams.n): one request, n sequences that share the prompt's KV blocks
(the later choices wait for the first's prompt and find it in the prefix cache), each with
its own seed stream (seed + index); greedy choices are identical."""

import pytest
import torch

from kiln import LLM, SamplingParams

ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=128, max_model_len=256,
              max_num_batched_tokens=32)
PROMPT = torch.randint(3, 500, (30,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", **ENGINE)


def test_greedy_choices_are_identical_and_equal_one_request(llm):
    single = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    out = llm.generate([PROMPT], SamplingParams(n=3, max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    assert all(c.token_ids == single.token_ids for c in out.outputs)


def test_each_choice_has_its_own_seed_stream(llm):
    params = dict(max_tokens=12, temperature=1.0, ignore_eos=True)
    out = llm.generate([PROMPT], SamplingParams(n=3, seed=5, **params))[0]
    # Choice i draws what a one-choice request seeded 5 + i draws, whatever runs beside it.
    alone = [llm.generate([PROMPT], SamplingParams(seed=5 + i, **params))[0].token_ids for i in range(3)]
    assert [c.token_ids for c in out.outputs] == alone
    assert len({tuple(t) for t in alone}) == 3


def test_the_choices_share_the_prompts_blocks_and_leak_none(llm):
    engine = llm.engine
    bm = engine.scheduler.block_manager
    hits = bm.stats.hits
    prompt = torch.randint(3, 500, (30,), generator=torch.Generator().manual_seed(9)).tolist()
    engine.add_request(prompt, SamplingParams(n=3, max_tokens=6, temperature=0.8, seed=1), "shared")
    group = engine.requests["shared"]
    tables = []
    while engine.has_unfinished():
        engine.step()
        if all(s.block_table for s in group) and not tables:
            tables = [list(s.block_table) for s in group]
    # 29 of the 30 prompt tokens can be shared: 7 full blocks, computed once.
    assert tables[1][:7] == tables[2][:7] == tables[0][:7]
    assert bm.stats.hits - hits == 2 * 7 * 4
    assert bm.num_free_blocks == ENGINE["num_kv_blocks"] and sum(bm.ref_counts) == 0
    assert not engine.requests and not engine.seqs


def test_abort_ends_every_choice(llm):
    engine = llm.engine
    engine.add_request(PROMPT, SamplingParams(n=2, max_tokens=50, ignore_eos=True), "gone")
    engine.step()
    engine.abort_request("gone")
    assert not engine.has_unfinished() and not engine.requests
    assert engine.scheduler.block_manager.num_free_blocks == ENGINE["num_kv_blocks"]


def test_without_prefix_caching_the_choices_run_side_by_side():
    plain = LLM("tiny-llama", enable_prefix_caching=False, **ENGINE)
    out = plain.generate([PROMPT], SamplingParams(n=2, max_tokens=8, seed=3, ignore_eos=True))[0]
    alone = [plain.generate([PROMPT], SamplingParams(max_tokens=8, seed=3 + i, ignore_eos=True))[0].token_ids
             for i in range(2)]
    assert [c.token_ids for c in out.outputs] == alone


def test_n_is_checked():
    with pytest.raises(ValueError, match=r"n must be an integer in \[1, 64\]"):
        SamplingParams(n=0)


def test_a_request_s_metrics_merge_its_choices_times():
    from kiln.engine.outputs import RequestMetrics

    a = {"arrival": 0.0, "scheduled": 1.0, "first_token": 3.0, "last_token": 7.0, "finished": 8.0}
    b = {"arrival": 0.0, "scheduled": 2.0, "first_token": 2.5, "last_token": 9.0}
    m = RequestMetrics.merged(0.0, [a, b])
    assert (m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time) == (1.0, 2.5, 9.0, None)
    b["finished"] = 9.5  # finished when every choice is
    assert RequestMetrics.merged(0.0, [a, b]).finished_time == 9.5
    assert RequestMetrics.merged(0.0, [{"arrival": 0.0}, {"arrival": 0.0}]).first_token_time is None
