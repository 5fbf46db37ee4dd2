"""LLMEngine behind an asyncio interface: one engine thread, many concurrent requests.

LLMEngine is synchronous and single-threaded. AsyncEngine builds it and steps it in one
dedicated thread, so the event loop stays free while a forward runs. Requests and aborts
reach that thread through a queue and are applied between steps: only the engine thread
ever touches the scheduler. Each request's outputs come back on its own asyncio queue
(through loop.call_soon_threadsafe). Requests that arrive together share the next batch.

    engine = AsyncEngine(config)
    engine.start()                                   # returns at once; builds in the thread
    outputs = await engine.add_request(prompt_ids, SamplingParams(max_tokens=32))
    async for out in outputs:                        # cumulative text and token ids
        ...
    # Closing `outputs` early (aclose(), or the consuming task cancelled) aborts the request.
    await engine.shutdown(timeout_s=30)            # running requests get 30 s, then are aborted
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kiln.compile.gc_pause import thaw_heap
from kiln.config import EngineConfig
from kiln.engine.errors import EngineDead
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.outputs import RequestOutput
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.timeline import StartupTimeline
from kiln.loader import ModelSource

logger = logging.getLogger("kiln")


class EngineNotReady(RuntimeError):
    """The engine is still starting, failed to start, or is shutting down."""


class RequestAborted(RuntimeError):
    """The engine aborted the request before it finished (shutdown, or a failed step)."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the engine thread publishes after every step (read by /metrics)."""
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_in_use: int = 0
    kv_blocks_total: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens served from it
    kv_blocks_cached: int = 0  # blocks nobody uses that keep a cached prefix (handed out when needed)
    steps_over_budget: int = 0  # steps that took longer than the time budget


class _Request:
    """The event-loop side of one request: an acceptance future and a queue of outputs."""

    def __init__(self, request_id: str, prompt: str | list[int], params: SamplingParams):
        self.request_id, self.prompt, self.params = request_id, prompt, params
        self.accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        self.outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def accept(self, error: BaseException | None) -> None:
        if self.accepted.done():  # the caller stopped waiting (cancelled)
            return
        if error is None:
            self.accepted.set_result(None)
        else:
            self.accepted.set_exception(error)


