"""What a request returns, in vLLM's shape: RequestOutput holding one CompletionOutput per
generated sequence (n of them, SamplingParams.n), and when it happened.

    for o in llm.generate(prompts, params):
        print(o.prompt, o.outputs[0].text)

`text`, `token_ids` and `finish_reason` on the RequestOutput itself are shorthands for
outputs[0]'s, kept because most requests have one sequence and the CLI and most scripts
read just that one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.engine.sequence import Sequence


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # with SamplingParams.logprobs: the chosen tokens' sum
    logprobs: list | None = None  # with SamplingParams.logprobs: per token, {token id: Logprob}
    finish_reason: str | None = None  # "stop", "length" or "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, else None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of the request's life; None for what has not happened."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @classmethod
    def merged(cls, arrival: float, times: list[dict]) -> "RequestMetrics":
        """A request of several choices: the first schedule and token of any, the last token of
        any, finished when all are."""
        def seen(name):
            return [t[name] for t in times if name in t]

        finished = seen("finished")
        return cls(arrival, min(seen("scheduled"), default=None), min(seen("first_token"), default=None),
                   max(seen("last_token"), default=None), max(finished) if len(finished) == len(times) else None)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_preemptions: int = 0
    prompt_logprobs: list | None = field(default=None)

    @classmethod
    def of(cls, seqs: Sequence | list[Sequence]) -> "RequestOutput":
        """The request's state: one CompletionOutput per sequence (choice), finished when all are."""
        seqs = [seqs] if isinstance(seqs, Sequence) else seqs
        first = seqs[0]
        completions = [CompletionOutput(s.index, s.text, s.output_token_ids, s.cumulative_logprob,
                                        list(s.logprobs) if s.logprobs is not None else None,
                                        finish_reason=s.finish_reason, stop_reason=s.stop_reason) for s in seqs]
        if len(seqs) == 1:  # one choice (most requests, every step): its own times, no merging
            t = first.times
            metrics = RequestMetrics(t["arrival"], t.get("scheduled"), t.get("first_token"), t.get("last_token"),
                                     t.get("finished"))
        else:
            metrics = RequestMetrics.merged(first.times["arrival"], [s.times for s in seqs])
        return cls(first.request_id, first.prompt, first.prompt_token_ids, completions,
                   all(s.finished for s in seqs), metrics, sum(s.num_preemptions for s in seqs),
                   first.prompt_logprobs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
