"""The engine loop: requests in, one scheduled forward per step, tokens and text out."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import operator
import time

from kiln.compile.gc_pause import collector_paused, freeze_heap, thaw_heap
from kiln.config import EngineConfig
from kiln.engine.block_manager import BlockManager
from kiln.engine.cpu_threads import choose_threads
from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.engine.gil_handoff import quick_gil_handoff
from kiln.engine.outputs import RequestOutput
from kiln.engine.runner import LaunchedStep, ModelRunner, SampledToken
from kiln.engine.sampling_params import RequestOutputKind, SamplingParams
from kiln.engine.scheduler import ScheduledBatch, Scheduler
from kiln.engine.sequence import Sequence
from kiln.engine.structured_output import GrammarCompiler
from kiln.engine.timeline import StartupTimeline
from kiln.engine.tp_runner import TensorParallelRunner
from kiln.loader import ModelSource, load_source

logger = logging.getLogger("kiln")


class LLMEngine:
    def __init__(self, config: EngineConfig, timeline: StartupTimeline | None = None,
                 source: ModelSource | None = None):
        """`source`: the model's, where the caller loaded it already (load_source(config.model))."""
        if config.torch_device.type == "cpu":
            # Decided once, here: the ranks kiln starts take this count and do not sample the CPUs themselves.
            threads, why = choose_threads(config.cpu_threads, config.tensor_parallel_size)
            logger.info("CPU threads: %d per process (%s)", threads, why)
            config = dataclasses.replace(config, cpu_threads=threads)
        self.config = config
        self.timeline = timeline or StartupTimeline()
        if thaw_heap():
            # An earlier engine froze the heap; one dropped without shutdown is garbage in it, whose
            # device memory only a collection frees: before this one loads its weights.
            gc.collect()
        with self.timeline.phase("checkpoint"), collector_paused():
            self.source = source or load_source(config.model)
            self.tokenizer = self.source.tokenizer
            self.max_model_len = self._max_model_len()
        with quick_gil_handoff(config.torch_device.type):  # the runner's start runs threads beside this one
            if config.tensor_parallel_size > 1:
                self.runner = TensorParallelRunner(config, self.source, self.timeline)
            else:
                self.runner = ModelRunner(config, self.source, self.timeline)
        self.is_shut_down = False
        capacity = self.runner.num_blocks * config.block_size
        if capacity < self.max_model_len:
            self.runner.shutdown()  # its memory back at once: the caller may well try again
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({self.runner.num_blocks} blocks of "
                f"{config.block_size}), fewer than max_model_len={self.max_model_len}: one long "
                f"request could never run. Lower max_model_len or give the cache more memory "
                f"(kv_cache_gib on CPU, gpu_memory_utilization on GPU, or num_kv_blocks)")
        self.scheduler = Scheduler(BlockManager(self.runner.num_blocks, config.block_size,
                                                config.enable_prefix_caching),
                                   config.max_num_seqs, config.max_num_batched_tokens, config.step_time_budget,
                                   self.max_model_len)
        self.eos_token_ids = set(self.source.config.eos_token_ids)
        if self.tokenizer is not None:
            self.eos_token_ids |= set(self.tokenizer.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, self.source.config.vocab_size)
        self.seqs: dict[str, Sequence] = {}  # live sequences by seq_id
        self.requests: dict[str, list[Sequence]] = {}  # live requests: their sequences, one per choice
        self.async_scheduling = config.uses_async_scheduling
        self._in_flight: LaunchedStep | None = None  # async scheduling: the step whose tokens come next
        self._ids = itertools.count()
        # What start-up left lives as long as this engine: no full collection walks it while it runs.
        # So `del llm; gc.collect()` may not free it: the start's own cyclic garbage, frozen too, can
        # hold this object (torch.fx's wrap() leaves its frame in a cycle, and that frame's callers'
        # frames, ours among them, with it); shutdown() or the next build does.
        freeze_heap()
        self.timeline.mark_ready()

    def _max_model_len(self) -> int:
        model_len = self.source.config.max_position_embeddings
        if self.config.max_model_len is None:
            return model_len
        if self.config.max_model_len > model_len:
            raise ValueError(f"max_model_len={self.config.max_model_len} exceeds the model's context "
                             f"of {model_len} tokens; lower it")
        return self.config.max_model_len

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        self._check_running()
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.source.name!r} has no tokenizer; pass token ids")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        if not ids:
            raise ValueError("the prompt is empty: send at least one token of text")
        ids = truncated(ids, params.truncate_prompt_tokens, self.max_model_len)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens but the context holds "
                             f"{self.max_model_len} (max_model_len), prompt and output together; "
                             f"shorten the prompt")
        vocab = self.source.config.vocab_size
        ids = _token_ids(ids)
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if any(t >= vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must lie in [0, {vocab}), got {max(params.logit_bias)}")
        if params.allowed_token_ids and params.allowed_token_ids[-1] >= vocab:
            raise ValueError(f"allowed_token_ids must lie in [0, {vocab}), got {params.allowed_token_ids[-1]}")
        bad_words = ()
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError(f"bad_words needs the model's tokenizer, and {self.source.name!r} has none")
            bad_words = bad_word_ids(self.tokenizer, params.bad_words)
            if any(t >= vocab for word in bad_words for t in word):
                raise ValueError(f"bad_words: a word's tokens lie outside the model's [0, {vocab})")
        if params.structured_outputs is not None and self.tokenizer is None:
            raise ValueError(f"structured output needs the model's tokenizer, and {self.source.name!r} has none")
        grammar = self.grammars.matcher(params.structured_outputs) if params.structured_outputs is not None else None
        if params.prompt_logprobs is not None and self.config.tensor_parallel_size > 1:
            raise ValueError("prompt_logprobs is not supported with tensor_parallel_size > 1 yet (the other ranks "
                             "would have to compute the prompt's logits too); leave it out")
        request_id = request_id or f"req-{next(self._ids)}"
        seq_ids = [request_id] + [f"{request_id}#{i}" for i in range(1, params.n)]
        if request_id in self.requests or any(i in self.seqs for i in seq_ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        group = []
        for index, seq_id in enumerate(seq_ids):
            detok = None
            if self.tokenizer is not None and params.detokenize:
                detok = IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output,
                                               params.skip_special_tokens)
            seq = Sequence(seq_id, text, ids, params, detok, request_id, index)
            seq.bad_words = bad_words
            if not params.ignore_eos:
                seq.stop_ids |= self.eos_token_ids
            if index and self.config.enable_prefix_caching:
                seq.leader = group[0]  # admitted once the first choice's prompt is in the cache
            if grammar is not None:
                seq.matcher = grammar.deep_copy() if index else grammar
            group.append(seq)
        self.requests[request_id] = group
        for seq in group:
            self.seqs[seq.seq_id] = seq
            self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> None:
        for seq in self.requests.pop(request_id, []):
            self.seqs.pop(seq.seq_id, None)
            if not seq.finished:
                self.scheduler.finish(seq, "abort")

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (they also stop at exit), and free the
        device memory the engine holds (weights, KV cache, CUDA graphs) at once, so that the process
        can build another engine. Requests not finished are dropped; the engine takes no more."""
        thaw_heap()  # the runner's shutdown collects the cycles its compiled forward leaves
        self.runner.shutdown()
        self._in_flight = None
        self.is_shut_down = True

    def _check_running(self) -> None:
        if self.is_shut_down:
            raise RuntimeError("this engine was shut down (its weights and KV cache are freed); build a new "
                               "one, e.g. LLM(...), to generate again")

    def has_unfinished(self) -> bool:
        # A step in flight whose sequences all finished (or were aborted) has nothing left to give.
        in_flight = self._in_flight is not None and any(not s.finished for s in self._in_flight.seqs)
        return self.scheduler.has_unfinished() or in_flight

    def capture_deferred_graph(self) -> bool:
        """Capture one CUDA graph that was left for first use, while no request runs (a server
        calls this when idle, so that the first mixed steps after start-up find their graphs);
        False when none is left or a request is unfinished."""
        if self.is_shut_down or self.has_unfinished():
            return False
        return self.runner.capture_next_graph()

    def step(self) -> list[RequestOutput]:
        """Schedule and run the next batch; returns the outputs of every sequence that got a
        token. With async scheduling those are the previous step's: this step is queued on the
        device first, and runs while they are read back, checked for stops and detokenized."""
        self._check_running()
        # A grammar's mask for the next step needs the last step's token: read it first.
        early = self.drain() if self._in_flight is not None and self._structured_in_flight() else []
        batch = self.scheduler.schedule()
        start = time.perf_counter()
        if batch is None:
            return early + self.drain()
        now = time.time()
        for seq in batch.seqs:
            seq.times.setdefault("scheduled", now)
        if self.async_scheduling:
            try:
                launched = self.runner.launch(batch)
            except BaseException:
                self._in_flight = None  # the caller aborts what ran: nothing is left to read
                raise
            self._advance(batch)
            for seq in launched.seqs:
                seq.num_pending_tokens += 1
            previous, self._in_flight = self._in_flight, launched
            outputs = self._collect(self._results(previous), pending=True) if previous is not None else []
        else:
            sampled = self.runner.execute(batch)
            self._advance(batch)
            outputs = self._collect(sampled, pending=False)
            self.scheduler.observe(batch, time.perf_counter() - start)
        return early + outputs

    def _results(self, launched: LaunchedStep) -> list[SampledToken]:
        """A launched step's tokens; the scheduler learns the step's duration (LaunchedStep.seconds).
        Not the wall time of the step() that launched it (its launch plus the wait for the step
        before), nor the time until its tokens are read (an engine gone idle reads its last step
        much later)."""
        sampled = launched.results()
        if launched.batch is not None:
            self.scheduler.observe(launched.batch, launched.seconds())
        return sampled

    def _structured_in_flight(self) -> bool:
        return any(s.matcher is not None and not s.finished for s in self._in_flight.seqs)

    def drain(self) -> list[RequestOutput]:
        """The outputs of the step in flight (async scheduling), launching nothing new."""
        previous, self._in_flight = self._in_flight, None
        return self._collect(self._results(previous), pending=True) if previous is not None else []

    @staticmethod
    def _advance(batch: ScheduledBatch) -> None:
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n

    def _collect(self, sampled: list[SampledToken], pending: bool) -> list[RequestOutput]:
        """One RequestOutput per request that got a token (all its choices, in order)."""
        updated: dict[str, None] = {}
        for s in sampled:
            seq = s.seq
            if pending:
                seq.num_pending_tokens -= 1
            if seq.finished:  # stopped (or aborted) while this step ran: its token is past the end
                continue
            if s.logprobs is not None:
                self._add_logprobs(seq, s.token, s.logprobs)
            if seq.prompt_logprobs is not None and seq.num_output_tokens == 0:  # the prompt is through
                self._decode_logprobs([entry for entry in seq.prompt_logprobs if entry is not None])
            self._append_token(seq, s.token)
            updated[seq.request_id] = None
            if seq.finished:
                self.seqs.pop(seq.seq_id, None)
        outputs = []
        for request_id in updated:
            group = self.requests[request_id]
            finished = all(s.finished for s in group)
            # FINAL_ONLY: no output until the end (at 256 requests of 512 tokens, building every
            # request's cumulative output each step cost ~2.7 ms of host time a step on the CPU).
            if finished or group[0].params.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(RequestOutput.of(group))
            if finished:
                del self.requests[request_id]
        return outputs

    def _add_logprobs(self, seq: Sequence, token: int, logprobs: dict) -> None:
        self._decode_logprobs([logprobs])
        seq.logprobs.append(logprobs)
        seq.cumulative_logprob += logprobs[token].logprob

    def _decode_logprobs(self, entries: list[dict]) -> None:
        """Each Logprob's decoded_token: its token alone as text (None without a tokenizer)."""
        if self.tokenizer is None:
            return
        for entry in entries:
            for tid, logprob in entry.items():
                logprob.decoded_token = self.tokenizer.decode([tid], skip_special_tokens=False)

    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.token_ids.append(token)
        if seq.matcher is not None and not seq.matcher.consume_token(token):
            # The mask allows only what the grammar accepts (or, with every token refused, the row's
            # argmax is token 0): end this sequence, not the engine.
            logger.error("structured output: sequence %s sampled token %d, which its grammar refuses (%s); "
                         "ending it", seq.seq_id, token, seq.matcher.get_error())
            self.scheduler.finish(seq, "abort")
            return
        now = time.time()
        seq.times.setdefault("first_token", now)
        seq.times["last_token"] = now
        p = seq.params
        if seq.num_output_tokens < p.min_tokens:  # vLLM's rule: no stop of any kind before min_tokens
            if seq.detokenizer is not None:
                seq.detokenizer.add(token, check_stop=False)
            if seq.ends_by_length(seq.num_tokens, self.max_model_len):
                self.scheduler.finish(seq, "length")
        elif not p.ignore_eos and token in self.eos_token_ids:
            self.scheduler.finish(seq, "stop")
        elif token in p.stop_token_ids:
            seq.stop_reason = token
            self.scheduler.finish(seq, "stop")
        elif seq.detokenizer is not None and seq.detokenizer.add(token):
            seq.stop_reason = seq.detokenizer.stopped_by
            self.scheduler.finish(seq, "stop")
        elif seq.matcher is not None and seq.matcher.is_stopped():  # the grammar has nothing more to say
            self.scheduler.finish(seq, "stop")
        elif seq.ends_by_length(seq.num_tokens, self.max_model_len):
            self.scheduler.finish(seq, "length")


def _token_ids(ids: list) -> list[int]:
    """Token ids as Python ints (numpy and torch integers too); anything else is refused."""
    out = []
    for t in ids:
        try:
            if isinstance(t, bool):
                raise TypeError
            out.append(operator.index(t))
        except TypeError:
            raise ValueError(f"prompt token ids must be integers, got {type(t).__name__} {t!r}; pass text as a "
                             f"string, or token ids as a list of ints") from None
    return out


def bad_word_ids(tokenizer, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's reading of bad_words: each word's tokens as written at the start of the text, and as
    after a space where that starts with another token and is as long (a word mid-sentence)."""
    found = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        found.append(tuple(plain))
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            found.append(tuple(spaced))
    return tuple(found)


def truncated(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """SamplingParams.truncate_prompt_tokens: the prompt's last `keep` ids (-1: as many as the
    context holds); None: all of them."""
    if keep is None:
        return ids
    return ids[-(max_model_len if keep == -1 else keep):]
