"""How to pick each next token and when to stop, with vLLM's field names, defaults and
semantics; checked when a request is made.

kiln honours the fields in SUPPORTED. vLLM's other fields are accepted at their defaults
(which turn them off), and any other value is refused naming the field: kiln never ignores
a setting silently.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

SUPPORTED = ("n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
             "ignore_eos", "include_stop_str_in_output", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "logit_bias", "min_tokens", "logprobs", "prompt_logprobs", "structured_outputs",
             "guided_decoding", "output_kind", "allowed_token_ids", "truncate_prompt_tokens", "skip_special_tokens",
             "detokenize", "bad_words")
MAX_LOGPROBS = 20  # top log probabilities a token may ask for (OpenAI's limit)
# vLLM's fields kiln does not implement yet, each with the value that leaves it off.
MAX_N = 64  # choices a request may ask for
UNSUPPORTED_DEFAULTS = {
    "best_of": None, "spaces_between_special_tokens": True, "logits_processors": None, "extra_args": None,
}


class RequestOutputKind(enum.Enum):
    """What a request's outputs hold (vLLM's enum): each its whole completion so far
    (CUMULATIVE), only what is new since the last (DELTA: not in kiln yet), or a single output
    when the request ends (FINAL_ONLY: what LLM.generate asks for, which reads no other)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: until the context (max_model_len) is full
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = all tokens
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logits_processors: list | None = None
    truncate_prompt_tokens: int | None = None
    logit_bias: dict | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    guided_decoding: object = None
    structured_outputs: object = None
    extra_args: dict | None = field(default=None)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        for name, off in UNSUPPORTED_DEFAULTS.items():
            value = getattr(self, name)
            if value != off and not (off is None and value in ([], {})):
                raise ValueError(f"SamplingParams {name}={value!r} is not supported by kiln yet (leave it at "
                                 f"{off!r}); kiln honours {', '.join(SUPPORTED)}")
        if not isinstance(self.output_kind, RequestOutputKind) or self.output_kind is RequestOutputKind.DELTA:
            raise ValueError(f"SamplingParams output_kind={self.output_kind!r} is not supported by kiln; give "
                             f"RequestOutputKind.CUMULATIVE (each output holds the whole completion so far) or "
                             f"RequestOutputKind.FINAL_ONLY (one output, when the request ends)")
        if not _count(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}] (the choices to generate), got {self.n!r}")
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                                            or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 (or None: until the context is full), "
                             f"got {self.max_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 and finite (0 = greedy), got {self.temperature}")
        if 0 < self.temperature < 1e-5:
            # Dividing logits by it overflows to inf; vLLM's floor is the same.
            raise ValueError(f"temperature must be 0 (greedy) or >= 1e-05, got {self.temperature}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (off) or >= 1, got {self.top_k}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids (integers >= 0), got {self.stop_token_ids!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _finite(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        if not _finite(self.repetition_penalty) or not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2] (1 = off), got {self.repetition_penalty}")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if not _count(self.min_tokens) or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _count(value) or value > MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] (the top log probabilities "
                                 f"returned beside the chosen token's) or None, got {value!r}")
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(_count(t) for t in ids):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids (integers >= 0), "
                                 f"got {ids!r}")
            self.allowed_token_ids = sorted(set(ids))
        if self.truncate_prompt_tokens is not None and (
                not _count(self.truncate_prompt_tokens) and self.truncate_prompt_tokens != -1
                or self.truncate_prompt_tokens == 0):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 (keep the prompt's last that many "
                             f"tokens) or -1 (as many as the context holds), got {self.truncate_prompt_tokens!r}")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(
                    isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of words (non-empty strings), got {self.bad_words!r}")
            self.bad_words = list(self.bad_words)
        for name in ("skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not self.detokenize and self.stop:
            raise ValueError("detokenize=False leaves no text to find stop strings in; drop stop or detokenize")
        if self.guided_decoding is not None:  # vLLM's older name
            if self.structured_outputs is not None:
                raise ValueError("structured_outputs and guided_decoding are the same setting (the older name); "
                                 "give one")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if self.structured_outputs is not None:
            from kiln.engine.structured_output import StructuredOutputsParams

            self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
            if self.ignore_eos:
                raise ValueError("ignore_eos contradicts structured output: a finished document ends with EOS; "
                                 "drop ignore_eos")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def top_k_or_none(self) -> int | None:
        """The top-k cut, or None when off (0 or -1)."""
        return self.top_k if self.top_k > 0 else None


def _logit_bias(bias) -> dict[int, float]:
    """{token id: added to its logit}; OpenAI's JSON keys are strings of ids."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must map token ids to numbers in [-100, 100], got {bias!r}")
    checked = {}
    for token, value in bias.items():
        if isinstance(token, str) and token.strip().isdigit():
            token = int(token)
        if not _count(token) or not _finite(value) or not -100 <= value <= 100:
            raise ValueError(f"logit_bias must map token ids to numbers in [-100, 100], got {token!r}: {value!r}")
        checked[token] = float(value)
    return checked


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
