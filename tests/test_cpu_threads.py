"""The CPU engine's thread count: --cpu-threads wins, then OMP_NUM_THREADS, else the CPUs no
other process keeps busy, shared by the ranks; bad values fail at start-up."""

import logging

import pytest
import torch

from kiln.config import EngineConfig
from kiln.engine import cpu_threads


def test_an_explicit_count_wins():
    assert cpu_threads.choose_threads(3, ranks=2) == (3, "--cpu-threads")


def test_omp_num_threads_in_the_environment_is_respected(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cpu_threads.choose_threads(None) == (torch.get_num_threads(), "OMP_NUM_THREADS")


def test_busy_cpus_are_left_to_their_owners_and_the_rest_shared_by_the_ranks(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    samples = iter([{i: (100, 1000) for i in range(8)},
                    # CPUs 0 and 5 were busy 90% of the sample, the others 10%; CPU 9 is not ours.
                    {i: (100 + (90 if i in (0, 5, 9) else 10), 1100) for i in range(10)}])
    monkeypatch.setattr(cpu_threads, "_cpu_times", lambda: next(samples))
    monkeypatch.setattr(cpu_threads.time, "sleep", lambda s: None)
    threads, why = cpu_threads.choose_threads(None, ranks=2)
    assert threads == 3 and "8 CPUs" in why and "2 busy" in why and "2 ranks" in why


def test_every_cpu_busy_still_leaves_one_thread(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "busy_cpus", lambda cpus, seconds=0: len(cpus))
    assert cpu_threads.choose_threads(None, ranks=4)[0] == 1


def test_the_proc_stat_reader_sees_this_machines_cpus():
    times = cpu_threads._cpu_times()
    assert times and all(0 <= busy <= total for busy, total in times.values())


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_bad_count_fails_at_start_up(bad):
    with pytest.raises(ValueError, match="cpu_threads must be an integer >= 1"):
        EngineConfig(model="tiny-llama", device="cpu", cpu_threads=bad)


def test_an_engine_runs_with_the_count_it_was_given_and_says_why(caplog):
    from kiln import LLM, SamplingParams

    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="kiln"):
            llm = LLM("tiny-llama", device="cpu", dtype="float32", num_kv_blocks=64, cpu_threads=2)
        assert torch.get_num_threads() == 2
        assert any("CPU threads: 2 per process (--cpu-threads)" in r.message for r in caplog.records)
        assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids) == 2
        llm.shutdown()
    finally:
        torch.set_num_threads(before)
