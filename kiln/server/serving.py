"""OpenAI semantics over AsyncEngine: request -> prompt ids and SamplingParams -> response or SSE stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kiln.engine.async_engine import AsyncEngine, EngineNotReady, RequestAborted
from kiln.engine.llm_engine import truncated
from kiln.engine.outputs import CompletionOutput, RequestOutput
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.structured_output import StructuredOutputsParams
from kiln.server.errors import APIError, error_body
from kiln.server.metrics import RequestTimer, ServerMetrics
from kiln.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                  ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, ChatTokenLogprob,
                                  CompletionChoice, CompletionChoiceWithTokens, CompletionLogprobs, CompletionRequest,
                                  CompletionResponse, Delta, DetokenizeRequest, DetokenizeResponse,
                                  TokenizeRequest, TokenizeResponse, TopLogprob, Usage, new_id)

_SAMPLING_FIELDS = ("n", "max_tokens", "temperature", "top_k", "top_p", "min_p", "stop", "seed", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "allowed_token_ids",
                    "truncate_prompt_tokens", "skip_special_tokens", "bad_words")


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics):
        self.engine, self.model_name, self.metrics = engine, model_name, metrics

    def check_ready(self) -> None:
        if not self.engine.ready:
            reason = self.engine.not_ready_reason()
            raise APIError(503, reason, code="not_ready", headers={"Retry-After": "1"})

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self._check_request(req)
        tokenizer = self._tokenizer("chat completions need a tokenizer and chat template; "
                                    "send token ids to /v1/completions")
        # Templating and tokenizing a long conversation take a while: not on the event loop.
        prompt_ids = await asyncio.to_thread(_encode_chat, tokenizer, req)
        max_tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return await self._run(req, raw, "chat", [prompt_ids], "messages", max_tokens, max_tokens_param)

    async def complete(self, req: CompletionRequest, raw: Request) -> Response:
        self._check_request(req)
        # Several prompts (a list of strings or of token-id lists) run side by side, as in OpenAI's API.
        several = isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], (str, list))
        prompts = list(req.prompt) if several else [req.prompt]
        texts = [prompt if isinstance(prompt, str) else None for prompt in prompts]
        if any(isinstance(prompt, str) for prompt in prompts):
            tokenizer = self._tokenizer("this model has no tokenizer: send the prompt as token ids")
            prompts = await asyncio.to_thread(
                lambda: [tokenizer.encode(prompt) if isinstance(prompt, str) else prompt for prompt in prompts])
        return await self._run(req, raw, "completions", prompts, "prompt", req.max_tokens, "max_tokens",
                               texts if req.echo else None)

    async def _echo_texts(self, req: CompletionRequest, texts: list[str | None], whole: list[list[int]],
                          prompts: list[list[int]]) -> list[str]:
        """What echo writes back: each prompt as sent, or its ids as text where sent as ids or truncated."""
        if req.stream and req.logprobs is not None:
            raise APIError(400, "echo with logprobs is answered whole, not streamed; leave out stream (or logprobs)",
                           param="echo", code="unsupported_parameter")
        tokenizer = self._tokenizer("echo needs the model's tokenizer to write the prompt back as text")
        return await asyncio.to_thread(lambda: [
            text if text is not None and len(ids) == len(sent) else tokenizer.decode(ids, False)
            for text, sent, ids in zip(texts, whole, prompts)])

    def _echo_logprobs(self, prompt_ids: list[int], prompt_entries: list, choice) -> CompletionLogprobs:
        """The prompt's log probabilities (none for its first token, which nothing predicts), then the choice's."""
        first = self.engine.engine.tokenizer.decode(prompt_ids[:1], False)
        result = CompletionLogprobs(tokens=[first], token_logprobs=[None], top_logprobs=[None], text_offset=[0])
        for ids, entries in ((prompt_ids[1:], prompt_entries[1:]), (choice.token_ids, choice.logprobs)):
            part = completion_logprobs(ids, entries, result.text_offset[-1] + len(result.tokens[-1]))
            result.tokens += part.tokens
            result.token_logprobs += part.token_logprobs
            result.top_logprobs += part.top_logprobs
            result.text_offset += part.text_offset
        return result

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """vLLM's /tokenize: the ids a prompt (or messages, through the chat template) becomes."""
        self._check_model(req.model)
        tokenizer = self._tokenizer("this model has no tokenizer to tokenize with")
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send a prompt or messages (one of the two)", param="prompt", code="invalid_value")

        if req.prompt is not None:
            tokens = await asyncio.to_thread(tokenizer.encode, req.prompt, req.add_special_tokens is not False)
        else:
            tokens = await asyncio.to_thread(_encode_chat, tokenizer, req, bool(req.add_special_tokens))
        strs = [tokenizer.backend.id_to_token(t) for t in tokens] if req.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=self.engine.engine.max_model_len, tokens=tokens,
                                token_strs=strs)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """vLLM's /detokenize: the text of token ids, special tokens included."""
        self._check_model(req.model)
        tokenizer = self._tokenizer("this model has no tokenizer to detokenize with")
        vocab = tokenizer.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token ids must lie in [0, {vocab}), got {bad}", param="tokens", code="invalid_value")
        return DetokenizeResponse(prompt=await asyncio.to_thread(tokenizer.decode, req.tokens, False))

    def _check_model(self, model: str | None) -> None:
        """Ready, and `model` (None: any) is the one served."""
        self.check_ready()
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist here; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")

    def _check_request(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        self._check_model(req.model)
        field = req.unsupported_field()
        if field is not None:
            raise APIError(400, f"{field}={getattr(req, field)!r} is not supported by kiln; leave it out",
                           param=field, code="unsupported_parameter")
        if getattr(req, "top_logprobs", None) and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")

    def _tokenizer(self, message_if_none: str):
        tokenizer = self.engine.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, message_if_none)
        return tokenizer

    async def _run(self, req, raw: Request, endpoint: str, prompts: list[list[int]], prompt_param: str,
                   max_tokens: int | None, max_tokens_param: str, echo: list[str | None] | None = None) -> Response:
        """Run the request's prompts (one, but for a /v1/completions list) as one response: prompt
        i's choice j is choice i * n + j, as in OpenAI's and vLLM's answers. echo (completions' echo:
        each prompt's text as sent, None where sent as ids): each choice starts with its prompt."""
        max_model_len = self.engine.engine.max_model_len
        # Cut before the length checks, as the engine would (vLLM's left truncation).
        whole, prompts = prompts, [truncated(p, req.truncate_prompt_tokens, max_model_len) for p in prompts]
        if echo is not None:
            echo = await self._echo_texts(req, echo, whole, prompts)
        params = []
        for i, prompt_ids in enumerate(prompts):
            which = "the prompt" if len(prompts) == 1 else f"prompt {i}"
            if len(prompt_ids) >= max_model_len:
                raise APIError(400, f"{which} has {len(prompt_ids)} tokens but the context holds "
                               f"{max_model_len} (max_model_len), prompt and output together; shorten the "
                               f"prompt", param=prompt_param, code="context_length_exceeded")
            room = max_model_len - len(prompt_ids)
            if max_tokens is not None and max_tokens > room:  # refused, as OpenAI and vLLM do, not cut short
                raise APIError(400, f"{max_tokens_param}={max_tokens} does not fit: {which} has {len(prompt_ids)} "
                               f"tokens and the context holds {max_model_len} (max_model_len), prompt and output "
                               f"together; ask for at most {room}, or leave {max_tokens_param} out to generate "
                               f"until the context is full", param=max_tokens_param, code="context_length_exceeded")
            # Left out, max_tokens is as much as the context leaves.
            params.append(_sampling_params(req, room if max_tokens is None else max_tokens, max_tokens_param,
                                           echo is not None))
        request_id = new_id("chatcmpl" if endpoint == "chat" else "cmpl")
        # The engine's ids are the response's, one a prompt where there are several.
        engine_ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        timer = self.metrics.timer(endpoint, sum(map(len, prompts)))
        streams = []
        try:
            for prompt_ids, prompt_params, engine_id in zip(prompts, params, engine_ids):
                streams.append(await self.engine.add_request(prompt_ids, prompt_params, engine_id))
        except BaseException as e:  # a refused prompt, or a cancel (the client left) while queueing
            for engine_id in engine_ids[:len(streams)]:  # the prompts already queued
                self.engine.abort(engine_id)
            if isinstance(e, EngineNotReady):
                raise APIError(503, str(e), code="not_ready") from None
            if not isinstance(e, ValueError):
                raise
            field = str(e).split()[0]  # the engine's messages start with what they are about
            if field.startswith("structured"):  # the grammar did not compile
                field = structured_output(req)[1]
            elif field not in _SAMPLING_FIELDS:
                field = prompt_param
            raise APIError(400, str(e) if len(prompts) == 1 else f"prompt {len(streams)}: {e}", param=field) from None
        n = params[0].n
        outputs = streams[0] if len(streams) == 1 else _side_by_side(streams, request_id, n)
        if req.stream:
            stream = _ChatStream if endpoint == "chat" else _CompletionStream
            events = stream(request_id, self.model_name, req.include_usage, n, params[0], prompts,
                            getattr(req, "return_token_ids", False), echo, req.continuous_usage)
            return StreamingResponse(events.run(outputs, timer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        final = await _last_output(outputs, raw, timer)
        if final is None:  # the client left; nobody reads this
            return Response(status_code=499)
        usage = Usage.of(sum(map(len, prompts)), sum(len(c.token_ids) for c in final.outputs))
        if endpoint == "chat":
            choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text), finish_reason=c.finish_reason,
                                  logprobs=chat_logprobs(c.token_ids, c.logprobs, params[0].logprobs))
                       for c in final.outputs]
            body = ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage)
        else:
            choices = []
            # _side_by_side's prompt_logprobs are each prompt's
            prompt_logprobs = [final.prompt_logprobs] if len(prompts) == 1 else final.prompt_logprobs
            for c in final.outputs:
                prompt = c.index // n
                text, logprobs = c.text, completion_logprobs(c.token_ids, c.logprobs, 0)
                if echo is not None:
                    text = echo[prompt] + c.text
                    if logprobs is not None:
                        logprobs = self._echo_logprobs(prompts[prompt], prompt_logprobs[prompt], c)
                if req.return_token_ids:
                    choices.append(CompletionChoiceWithTokens(index=c.index, text=text, finish_reason=c.finish_reason,
                                                              logprobs=logprobs, prompt_token_ids=prompts[prompt],
                                                              token_ids=list(c.token_ids)))
                else:
                    choices.append(CompletionChoice(index=c.index, text=text, finish_reason=c.finish_reason,
                                                    logprobs=logprobs))
            body = CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage)
        return JSONResponse(body.model_dump())


