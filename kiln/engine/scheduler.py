"""Continuous batching: every step packs running decodes and new prefill chunks together.

Each step has a token budget (max_num_batched_tokens). Running sequences go first, one
token each for decodes and the rest of their prompt (up to the budget) for prefills cut
into chunks; then waiting sequences join while budget, sequence slots and blocks last.
When blocks run out, the most recently admitted running sequence is preempted: its blocks
are freed and it goes back to the front of the queue, to be recomputed later.

With a time budget (max_step_seconds: the CPU's default), prefill chunks are also cut to what
fits in that many seconds, so that no step outlives a shutdown deadline or stalls the decodes
beside it for long (on the 2-core CPU one 2048-token chunk of a 7.4k-token prompt took ~11 s).
A step's seconds are read as a fixed part, what the recent steps without prefill took (on a GPU
the weights' read: most of a step), plus a cost per prefill token. Dividing a step's seconds by
all its tokens instead put the fixed part (~6 ms of an 8B model's step on an H100) on every
token, several times the real cost; with an 8 ms budget at 32 req/s the queue starved (TTFT p50
72 s). Decode tokens are never cut.

A budget holds only above what the smallest step with prefill costs. On a GPU that is the eager
forward's launches (13-17 ms for an 8B model on an H100, by host), whatever the chunk: below it
every chunk shrinks to MIN_PREFILL_TOKENS and the queue grows, which the scheduler logs once.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from kiln.engine.block_manager import BlockManager
from kiln.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger("kiln")


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens of each sequence computed this step
    prefill_allowance: int | None = None  # prefill tokens the step was allowed (under a time budget)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def uniform_decode(self) -> bool:
        """One new token per sequence: a step of the decode phase's CUDA graphs."""
        return all(n == 1 for n in self.num_new_tokens)


# Under a time budget: the prefill tokens of the first step, before any cost is measured,
# and the fewest a step may take (so that a slow step still makes progress).
FIRST_PREFILL_TOKENS = 256
MIN_PREFILL_TOKENS = 16
# A step informs the cost per prefill token when it computes at least this many (below, the
# noise in the fixed part dominates).
COSTED_STEP_TOKENS = 32


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_step_seconds: float | None = None, max_model_len: int | None = None):
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_step_seconds = max_step_seconds
        # Under a time budget, from recent steps: the seconds of a step without prefill tokens, and
        # each prefill token's seconds on top of that.
        self.fixed_seconds: float | None = None
        self.seconds_per_token: float | None = None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.steps_over_budget = 0  # steps that took longer than max_step_seconds
        self.warned_budget_too_small = False

    def observe(self, batch: ScheduledBatch, seconds: float) -> None:
        """A step's duration: updates the fixed part and the cost per prefill token the time budget uses."""
        if self.max_step_seconds is None:
            return
        over = seconds > self.max_step_seconds
        self.steps_over_budget += over
        prefill = sum(n for n in batch.num_new_tokens if n > 1)
        # Half the weight on the newest: a batch's decodes come and go, and attention's cost per
        # token grows along a long prompt.
        if prefill == 0:
            self.fixed_seconds = seconds if self.fixed_seconds is None else (self.fixed_seconds + seconds) / 2
            return
        if over and batch.prefill_allowance == MIN_PREFILL_TOKENS:
            self._warn_budget_too_small(batch, prefill, seconds)
        # Too few tokens to cost, unless they were all it was allowed: an estimate too high would
        # otherwise never be corrected once it allows fewer than that.
        if prefill < min(COSTED_STEP_TOKENS, batch.prefill_allowance or COSTED_STEP_TOKENS):
            return
        # Past the fixed part (none known yet: all of it), never below nothing.
        cost = max(seconds - (self.fixed_seconds or 0.0), 0.0) / prefill
        self.seconds_per_token = cost if self.seconds_per_token is None else (self.seconds_per_token + cost) / 2

    def _warn_budget_too_small(self, batch: ScheduledBatch, prefill: int, seconds: float) -> None:
        """Once: even the least chunk overran the budget. On a GPU a step with prefill runs outside
        the decode graphs and costs its launches whatever its size (an 8B model's eager step, 13-17
        ms on H100 hosts), so a budget under that cuts every prompt into 16-token chunks and the
        queue grows (benchmarks/step_trace.py)."""
        if self.warned_budget_too_small:
            return
        self.warned_budget_too_small = True
        decodes = len(batch.num_new_tokens) - sum(n > 1 for n in batch.num_new_tokens)
        logger.warning("max_step_seconds %.3g s is less than a step with prefill takes here (%.3g s for %d prefill "
                       "tokens beside %d decodes): prompts are prefilled %d tokens a step and queue under load. "
                       "Raise --max-step-seconds, or leave it unset on a GPU", self.max_step_seconds, seconds,
                       prefill, decodes, MIN_PREFILL_TOKENS)

    def _prefill_tokens(self) -> int:
        """Prefill tokens the next step may compute (the token budget bounds them too)."""
        if self.max_step_seconds is None:
            return self.max_num_batched_tokens
        if self.seconds_per_token is None:
            return FIRST_PREFILL_TOKENS
        left = self.max_step_seconds - (self.fixed_seconds or 0.0)
        if self.seconds_per_token == 0.0:
            return self.max_num_batched_tokens if left > 0 else MIN_PREFILL_TOKENS
        return max(MIN_PREFILL_TOKENS, min(self.max_num_batched_tokens, int(left / self.seconds_per_token)))

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        budget = self.max_num_batched_tokens
        prefill_budget = self._prefill_tokens()
        batch = ScheduledBatch([], [], prefill_budget)
        preempted = False
        for seq in self.running:
            self.block_manager.cache_full_blocks(seq)  # what the last steps filled, for later prompts
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            if seq.num_pending_tokens and seq.ends_by_length(seq.num_tokens_with_pending, self.max_model_len):
                # Its token in flight is its last (async scheduling): nothing more to compute, and
                # the batch stays the one a synchronous engine would run.
                continue
            n = min(seq.num_tokens_with_pending - seq.num_computed_tokens, budget)
            if n > 1:  # a prefill chunk (a decode is one token and is never cut)
                if prefill_budget == 0:
                    continue
                n = min(n, prefill_budget)
            while not self.block_manager.can_allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.block_manager.allocate(seq, n)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
            if n > 1:
                prefill_budget -= n
        # New work waits while anything is being preempted: admitting it would only
        # take the blocks the preempted sequences need to come back.
        while (self.waiting and budget > 0 and prefill_budget > 0 and not preempted
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            if seq.leader is not None and not seq.leader.finished and \
                    seq.leader.num_computed_tokens < seq.num_prompt_tokens:
                break  # a later choice of a request waits for the first's prompt, to share its blocks
            hit = self.block_manager.cached_prefix(seq)  # its prompt's start, already in the cache
            computed = len(hit) * self.block_manager.block_size
            n = min(seq.num_tokens_with_pending - computed, budget, prefill_budget)
            if not self.block_manager.can_allocate(seq, n, hit):
                break
            prefill_budget -= n
            self.waiting.popleft()
            self.block_manager.share(seq, hit)
            self.block_manager.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch if batch.seqs else None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (stopped, out of length, or aborted) and return its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.times["finished"] = time.time()
