"""A request as the scheduler sees it: its tokens, its blocks, and how far it has run."""

from __future__ import annotations

import enum
import time

import torch

from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, seq_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, detokenizer: IncrementalDetokenizer | None,
                 request_id: str | None = None, index: int = 0):
        self.seq_id = seq_id
        # A request with n > 1 is n sequences: the request they answer, and which choice this is.
        self.request_id = request_id if request_id is not None else seq_id
        self.index = index
        # The first choice, whose prompt this one waits for so as to share its cached blocks.
        self.leader: Sequence | None = None
        self.prompt = prompt
        self.token_ids = list(prompt_token_ids)
        # Its own list, never changed: every output of the request hands out this one, not a copy
        # (at 256 requests of 900 prompt tokens, copies cost ~2 ms of host time a step).
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.detokenizer = detokenizer
        self.num_computed_tokens = 0  # tokens whose keys and values are in the cache
        # Sampled on the GPU by a step still in flight, not yet in token_ids (async scheduling:
        # the next step reads it from the GPU).
        self.num_pending_tokens = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or string that finished it
        self.num_preemptions = 0
        # Wall-clock times (time.time()) of its life: arrival, scheduled, first_token, last_token, finished.
        self.times: dict[str, float] = {"arrival": time.time()}
        self.generator = None
        if params.seed is not None:  # each choice its own stream: seed + index
            self.generator = torch.Generator().manual_seed(params.seed + index)
        # The tokens that stop it, masked while fewer than min_tokens are out: the engine adds EOS.
        self.stop_ids = frozenset(params.stop_token_ids)
        # With params.bad_words: their token sequences (the engine tokenizes them), never to be completed.
        self.bad_words: tuple[tuple[int, ...], ...] = ()
        # With params.logprobs: per output token, {token id: Logprob} (the chosen one and the top ones).
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        # With params.prompt_logprobs: None for the first prompt token, then one entry per token.
        self.prompt_logprobs: list[dict | None] | None = None
        self.matcher = None  # with params.structured_outputs: its grammar's llguidance matcher

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens

    def ends_by_length(self, num_tokens: int, max_model_len: int | None) -> bool:
        """Whether holding `num_tokens` tokens finishes it by length (max_tokens or the context)."""
        max_tokens = self.params.max_tokens
        return ((max_tokens is not None and num_tokens - self.num_prompt_tokens >= max_tokens)
                or (max_model_len is not None and num_tokens >= max_model_len))

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer else ""

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
