"""The model runner of a tensor-parallel engine: rank 0 here, the other ranks in workers.

Rank 0 is the engine's own process: it schedules, samples, and runs a ModelRunner over its
shard of the model. Every other rank runs a ModelRunner over its shard in a worker
process (kiln.distributed.launcher) and mirrors rank 0 step by step:

    start-up  every rank builds its runner (sharded weights, compile, KV cache) at once:
              the warm-up forwards hold collectives, so ranks must build side by side;
              each worker then answers with its KV-cache block count, and the engine
              schedules with the smallest, which every rank holds.
    step      rank 0 sends a StepRequest (per sequence: position, new token ids, block
              table) before its own forward; each worker rebuilds a batch from it and runs
              ModelRunner.execute on it, the very code rank 0 runs, so both issue the same
              collectives in the same order (the all-reduces in the forward, the all-gather
              of the logits). Workers sample greedily and drop the tokens; rank 0's count.
    stop      rank 0 sends None; workers leave the process group and exit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kiln.compile.gc_pause import freeze_heap
from kiln.config import EngineConfig
from kiln.distributed import TensorParallelState, building_for
from kiln.distributed.launcher import Workers, join_as_rank0
from kiln.engine.errors import EngineDead
from kiln.engine.gil_handoff import quick_gil_handoff
from kiln.engine.runner import ModelRunner, SampledToken
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.scheduler import ScheduledBatch
from kiln.engine.timeline import StartupTimeline
from kiln.loader import ModelSource, load_source
from kiln.models import model_class

logger = logging.getLogger("kiln")


@dataclass
class SequenceStep:
    """What ModelRunner.prepare reads of one sequence, for one step."""

    num_computed_tokens: int
    new_token_ids: list[int]  # token_ids[num_computed_tokens : num_computed_tokens + n]
    block_table: list[int]
    num_tokens: int


@dataclass
class StepRequest:
    seqs: list[SequenceStep]
    num_new_tokens: list[int]

    @classmethod
    def of(cls, batch: ScheduledBatch) -> "StepRequest":
        return cls([SequenceStep(s.num_computed_tokens, s.token_ids[s.num_computed_tokens:s.num_computed_tokens + n],
                                 list(s.block_table), s.num_tokens)
                    for s, n in zip(batch.seqs, batch.num_new_tokens)], list(batch.num_new_tokens))

    def batch(self) -> ScheduledBatch:
        return ScheduledBatch([_StepSequence(s) for s in self.seqs], self.num_new_tokens)


class _TokenWindow:
    """A sequence's token ids as a worker knows them: only this step's, indexed by absolute
    position like Sequence.token_ids (sending whole contexts every step would cost O(context))."""

    def __init__(self, begin: int, ids: list[int]):
        self.begin, self.ids = begin, ids

    def __getitem__(self, window: slice) -> list[int]:
        if not self.begin <= window.start <= window.stop <= self.begin + len(self.ids):
            raise IndexError(f"a worker knows tokens [{self.begin}, {self.begin + len(self.ids)}) of this "
                             f"sequence, not [{window.start}, {window.stop})")
        return self.ids[window.start - self.begin:window.stop - self.begin]


_GREEDY = SamplingParams(temperature=0.0)


class _StepSequence:
    """Stands in for a Sequence on a worker: what prepare reads, and a greedy sample."""

    def __init__(self, step: SequenceStep):
        self.num_computed_tokens = step.num_computed_tokens
        self.token_ids = _TokenWindow(step.num_computed_tokens, step.new_token_ids)
        self.block_table = step.block_table
        self._num_tokens = step.num_tokens
        self.num_pending_tokens = 0  # tensor parallelism runs without async scheduling
        self.params, self.generator, self.matcher = _GREEDY, None, None

    @property
    def num_tokens(self) -> int:
        return self._num_tokens


class TensorParallelRunner(ModelRunner):
    """Rank 0's ModelRunner: launches the other ranks, then mirrors every step to them."""

    def __init__(self, config: EngineConfig, source: ModelSource, timeline: StartupTimeline):
        size = config.tensor_parallel_size
        model_class(source.config.architecture).check_tensor_parallel(source.config, size)
        self.workers = Workers(size, config.torch_device.type, _serve_steps, (config,))
        self.lost: EngineDead | None = None  # set once a worker is gone: every later step fails with it
        try:
            with timeline.phase("tensor_parallel_group"):
                self.tp = join_as_rank0(self.workers)
            with self.workers.watching(), building_for(self.tp):
                super().__init__(config, source, timeline)
                worker_blocks = self.workers.gather()
        except BaseException as error:
            try:
                self.workers.raise_failure(timeout_s=5)
            finally:
                self.shutdown()
            raise error
        if min(worker_blocks) < self.num_blocks:
            logger.info("KV cache: using %d blocks, the most every rank holds", min(worker_blocks))
            self.num_blocks = min(worker_blocks)
        logger.info("tensor parallel: %d ranks over %s (%s), this process rank 0", size,
                    config.torch_device.type, self.workers.backend)

    def capture_next_graph(self) -> bool:
        """None alone: a capture runs the forward's collectives, which every rank must join. The
        ranks capture a graph left for first use together, in the step that first needs it."""
        return False

    def execute(self, batch: ScheduledBatch) -> list[SampledToken]:
        if self.lost is not None:
            raise self.lost
        try:
            self.workers.send(StepRequest.of(batch))
            return super().execute(batch)
        except Exception as error:
            self._check_workers(error)
            raise

    def _check_workers(self, error: Exception) -> None:
        """After a failed step: a worker that failed or exited ends the engine (the group is
        broken), with the worker's own news rather than rank 0's collective error."""
        reason = None
        try:
            self.workers.raise_failure(timeout_s=2)
        except RuntimeError as failure:
            reason = str(failure)
        gone = self.workers.exited(timeout_s=2)
        if reason is None and gone:
            rank, status = gone[0]
            reason = f"tensor-parallel rank {rank} exited ({status}) during a step"
        if reason is not None:
            self.lost = EngineDead(f"{reason}; the engine cannot run without it: start it again "
                                   f"(rank 0's own error: {str(error).splitlines()[0] if str(error) else type(error).__name__})")
            raise self.lost from error

    def shutdown(self) -> None:
        """Stop the workers and leave the process group (an engine can be made again after), then
        free rank 0's own device memory where its runner was built."""
        self.workers.shutdown()
        if hasattr(self, "device"):  # not when rank 0's build failed part-way
            super().shutdown()


def _serve_steps(state: TensorParallelState, conn, config: EngineConfig) -> None:
    """A worker's life: build this rank's runner, report its KV-cache size, run steps until None."""
    with building_for(state), quick_gil_handoff(config.torch_device.type):
        runner = ModelRunner(config, load_source(config.model), StartupTimeline())
    freeze_heap()  # a full collection in one rank would stall every rank at the next all-reduce
    conn.send(runner.num_blocks)
    while (request := conn.recv()) is not None:
        runner.execute(request.batch())
