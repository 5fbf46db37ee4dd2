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
