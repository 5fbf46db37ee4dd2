"""The OpenAI wire format: request bodies (validated) and response bodies.

Requests are strict about types (a string where a number belongs is a 400, not a silent
conversion) and lenient about unknown fields, which are ignored as OpenAI's clients send
more than kiln reads; null means "not set". Value rules (max_tokens >= 1, temperature >= 0,
...) live in SamplingParams, the one place that defines them.
"""

from __future__ import annotations

import time
import uuid
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, model_validator


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        # OpenAI's API reads null as "not set", and some clients send every field.
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, the usage so far on every chunk


class _SamplingFields(_Request):
    """The fields /v1/completions and /v1/chat/completions share."""
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # Not in OpenAI's API; the names vLLM uses, so existing clients can pass them in extra_body.
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    bad_words: list[str] | None = None
    n: int = 1
    # Structured output: OpenAI's response_format ({"type": "json_object"} or {"type": "json_schema",
    # "json_schema": {"schema": ...}}), vLLM's structured_outputs object and its older guided_* fields.
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    # In OpenAI's API but not (yet) in kiln: accepted only at their neutral values, so a
    # client that asks for them gets an error instead of silently different behaviour.
    NEUTRAL: ClassVar[dict[str, tuple]] = {}

    def unsupported_field(self) -> str | None:
        """The first field set to a value kiln cannot honour, if any."""
        for name, neutral in self.NEUTRAL.items():
            if getattr(self, name) not in neutral:
                return name
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    # vLLM's extension: the choice also carries the prompt's and the output's token ids (a stream
    # sends the prompt's in its first chunk and each chunk's new tokens, text or not).
    return_token_ids: bool = False
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)  # the top tokens per token, beside the chosen one
    best_of: int | None = None
    suffix: str | None = None

    NEUTRAL: ClassVar[dict[str, tuple]] = {**_SamplingFields.NEUTRAL, "best_of": (None, 1),
                                           "suffix": (None,)}

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data):
        # Without this, an image part fails the union as "Input should be a valid string".
        parts = data.get("content") if isinstance(data, dict) else None
        if isinstance(parts, list):
            for part in parts:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(f"content parts of type {kind!r} are not supported: kiln serves text-only "
                                     f"models; send text parts or a string")
        return data

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # newer name for max_tokens; wins when both are set
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)  # needs logprobs: true
    tools: list[dict] | None = None

    return_token_ids: bool = False  # vLLM's extension; kiln has it on /v1/completions only
    # vLLM's chat-template options (Tokenizer.apply_chat_template)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None

    NEUTRAL: ClassVar[dict[str, tuple]] = {**_SamplingFields.NEUTRAL, "tools": (None, []),
                                           "return_token_ids": (False,)}

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the model's chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # unset: on for a prompt, off for messages (the template writes them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    """vLLM's /detokenize."""
    model: str | None = None
    tokens: list[int]


# ---- responses ----

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None  # OpenAI's field; null, as vLLM sends it


class CompletionLogprobs(BaseModel):
    """/v1/completions' legacy shape: per token its text, its log probability, the top ones by
    text, and where its text starts in the choice's text."""
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class CompletionChoiceWithTokens(CompletionChoice):
    """A choice of a request with return_token_ids (a stream's prompt ids: its first chunk only)."""
    prompt_token_ids: list[int] | None = None
    token_ids: list[int]


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[SerializeAsAny[CompletionChoice]]  # a CompletionChoiceWithTokens keeps its ids
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kiln"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
