"""The checkpoint's tokenizer and chat template, from tokenizer.json or GGUF metadata."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, Tokenizer as Backend, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

# llama.cpp's pre-tokenizer names -> how the text is split before BPE merges.
_GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
                 r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
_BYTES = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
_PRE_TOKENIZERS = {
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    # SmolLM2 (and StarCoder-style vocabularies): every digit on its own, then GPT-2 splits.
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
    "llama-bpe": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated"), _BYTES]),
}
# Qwen2/2.5/3: Llama 3's split with every digit on its own.
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
_PRE_TOKENIZERS["qwen2"] = lambda: pre_tokenizers.Sequence([
    pre_tokenizers.Split(Regex(_QWEN2_REGEX), behavior="isolated"), _BYTES])
_PRE_TOKENIZERS["starcoder"] = _PRE_TOKENIZERS["smollm"]
_PRE_TOKENIZERS["llama3"] = _PRE_TOKENIZERS["llama-bpe"]

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types that are special tokens


class Tokenizer:
    def __init__(self, backend: Backend, chat_template: str | None, bos_token: str | None,
                 eos_token: str | None, eos_token_ids: tuple[int, ...]):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.eos_token_ids = eos_token_ids
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, template_kwargs: dict | None = None) -> str:
        """The conversation as the model's template writes it. add_generation_prompt: end with the
        assistant's turn opened; continue_final_message: end inside the last message (its turn left
        open, for the model to go on with it); template_kwargs: more variables for the template
        (e.g. Qwen3's enable_thinking), as HF's and vLLM's chat_template_kwargs."""
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message: it continues the last message, add_generation_prompt opens a "
                             "new one; set add_generation_prompt to false with it")
        if not self.chat_template:
            raise ValueError("this checkpoint has no chat template; send a plain prompt "
                             "(kiln generate --no-chat, or /v1/completions)")
        if self._template is None:
            # The environment transformers renders templates in, so prompts match HF's.
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent, ensure_ascii=False)
            self._template = env.from_string(self.chat_template)
        text = self._template.render(**{"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                                        **(template_kwargs or {}), "messages": messages,
                                        "add_generation_prompt": add_generation_prompt})
        return _cut_after_final_message(text, messages) if continue_final_message else text

    def encode_chat(self, messages: list[dict], add_special_tokens: bool = False, **template_options) -> list[int]:
        """apply_chat_template's text (template_options: its keyword arguments) as ids."""
        # The template writes any BOS itself; adding it again would double it.
        return self.encode(self.apply_chat_template(messages, **template_options), add_special_tokens)

    @classmethod
    def from_folder(cls, folder: Path, eos_token_ids: tuple[int, ...]) -> "Tokenizer":
        backend = Backend.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        template = config.get("chat_template")
        template_file = folder / "chat_template.jinja"
        if template is None and template_file.exists():
            template = template_file.read_text()
        if isinstance(template, list):  # named templates: take the default
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        if eos is not None and not eos_token_ids:
            eos_token_ids = (backend.token_to_id(eos),)
        return cls(backend, template, bos, eos, eos_token_ids)

    @classmethod
    def from_gguf_fields(cls, fields: dict, architecture: str | None = None) -> "Tokenizer":
        """From llama.cpp's tokenizer.ggml.* metadata: a byte-level BPE vocabulary ('gpt2') or a
        SentencePiece one ('llama': Llama 2, Mistral, Gemma)."""
        model = fields.get("tokenizer.ggml.model")
        tokens = fields["tokenizer.ggml.tokens"]
        if model == "gpt2":
            backend = _byte_level_bpe(fields, tokens)
        elif model == "llama":
            backend = _sentencepiece_bpe(fields, tokens, gemma=architecture == "gemma2")
        else:
            raise ValueError(f"GGUF tokenizer model {model!r} is not supported; kiln builds byte-level BPE "
                             f"('gpt2') and SentencePiece ('llama') tokenizers from GGUF")
        types = fields.get("tokenizer.ggml.token_type", [])
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                    for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)])
        bos_id, eos_id = fields.get("tokenizer.ggml.bos_token_id"), fields.get("tokenizer.ggml.eos_token_id")
        bos = tokens[bos_id] if bos_id is not None else None
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
        if fields.get("tokenizer.ggml.add_bos_token", model == "llama") and bos is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1", special_tokens=[(bos, bos_id)])
        eos = tokens[eos_id] if eos_id is not None else None
        return cls(backend, fields.get("tokenizer.chat_template"), bos, eos,
                   (eos_id,) if eos_id is not None else ())


def _byte_level_bpe(fields: dict, tokens: list[str]) -> Backend:
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
    backend = Backend(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                          fuse_unk=False, byte_fallback=False))
    pre = fields.get("tokenizer.ggml.pre", "gpt2")
    if pre not in _PRE_TOKENIZERS:
        # Another split would give other token ids for the same text: refused, not guessed.
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; kiln knows "
                         f"{', '.join(sorted(_PRE_TOKENIZERS))}")
    backend.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(fields: dict, tokens: list[str], gemma: bool) -> Backend:
    """SentencePiece's BPE as a `tokenizers` BPE: bytes outside the vocabulary fall back to <0xNN>
    tokens, and a space is the piece "▁". The files hold no merges: every split of a token into two
    tokens of the vocabulary is a merge, the best-scoring token's first; Gemma's scores do not
    follow its merge order, its tokens' order in the file does (as transformers reads Gemma files)."""
    if gemma:  # Gemma stores tokens of two or more spaces as spaces; its normalizer looks for "▁"s
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    else:
        scores = [float(x) for x in fields["tokenizer.ggml.scores"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    candidates = []
    for token, score in zip(tokens, scores):
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        candidates += [(left, right, score) for left, right in sorted(splits, key=lambda m: (vocab[m[0]], vocab[m[1]]))]
    # Best score first; between equal scores the longer left piece, then the longer right one.
    candidates.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    unk_id = fields.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else ("<unk>" if "<unk>" in vocab else None)
    backend = Backend(BPE(vocab=vocab, merges=[(left, right) for left, right, _ in candidates], unk_token=unk,
                          fuse_unk=True, byte_fallback=True))
    if gemma:
        backend.normalizer = normalizers.Replace(" ", "▁")
        backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    else:  # Llama 2 / Mistral: a "▁" before the first word, none after special tokens
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(content=" ", left=1)])
    return backend


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _cut_after_final_message(text: str, messages: list[dict]) -> str:
    """The rendered conversation up to the end of its last message's content (what follows closes
    that turn). A template may trim the message's edge whitespace: then the cut is after the
    trimmed content."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs a last message with text to continue")
    start = text.rfind(final.strip())
    if start < 0:
        raise ValueError("continue_final_message: the chat template changed the last message's text, so where it "
                         "ends cannot be found; send the conversation without continue_final_message")
    kept = final.lstrip()  # as written, trailing whitespace included, where the template kept it
    return text[:start + len(kept)] if text[start:start + len(kept)] == kept else text[:start + len(final.strip())]


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)
