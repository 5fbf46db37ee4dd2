"""AsyncEngine in-process, on the tiny random Llama: the engine thread, aborts, shutdown."""

import asyncio
import gc

import pytest

from kiln import SamplingParams
from kiln.config import EngineConfig
from kiln.engine.async_engine import AsyncEngine, EngineNotReady, RequestAborted

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _config(**kwargs):
    return EngineConfig(model="tiny-llama", device="cpu", dtype="float32", **kwargs)


async def _started(config) -> AsyncEngine:
    engine = AsyncEngine(config)
    engine.start()
    while not engine.ready:
        assert engine.failure is None
        await asyncio.sleep(0.01)
    return engine


async def _tokens(engine, prompt, params=GREEDY):
    outputs = await engine.add_request(prompt, params)
    return [out async for out in outputs][-1].token_ids


def test_concurrent_requests_equal_the_offline_engine():
    from kiln import LLM

    alone = [o.token_ids for o in LLM("tiny-llama", device="cpu", dtype="float32").generate(PROMPTS, GREEDY)]

    async def main():
        engine = await _started(_config())
        together = await asyncio.gather(*(_tokens(engine, p) for p in PROMPTS))
        await engine.shutdown()
        return together

    assert asyncio.run(main()) == alone


def test_a_steps_outputs_wake_the_event_loop_once():
    """Every request's output of a step reaches its queue through one call_soon_threadsafe (a
    write to the loop's self-pipe under the GIL), not one per request."""
    async def main():
        engine = await _started(_config())
        loop, calls = asyncio.get_running_loop(), []
        real = loop.call_soon_threadsafe

        def counting(fn, *args):
            calls.append(fn)
            return real(fn, *args)

        loop.call_soon_threadsafe = counting
        together = await asyncio.gather(*(_tokens(engine, p) for p in PROMPTS))
        await engine.shutdown()
        return together, calls

    together, calls = asyncio.run(main())
    assert [len(t) for t in together] == [GREEDY.max_tokens] * len(PROMPTS)
    delivered = [fn for fn in calls if getattr(fn, "__name__", "") == "_deliver"]
    # At least one step per output token; far fewer than one call per request and token.
    assert GREEDY.max_tokens <= len(delivered) < len(PROMPTS) * GREEDY.max_tokens
    assert len(calls) - len(delivered) <= 2 * len(PROMPTS)  # the acceptances, and shutdown's


def test_leaving_early_aborts_and_frees_blocks():
    async def main():
        engine = await _started(_config())
        outputs = await engine.add_request([1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True))
        async for out in outputs:
            if len(out.token_ids) == 3:
                break
        await outputs.aclose()
        for _ in range(200):
            if engine.stats.kv_blocks_in_use == 0 and engine.stats.num_running == 0:
                break
            await asyncio.sleep(0.01)
        stats = engine.stats
        await engine.shutdown()
        return stats

    stats = asyncio.run(main())
    assert stats.kv_blocks_in_use == 0 and stats.num_running == 0 and stats.kv_blocks_total > 0


def test_refused_prompt_raises_and_the_engine_keeps_serving():
    async def main():
        engine = await _started(_config(max_model_len=64))
        with pytest.raises(ValueError, match="shorten the prompt"):
            await engine.add_request([1] * 64, GREEDY)
        tokens = await _tokens(engine, [1, 2, 3])
        await engine.shutdown()
        return tokens

    assert len(asyncio.run(main())) == GREEDY.max_tokens


def test_shutdown_aborts_what_runs_and_refuses_new_requests():
    async def main():
        engine = await _started(_config())
        outputs = await engine.add_request([1, 2, 3], SamplingParams(max_tokens=900, ignore_eos=True))
        await outputs.__anext__()
        await engine.shutdown(timeout_s=0)
        with pytest.raises(RequestAborted, match="shut down"):
            async for _ in outputs:
                pass
        with pytest.raises(EngineNotReady, match="shutting down"):
            await engine.add_request([1, 2], GREEDY)
        return engine.stats

    assert asyncio.run(main()).kv_blocks_in_use == 0


def test_start_up_failure_is_reported():
    async def main():
        engine = AsyncEngine(EngineConfig(model="no-such-model"))
        failures = []
        engine.start(failures.append)
        while engine.failure is None:
            await asyncio.sleep(0.01)
        with pytest.raises(EngineNotReady, match="engine failed.*unknown model"):
            await engine.add_request([1], GREEDY)
        return failures

    assert "unknown model" in str(asyncio.run(main())[0])


def test_the_shutdown_deadline_runs_from_stop_not_from_the_end_of_the_step(monkeypatch):
    """stop() arrives mid-step: the deadline counts from then, so once the running step ends
    past it no further step starts (before, the timeout began only after that step)."""
    import time

    from kiln.engine.llm_engine import LLMEngine

    real_step, starts = LLMEngine.step, []

    def slow_step(self):
        starts.append(time.monotonic())
        time.sleep(1.0)
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", slow_step)

    async def main():
        engine = await _started(_config())
        outputs = await engine.add_request([1, 2, 3], SamplingParams(max_tokens=1000, ignore_eos=True))
        while not starts:
            await asyncio.sleep(0.01)
        stopped = time.monotonic()
        engine.stop(0.3)  # well inside the 1 s step that is running
        with pytest.raises(RequestAborted, match="shut down"):
            async for _ in outputs:
                pass
        await engine.shutdown()
        return stopped

    stopped = asyncio.run(main())
    assert [t for t in starts if t > stopped] == [], "a step started after the deadline had passed"


def test_an_engine_that_stopped_serving_leaves_the_heap_thawed():
    """Frozen while it serves; a process that goes on once it stopped (tests, an application that
    embeds the app) gets the engine's memory back at the next collection."""
    async def main():
        engine = await _started(_config())
        assert gc.get_freeze_count() > 0
        await engine.shutdown()
        return engine

    stopped = asyncio.run(main())  # still referenced: its engine's own finalizer cannot be what thawed
    assert stopped.engine is not None and gc.get_freeze_count() == 0



def test_an_idle_engine_captures_the_graphs_left_for_first_use_one_at_a_time(monkeypatch):
    """Between requests the engine thread captures the CUDA graphs a start left for first use
    (ForwardCudagraphs.capture_next; on the CPU there are none, so a stand-in counts them),
    looking for new requests after each, and the requests are served as before."""
    from kiln import LLM
    from kiln.engine.runner import ModelRunner

    alone = LLM("tiny-llama", device="cpu", dtype="float32").generate(PROMPTS[:1], GREEDY)[0].token_ids
    left = [3]

    def capture_next_graph(runner):
        left[0] -= 1
        return left[0] >= 0

    monkeypatch.setattr(ModelRunner, "capture_next_graph", capture_next_graph)

    async def main():
        engine = await _started(_config())
        tokens = await _tokens(engine, PROMPTS[0])
        await engine.shutdown()
        return tokens

    assert asyncio.run(main()) == alone
    assert left[0] < 0  # all three taken, and the engine asked again


def test_no_deferred_capture_while_a_request_is_unfinished(monkeypatch):
    from kiln import LLM
    from kiln.engine.runner import ModelRunner

    asked = []
    monkeypatch.setattr(ModelRunner, "capture_next_graph", lambda runner: asked.append(1) or True)
    engine = LLM("tiny-llama", device="cpu", dtype="float32").engine
    engine.add_request(PROMPTS[0], GREEDY)
    assert not engine.capture_deferred_graph() and asked == []
    while engine.has_unfinished():
        engine.step()
    assert engine.capture_deferred_graph() and asked == [1]