def _encode_chat(tokenizer, req: ChatCompletionRequest | TokenizeRequest, add_special_tokens: bool = False) -> list[int]:
    """The request's messages through the chat template, with its template options, as ids."""
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(400, "continue_final_message continues the last message and add_generation_prompt opens a "
                       "new one: set add_generation_prompt to false with it", param="continue_final_message",
                       code="invalid_value")
    try:
        return tokenizer.encode_chat([m.as_template_input() for m in req.messages], add_special_tokens,
                                     add_generation_prompt=req.add_generation_prompt,
                                     continue_final_message=req.continue_final_message,
                                     template_kwargs=req.chat_template_kwargs)
    except Exception as e:  # the template runs on what the request sent (chat_template_kwargs too): any error is its
        raise APIError(400, f"the chat template refused the messages: {type(e).__name__}: {e}",
                       param="messages") from None


_STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar")


def structured_output(req) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's structured output, whichever of OpenAI's or vLLM's fields says it, and the field."""
    given = [name for name in _STRUCTURED_FIELDS if getattr(req, name) is not None
             and getattr(req, name) != {"type": "text"}]
    if not given:
        return None, None
    if len(given) > 1:
        raise APIError(400, f"structured output is given twice ({', '.join(given)}); give one", param=given[1],
                       code="invalid_value")
    name, value = given[0], getattr(req, given[0])
    try:
        if name == "response_format":
            kind = value.get("type")
            if kind == "json_object":
                return StructuredOutputsParams(json_object=True), name
            if kind == "json_schema" and isinstance(value.get("json_schema"), dict) \
                    and "schema" in value["json_schema"]:
                return StructuredOutputsParams(json=value["json_schema"]["schema"]), name
            raise ValueError(f"response_format must be {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} or "
                             f"{{\"type\": \"json_schema\", \"json_schema\": {{\"schema\": ...}}}}, got {value!r}")
        if name == "structured_outputs":
            return StructuredOutputsParams.of(value), name
        field = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}[name]
        return StructuredOutputsParams(**{field: value}), name
    except ValueError as e:
        raise APIError(400, str(e), param=name, code="invalid_value") from None