class AsyncEngine:
    def __init__(self, config: EngineConfig, timeline: StartupTimeline | None = None,
                 source: ModelSource | None = None):
        self.config = config
        self.timeline = timeline or StartupTimeline()
        self.source = source  # the model's, where the caller loaded it (else the engine thread does)
        self.engine: LLMEngine | None = None  # set by the engine thread once built
        self.failure: BaseException | None = None  # why the engine failed to start, or stopped serving
        self.stats = EngineStats()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting = True
        self._ids = itertools.count()
        # Touched by the engine thread only.
        self._requests: dict[str, _Request] = {}
        self._stop_at: float | None = None

    @property
    def ready(self) -> bool:
        return self.engine is not None and self._accepting

    def start(self, on_failure: Callable[[BaseException], None] | None = None) -> None:
        """Build the engine in the background; call from the event loop that will await requests.

        on_failure(error) is called (from the engine thread) if the engine fails to start or
        its loop dies.
        """
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, args=(on_failure,),
                                        name="kiln-engine", daemon=True)
        self._thread.start()

    async def add_request(self, prompt: str | list[int], params: SamplingParams,
                          request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request; returns its outputs once the engine has accepted it.

        Raises ValueError for a prompt the engine refuses (too long, empty, bad ids) and
        EngineNotReady before start-up has finished or after shutdown has begun.
        """
        if not self.ready:
            raise EngineNotReady(self.not_ready_reason())
        request = _Request(request_id or f"req-{next(self._ids)}", prompt, params)
        self._commands.put(("add", request))
        try:
            await request.accepted
        except asyncio.CancelledError:
            self.abort(request.request_id)
            raise
        return self._outputs(request)

    def abort(self, request_id: str) -> None:
        """Abort a request (if it still runs) and free its KV blocks; safe to call twice."""
        self._commands.put(("abort", request_id))

    def stop(self, timeout_s: float) -> None:
        """Refuse new requests; running ones get timeout_s from now to finish, then are aborted
        (at the end of the step running then: a step's length is bounded, see Scheduler).

        Returns at once, and is safe to call from a signal handler (SimpleQueue.put is
        reentrant). Only the first call's deadline counts.
        """
        self._accepting = False
        self._commands.put(("stop", time.monotonic() + timeout_s))

    async def shutdown(self, timeout_s: float = 0.0) -> None:
        """stop(timeout_s), then wait until the engine thread has ended every request."""
        self.stop(timeout_s)
        if self._thread is not None and self.engine is not None:
            # (A thread still building the engine is a daemon: it dies with the process.)
            await asyncio.to_thread(self._thread.join)

    def not_ready_reason(self) -> str:
        if self.failure is not None:
            return f"the engine failed: {self.failure}"
        if not self._accepting:
            return "the server is shutting down"
        return f"the engine is starting (phase: {self.timeline.current})"

    async def _outputs(self, request: _Request) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await request.outputs.get()
                # Outputs are cumulative, so a consumer that fell behind needs only the newest.
                # An error is always the last item put.
                while not request.outputs.empty():
                    item = request.outputs.get_nowait()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the consumer left early: a disconnect, a cancel, a break
                self.abort(request.request_id)

    # ---- everything below runs in the engine thread ----

    def _run(self, on_failure) -> None:
        try:
            self.engine = LLMEngine(self.config, self.timeline, self.source)
            self.source = None
        except Exception as e:
            self._fail(e, on_failure, f"engine start-up failed in phase {self.timeline.current}")
            return
        try:
            self._serve()
        except EngineDead as e:
            self._fail(e, on_failure, "the engine stopped")
            self.engine.shutdown()  # the ranks left, which cannot run without the lost one
        except Exception as e:  # a bug in this loop: better a dead server than hung requests
            self._fail(e, on_failure, "the engine loop failed")
        finally:
            thaw_heap()  # served its last: a process that goes on gets the engine's memory back

    def _serve(self) -> None:
        self._publish_stats()
        while True:
            idle = not self.engine.has_unfinished()
            if idle and self._stop_at is not None:
                break
            # Idle with graphs left for first use: capture one, then look for requests again.
            captured = idle and self.engine.capture_deferred_graph()
            self._apply_commands(block=idle and not captured)
            if self._stop_at is not None and time.monotonic() >= self._stop_at:
                break
            if self.engine.has_unfinished():
                self._step()
            else:
                self._publish_stats()
        self._abort_all(RequestAborted("the server shut down before the request finished"))
        self._publish_stats()

    def _fail(self, error: Exception, on_failure, message: str) -> None:
        logger.exception(message)
        self.failure, self._accepting = error, False
        for request in self._requests.values():
            self._call(request.outputs.put_nowait, RequestAborted(f"{message}: {error}"))
        if on_failure is not None:
            on_failure(error)

    def _apply_commands(self, block: bool) -> None:
        """Apply every queued command; when idle, wait for the first one."""
        while True:
            try:
                command, arg = self._commands.get(block=block)
            except queue.Empty:
                return
            block = False
            if command == "add":
                self._add(arg)
            elif command == "abort":
                self.engine.abort_request(arg)
                self._requests.pop(arg, None)
            elif command == "stop" and self._stop_at is None:
                self._stop_at = arg
                if self._requests:
                    logger.info("stopping: %d request(s) running get %.1f s to finish", len(self._requests),
                                max(0.0, arg - time.monotonic()))

    def _add(self, request: _Request) -> None:
        if self._stop_at is not None:
            self._call(request.accept, EngineNotReady("the server is shutting down"))
            return
        try:
            self.engine.add_request(request.prompt, request.params, request.request_id)
        except Exception as e:  # ValueError: a refused prompt; anything else is a bug, but this request's alone
            self._call(request.accept, e)
            return
        self._requests[request.request_id] = request
        self._call(request.accept, None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except EngineDead:
            raise  # no later step can run: the engine ends (_run)
        except Exception as e:
            # The failed batch's state is unknown: end every request rather than guess.
            logger.exception("engine step failed; aborting %d request(s)", len(self._requests))
            self._abort_all(RequestAborted(f"the engine failed while running the request: {e}"))
            self._publish_stats()
            return
        self._publish_stats()  # first, so a client that sees its request finish sees it gone from the stats
        deliveries = []
        for out in outputs:
            request = self._requests.get(out.request_id)
            if request is None:
                continue
            if out.finished:
                del self._requests[out.request_id]
            deliveries.append((request.outputs, out))
        if deliveries:
            # One wake-up of the event loop a step, not one per request: each is a write to its
            # self-pipe, taken under the GIL the loop's thread also wants.
            self._call(_deliver, deliveries)

    def _abort_all(self, error: RequestAborted) -> None:
        if self._requests:
            logger.warning("aborting %d request(s): %s", len(self._requests), error)
        for request_id, request in list(self._requests.items()):
            self.engine.abort_request(request_id)
            self._call(request.outputs.put_nowait, error)
        self._requests.clear()

    def _publish_stats(self) -> None:
        scheduler = self.engine.scheduler
        blocks = scheduler.block_manager
        self.stats = EngineStats(len(scheduler.running), len(scheduler.waiting),
                                 blocks.num_blocks - blocks.num_free_blocks, blocks.num_blocks,
                                 scheduler.num_preemptions, blocks.stats.queries, blocks.stats.hits,
                                 len(blocks.evictable), scheduler.steps_over_budget)

    def _call(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass


def _deliver(deliveries: list[tuple[asyncio.Queue, object]]) -> None:
    for outputs, out in deliveries:
        outputs.put_nowait(out)
