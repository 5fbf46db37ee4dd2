"""Structured output: a grammar per sequence (a JSON schema, any JSON object, a regex, a choice
of strings, or a Lark grammar) that decides which tokens its next step may sample.

The grammars run in llguidance (guidance-ai's Rust library, one of vLLM's backends): it has no
dependencies, builds its view of the vocabulary from the tokenizers JSON kiln already has, and
computes a step's token mask in about a millisecond. kiln asks it for one bitmask row per
structured sequence (32 tokens an int32), applies the rows to the logits on the device, and
feeds each sampled token back. The grammar ends in EOS, so a finished document stops the
sequence. Because the mask of step n+1 needs step n's token, the engine reads a step's tokens
before it schedules the next while a structured request runs (no lookahead then).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch


# JSON as json.dumps writes it, with no free whitespace: with it, a small model can pad a document
# with newlines and tabs until max_tokens (seen with SmolLM2). A schema's "x-guidance" object
# overrides these (e.g. {"whitespace_flexible": true}).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's StructuredOutputsParams; its older name is
    GuidedDecodingParams). Exactly one field is set."""

    json: dict | str | None = None  # a JSON schema (dict or its text)
    regex: str | None = None
    choice: list[str] | None = None  # one of these strings, exactly
    grammar: str | None = None  # a Lark grammar (llguidance's dialect)
    json_object: bool | None = None  # any JSON object

    def __post_init__(self):
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured output needs exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured output json must be a JSON schema (an object or its text), got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured output {name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError(f"structured output choice must be a non-empty list of non-empty strings, "
                             f"got {self.choice!r}")

    @classmethod
    def of(cls, value) -> "StructuredOutputsParams":
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise ValueError(f"structured output has unknown key(s) {', '.join(unknown)}; valid: "
                                 f"{', '.join(cls.__dataclass_fields__)}")
            return cls(**value)
        raise ValueError(f"structured output must be a StructuredOutputsParams or a dict of its fields, got {value!r}")

    def grammar_text(self) -> str:
        """The llguidance grammar for these params (an invalid schema or regex is found later,
        when a matcher is made from it)."""
        from llguidance import LLMatcher

        if self.json_object:
            return LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=JSON_LAYOUT)
        if self.json is not None:
            schema = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            # Lark string literals take JSON's escapes: each choice exactly, nothing else.
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return LLMatcher.grammar_from_lark(self.grammar)


GuidedDecodingParams = StructuredOutputsParams


class GrammarCompiler:
    """One engine's grammars: llguidance's view of the tokenizer (built on first use: ~0.2 s for
    a 49k vocabulary) and a matcher per structured sequence."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lltokenizer = None

    def matcher(self, params: StructuredOutputsParams):
        from llguidance import LLMatcher, LLTokenizer

        if self._lltokenizer is None:
            self._lltokenizer = LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                            eos_token=list(self.tokenizer.eos_token_ids))
        matcher = LLMatcher(self._lltokenizer, params.grammar_text())
        if matcher.is_error():
            raise ValueError(f"structured output: the grammar is not valid: {matcher.get_error()}")
        return matcher


def token_bitmask(matchers: list, vocab_size: int) -> torch.Tensor:
    """One row per matcher (None: every token allowed) of 32-token int32 words, on the CPU."""
    from llguidance.torch import fill_next_token_bitmask

    mask = torch.full((len(matchers), -(-vocab_size // 32)), -1, dtype=torch.int32)
    for i, matcher in enumerate(matchers):
        if matcher is not None:
            fill_next_token_bitmask(matcher, mask, i)
    return mask


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bitmask -> [rows, vocab_size] bool (on the bitmask's device)."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=bitmask.device)) & 1
    return bits.flatten(1)[:, :vocab_size].bool()