def _sampling_params(req, max_tokens: int, max_tokens_param: str, echo: bool = False) -> SamplingParams:
    structured, structured_param = structured_output(req)
    try:
        return SamplingParams(n=req.n, max_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k,
                              top_p=req.top_p, min_p=req.min_p, seed=req.seed, stop=req.stop or [],
                              stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                              include_stop_str_in_output=req.include_stop_str_in_output,
                              presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                              repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias,
                              min_tokens=req.min_tokens, logprobs=req.num_logprobs, structured_outputs=structured,
                              allowed_token_ids=req.allowed_token_ids, truncate_prompt_tokens=req.truncate_prompt_tokens,
                              skip_special_tokens=req.skip_special_tokens, bad_words=req.bad_words,
                              # echo's logprobs start with the prompt's
                              prompt_logprobs=req.num_logprobs if echo else None)
    except ValueError as e:
        # SamplingParams' messages start with the field they are about.
        message = str(e)
        field = message.split()[0]
        if field in ("structured", "ignore_eos") and structured_param is not None:
            raise APIError(400, message, param=structured_param, code="invalid_value") from None
        if field == "max_tokens" and max_tokens_param != field:  # the request said max_completion_tokens
            message = max_tokens_param + message.removeprefix(field)
        param = max_tokens_param if field == "max_tokens" else field if field in _SAMPLING_FIELDS else None
        raise APIError(400, message, param=param, code="invalid_value") from None


