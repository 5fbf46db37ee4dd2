"""Async scheduling (the GPU default), forced on the CPU: step n+1 is scheduled and packed
before step n's tokens are read, its pending input tokens come from the device, and stops
are seen one step late. The outputs must be exactly those of the synchronous engine."""

import time

import pytest

from kiln import LLM, SamplingParams
from kiln.config import EngineConfig

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at",
           "The quick brown fox", "Machine learning is", "Dear diary, today", "My favourite food is"]
# A small cache (preemption), short budget (chunked prefill) and few slots (admission while others decode).
SMALL = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=26, max_model_len=96,
             max_num_batched_tokens=16, max_num_seqs=5)


def mixed_params() -> list[SamplingParams]:
    """Greedy and sampled rows, seeded and not, top-k/top-p, stop strings and ids, EOS allowed."""
    return [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=20, temperature=0.8, seed=3),
            SamplingParams(max_tokens=17, temperature=0.9, top_k=20, seed=4),
            SamplingParams(max_tokens=30, temperature=0.7, top_p=0.8, seed=5),
            SamplingParams(max_tokens=24, temperature=0, stop=[" the"]),
            SamplingParams(max_tokens=3, temperature=0),
            SamplingParams(max_tokens=24, temperature=1.0, seed=6, stop=["\n"]),
            SamplingParams(max_tokens=40, temperature=0)]


@pytest.fixture(scope="module")
def engines():
    sync, overlapped = LLM("smollm2", async_scheduling=False, **SMALL), LLM("smollm2", async_scheduling=True, **SMALL)
    assert not sync.engine.async_scheduling and overlapped.engine.async_scheduling
    return sync, overlapped


def outputs(llm: LLM, params: list[SamplingParams]) -> list[tuple]:
    return [(o.token_ids, o.finish_reason, o.outputs[0].stop_reason, o.text) for o in llm.generate(PROMPTS, params)]


def test_same_outputs_as_synchronous_with_preemption_stops_and_seeds(engines):
    sync, overlapped = engines
    params = mixed_params()
    expected = outputs(sync, params)
    assert outputs(overlapped, params) == expected
    assert {reason for _, reason, _, _ in expected} == {"length", "stop"}
    for llm in engines:
        engine = llm.engine
        assert engine.scheduler.num_preemptions > 0
        assert engine.scheduler.block_manager.num_free_blocks == SMALL["num_kv_blocks"]
        assert not engine.has_unfinished() and not engine.seqs
        assert all(s.num_pending_tokens == 0 for s in engine.scheduler.running + list(engine.scheduler.waiting))


def test_tokens_come_one_step_later_and_a_known_last_token_is_not_computed_past(engines):
    _, overlapped = engines
    engine = overlapped.engine
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), "late")
    assert engine.step() == []  # the prefill is launched; its token is still on the device
    seq = engine.seqs["late"]
    assert seq.num_pending_tokens == 1 and seq.num_output_tokens == 0
    first = engine.step()  # the decode is launched from the device's token, then the prefill's is read
    assert [len(o.token_ids) for o in first] == [1] and seq.num_pending_tokens == 1
    computed = seq.num_computed_tokens
    last = engine.step()  # the token in flight is the second of two: nothing new is launched
    assert last[0].finished and len(last[0].token_ids) == 2
    assert seq.num_computed_tokens == computed and engine._in_flight is None
    assert not engine.has_unfinished()
    assert engine.scheduler.block_manager.num_free_blocks == SMALL["num_kv_blocks"]


def test_a_stop_seen_late_drops_the_extra_token(engines):
    sync, overlapped = engines
    free = sync.generate(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0))[0]
    params = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[free.token_ids[3]])
    out = overlapped.generate(PROMPTS[1], params)[0]
    assert out.token_ids == free.token_ids[:4] and out.finish_reason == "stop"
    assert not overlapped.engine.has_unfinished()


def test_abort_while_a_token_is_in_flight_leaks_nothing_and_leaves_the_others_alone(engines):
    sync, overlapped = engines
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in sync.generate(PROMPTS[:3], params)]
    engine = overlapped.engine
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(prompt, params, f"r{i}")
    done: dict[str, list[int]] = {}
    aborted_seen_after = []
    for _ in range(6):
        for out in engine.step():
            done[out.request_id] = out.token_ids
    victim = engine.seqs["r1"]
    assert victim.num_pending_tokens == 1
    engine.abort_request("r1")
    assert engine.has_unfinished()  # r0 and r2 run on
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out.token_ids
            aborted_seen_after.append(out.request_id == "r1")
    assert not any(aborted_seen_after)
    assert [done["r0"], done["r2"]] == [expected[0], expected[2]]
    assert victim.finish_reason == "abort"
    assert engine.scheduler.block_manager.num_free_blocks == SMALL["num_kv_blocks"]


def test_aborting_the_only_request_leaves_nothing_unfinished(engines):
    # The session engine test of the same name, with a step in flight at the abort.
    _, overlapped = engines
    engine = overlapped.engine
    engine.add_request(PROMPTS[1], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True), "only")
    engine.step()
    engine.step()
    assert engine._in_flight is not None
    engine.abort_request("only")
    assert not engine.has_unfinished()
    assert engine.scheduler.block_manager.num_free_blocks == SMALL["num_kv_blocks"]
    assert engine.step() == []


def test_each_step_duration_goes_to_the_batch_that_ran(engines, monkeypatch):
    # The time budget's cost model learns from (batch, seconds). On the CPU a step's work is its
    # launch (the forward runs there); on a GPU the device times it (LaunchedStep.device_seconds).
    # Neither is the wall time of the step() call, which also waits for the step before. Here the
    # second step's tokens take 1 s to read (charged to no step) and the fourth's launch 0.5 s.
    _, overlapped = engines
    engine = overlapped.engine
    engine.drain()  # a step an earlier test left in flight
    launched, observed = [], []
    real_launch = engine.runner._launch

    def launch(batch):
        if len(launched) == 3:
            time.sleep(0.5)
        step = real_launch(batch)
        launched.append(batch)
        if len(launched) == 2:
            read = step.results
            step.results = lambda: time.sleep(1.0) or read()
        return step

    monkeypatch.setattr(engine.runner, "_launch", launch)
    monkeypatch.setattr(engine.scheduler, "observe", lambda batch, seconds: observed.append((batch, seconds)))
    overlapped.generate(PROMPTS[:3], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(launched) >= 5 and [batch for batch, _ in observed] == launched
    seconds = [s for _, s in observed]
    assert seconds[3] >= 0.5 and max(seconds[:3] + seconds[4:]) < 0.5, seconds


def test_an_idle_engines_last_step_is_not_timed_through_the_idle_time(engines, monkeypatch):
    # A stop ends a request with its next step in flight; nothing reads it until the next request.
    _, overlapped = engines
    engine = overlapped.engine
    observed = []
    monkeypatch.setattr(engine.scheduler, "observe", lambda batch, seconds: observed.append(seconds))
    overlapped.generate("The capital of France is", SamplingParams(max_tokens=24, temperature=0, stop=["."]))
    assert engine._in_flight is not None  # the stop came with the next step launched
    time.sleep(1.0)
    overlapped.generate(PROMPTS[1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert observed and max(observed) < 1.0, observed


def test_defaults_and_refusal():
    assert not EngineConfig(device="cpu").uses_async_scheduling
    assert EngineConfig(device="cpu", async_scheduling=True).uses_async_scheduling
    with pytest.raises(ValueError, match="async_scheduling is not supported with tensor_parallel_size"):
        EngineConfig(device="cpu", async_scheduling=True, tensor_parallel_size=2)
