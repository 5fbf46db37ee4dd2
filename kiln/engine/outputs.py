"""What a request returns, in vLLM's shape: RequestOutput holding one CompletionOutput per
generated sequence (kiln generates one: n > 1 is not offered yet), and when it happened.

    for o in llm.generate(prompts, params):
        print(o.prompt, o.outputs[0].text)

`text`, `token_ids` and `finish_reason` on the RequestOutput itself are shorthands for
outputs[0]'s, kept because a request has one sequence and the server, the CLI and most
scripts read just that one.
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
    def of(cls, seq: Sequence) -> "RequestOutput":
        t = seq.times
        completion = CompletionOutput(0, seq.text, seq.output_token_ids, seq.cumulative_logprob,
                                      list(seq.logprobs) if seq.logprobs is not None else None,
                                      finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
        metrics = RequestMetrics(t["arrival"], t.get("scheduled"), t.get("first_token"), t.get("last_token"),
                                 t.get("finished"))
        return cls(seq.seq_id, seq.prompt, seq.token_ids[: seq.num_prompt_tokens], [completion], seq.finished,
                   metrics, seq.num_preemptions, seq.prompt_logprobs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