def _token_text(token: int, logprob) -> str:
    """A token as text in a logprobs answer: its decoded text, or token_id:<id> (vLLM's form)
    for a model without a tokenizer."""
    return logprob.decoded_token if logprob.decoded_token is not None else f"token_id:{token}"


def completion_logprobs(token_ids: list[int], entries: list[dict] | None, text_start: int) -> CompletionLogprobs | None:
    """/v1/completions' logprobs of `token_ids`, their text starting at `text_start` of the choice's."""
    if entries is None:
        return None
    result, offset = CompletionLogprobs(), text_start
    for token, entry in zip(token_ids, entries):
        text = _token_text(token, entry[token])
        result.tokens.append(text)
        result.token_logprobs.append(entry[token].logprob)
        result.top_logprobs.append({_token_text(t, lp): lp.logprob for t, lp in entry.items()})
        result.text_offset.append(offset)
        offset += len(text)
    return result


def chat_logprobs(token_ids: list[int], entries: list[dict] | None, num: int | None) -> ChatLogprobs | None:
    """Chat's logprobs of `token_ids`: each token with its `num` most likely alternatives."""
    if entries is None:
        return None

    def top(token: int, logprob) -> TopLogprob:
        text = _token_text(token, logprob)
        return TopLogprob(token=text, logprob=logprob.logprob, bytes=list(text.encode()))

    content = []
    for token, entry in zip(token_ids, entries):
        chosen = top(token, entry[token])
        ranked = sorted((lp.rank, t, lp) for t, lp in entry.items() if lp.rank <= num)
        content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=[top(t, lp) for _, t, lp in ranked]))
    return ChatLogprobs(content=content)


async def _side_by_side(streams: list[AsyncIterator[RequestOutput]], request_id: str,
                        n: int) -> AsyncIterator[RequestOutput]:
    """Several prompts' outputs as one request's: each item holds every prompt's newest choices,
    prompt i's choice j as choice i * n + j (a prompt with no output yet: empty ones), finished
    once all are, and in prompt_logprobs each prompt's. Closed early (a disconnect), it aborts the
    prompts still running."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(stream):  # closing a stream aborts its unfinished request
                async for out in stream:
                    queue.put_nowait((i, out))
        except Exception as e:  # RequestAborted: the consumer raises it
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    latest: list[RequestOutput | None] = [None] * len(streams)
    try:
        while not all(out is not None and out.finished for out in latest):
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            latest[i] = item
            choices = []
            for prompt, out in enumerate(latest):
                choices += [CompletionOutput(prompt * n + j, "", []) for j in range(n)] if out is None else \
                    [replace(c, index=prompt * n + c.index) for c in out.outputs]
            yield RequestOutput(request_id, None, [], choices, all(o is not None and o.finished for o in latest),
                                prompt_logprobs=[o.prompt_logprobs if o is not None else None for o in latest])
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _last_output(outputs: AsyncIterator[RequestOutput], raw: Request,
                       timer: RequestTimer) -> RequestOutput | None:
    """Run a request to the end; None if the client disconnected first (the request is aborted)."""
    async with contextlib.aclosing(outputs):
        try:
            async for out in outputs:
                timer.output(out)
                if out.finished:
                    return out
                if await raw.is_disconnected():
                    timer.aborted()
                    return None
        except RequestAborted as e:
            timer.aborted()
            raise APIError(503, str(e), code="aborted") from None
    return None


class _SSEStream:
    """Server-sent events of one request: text deltas per choice, each choice's finish reason,
    usage, then [DONE]."""

    def __init__(self, request_id: str, model: str, include_usage: bool, n: int, params: SamplingParams,
                 prompts: list[list[int]], return_token_ids: bool = False, echo: list[str] | None = None,
                 continuous_usage: bool = False):
        """n choices a prompt (choice i is prompt i // n's); params: any prompt's (they differ in
        max_tokens alone)."""
        self.request_id, self.model, self.include_usage = request_id, model, include_usage
        self.continuous_usage = continuous_usage
        self.num_prompt_tokens, self.n = sum(map(len, prompts)), n * len(prompts)
        self.num_logprobs = params.logprobs  # None: no logprobs in the chunks
        # With return_token_ids every step's tokens go out, text or not (a model without a tokenizer
        # has none); the prompt's ids ride on each choice's first chunk.
        self.return_token_ids = return_token_ids
        self.prompts, self.choices_per_prompt = prompts, n
        self.echo = echo  # completions' echo: each prompt's text, sent before its choices' tokens
        # Text that may be the start of a stop string is held back until it is known not to
        # be one: the engine cuts a stop string out of the text only once it is complete.
        self.holdback = max((len(s) for s in params.stop), default=1) - 1

    async def run(self, outputs: AsyncIterator[RequestOutput], timer: RequestTimer) -> AsyncIterator[str]:
        sent, sent_tokens, closed = [0] * self.n, [0] * self.n, [False] * self.n
        final = None
        # Every step's tokens go out when they carry ids or log probabilities; else only text.
        per_token = self.return_token_ids or self.num_logprobs is not None
        try:
            for index in range(self.n):
                first = self.first_chunk(index)
                if first is not None:
                    yield self._event(first, 0)
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    timer.output(out)
                    so_far = sum(len(c.token_ids) for c in out.outputs)
                    for c in out.outputs:
                        i, done = c.index, c.finish_reason is not None
                        end = len(c.text) if done else max(sent[i], len(c.text) - self.holdback)
                        if end > sent[i] or (per_token and len(c.token_ids) > sent_tokens[i]):
                            entries = c.logprobs[sent_tokens[i]:] if c.logprobs is not None else None
                            prompt_ids = self.prompts[i // self.choices_per_prompt] \
                                if self.return_token_ids and sent_tokens[i] == 0 else None
                            yield self._event(self.text_chunk(i, c.text[sent[i]:end], list(c.token_ids[sent_tokens[i]:]),
                                                              entries, sent[i], prompt_ids), so_far)
                            sent[i], sent_tokens[i] = max(sent[i], end), len(c.token_ids)
                        if done and not closed[i]:
                            closed[i] = True
                            yield self._event(self.finish_chunk(i, c.finish_reason), so_far)
                    final = out
            if self.include_usage:
                completion = sum(len(c.token_ids) for c in final.outputs)
                yield _event(self.usage_chunk(Usage.of(self.num_prompt_tokens, completion)))
            yield "data: [DONE]\n\n"
        except RequestAborted as e:
            yield f"data: {json.dumps(error_body(503, str(e), code='aborted'))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            # Cancelled (the client went away) or aborted: the engine thread frees the blocks.
            if final is None or not final.finished:
                timer.aborted()

    def _event(self, chunk, completion_tokens: int) -> str:
        """The chunk as an event; with continuous usage, the tokens so far ride on it."""
        if self.continuous_usage:
            chunk.usage = Usage.of(self.num_prompt_tokens, completion_tokens)
        return _event(chunk)

    def first_chunk(self, index: int):
        raise NotImplementedError

    def text_chunk(self, index: int, text: str, token_ids: list[int], logprobs: list[dict] | None, text_start: int,
                   prompt_ids: list[int] | None):
        """A chunk of choice `index`'s new text (from `text_start` of its whole); `token_ids`, its tokens
        since its last chunk, go out with return_token_ids (and the prompt's with its first), and their
        `logprobs` where asked for."""
        raise NotImplementedError

    def finish_chunk(self, index: int, reason: str):
        raise NotImplementedError

    def usage_chunk(self, usage: Usage):
        raise NotImplementedError


class _ChatStream(_SSEStream):
    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, model=self.model, choices=choices, usage=usage)

    def first_chunk(self, index):
        return self._chunk([ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""))])

    def text_chunk(self, index, text, token_ids, logprobs, text_start, prompt_ids):
        return self._chunk([ChatChunkChoice(index=index, delta=Delta(content=text),
                                            logprobs=chat_logprobs(token_ids, logprobs, self.num_logprobs))])

    def finish_chunk(self, index, reason):
        return self._chunk([ChatChunkChoice(index=index, delta=Delta(), finish_reason=reason)])

    def usage_chunk(self, usage):
        return self._chunk([], usage)


class _CompletionStream(_SSEStream):
    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.request_id, model=self.model, choices=choices, usage=usage)

    def first_chunk(self, index):
        if self.echo is None:
            return None
        return self._chunk([CompletionChoice(index=index, text=self.echo[index // self.choices_per_prompt])])

    def text_chunk(self, index, text, token_ids, logprobs, text_start, prompt_ids):
        logprobs = completion_logprobs(token_ids, logprobs, text_start)
        if not self.return_token_ids:
            return self._chunk([CompletionChoice(index=index, text=text, logprobs=logprobs)])
        return self._chunk([CompletionChoiceWithTokens(index=index, text=text, logprobs=logprobs, token_ids=token_ids,
                                                       prompt_token_ids=prompt_ids)])

    def finish_chunk(self, index, reason):
        return self._chunk([CompletionChoice(index=index, text="", finish_reason=reason)])

    def usage_chunk(self, usage):
        return self._chunk([], usage)


def _event(chunk) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"
