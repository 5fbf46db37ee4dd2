"""`kiln serve` as clients see it: one real server process on loopback, the official openai client."""

import asyncio
import http.client
import json
import re
import time

import pytest

openai = pytest.importorskip("openai")

from server_process import ServerProcess  # noqa: E402

from kiln import __version__ as kiln_version  # noqa: E402

MODEL = "smollm2"
MAX_MODEL_LEN = 1024
PROMPTS = [
    "The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are",
    "My favourite food is", "In 1969, astronauts", "Water boils at", "The quick brown fox",
    "To make a cup of tea,", "The largest planet in the solar system", "Machine learning is",
    "Dear diary, today", "The recipe calls for", "Photosynthesis converts", "A haiku about autumn:",
    "The stock market",
]
GREEDY = dict(max_tokens=16, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(MODEL, "--max-model-len", str(MAX_MODEL_LEN))  # `kiln serve MODEL`, as `vllm serve MODEL`
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, content: str, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)


def test_logprobs_completion_and_chat_streamed_or_not(client):
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                    logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens == 5
    assert lp.tokens[0] == " Paris" and all(v <= 0 for v in lp.token_logprobs)
    # Greedy: the chosen token is the most likely one; each entry has the two top tokens.
    assert all(max(top.values()) == chosen and len(top) == 2 for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

    chat = _chat(client, "What is the capital of France?", max_tokens=6, temperature=0.7, seed=3,
                 logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for token in content:
        assert len(token.top_logprobs) == 3 and token.bytes == list(token.token.encode())
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
        assert token.logprob <= token.top_logprobs[0].logprob

    chunks = list(_chat(client, "What is the capital of France?", max_tokens=6, temperature=0, logprobs=True,
                        stream=True, stream_options={"include_usage": True}))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(streamed) == chunks[-1].usage.completion_tokens and all(t.top_logprobs == [] for t in streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).startswith(streamed[0].token)


def test_n_choices_streamed_or_not(client):
    out = _chat(client, "Name a colour.", n=3, max_tokens=8, temperature=1.0, seed=4, logprobs=True)
    assert [c.index for c in out.choices] == [0, 1, 2] and all(c.finish_reason for c in out.choices)
    assert out.usage.completion_tokens == sum(len(c.logprobs.content) for c in out.choices)
    greedy = client.completions.create(model=MODEL, prompt="The capital of France is", n=2, max_tokens=6,
                                       temperature=0, logprobs=1)
    assert greedy.choices[0].text == greedy.choices[1].text and greedy.usage.completion_tokens == 12
    assert len(greedy.choices[1].logprobs.tokens) == 6
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", n=2, max_tokens=6,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts[0] == texts[1] == greedy.choices[0].text
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1]
    assert chunks[-1].usage.completion_tokens == 12


def test_structured_output_response_format_and_vllms_fields(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0,
                                                              "maximum": 10**9}},
              "required": ["city", "population"], "additionalProperties": False}
    out = _chat(client, "Tell me about Paris as JSON.", max_tokens=100, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    assert out.choices[0].finish_reason == "stop"
    city = json.loads(out.choices[0].message.content)
    assert set(city) == {"city", "population"} and isinstance(city["population"], int)
    anything = _chat(client, "Describe a person as JSON with a name, an age and a city.", max_tokens=80,
                     temperature=0, response_format={"type": "json_object"}, stream=True)
    assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in anything if c.choices)), dict)
    choice = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                       extra_body={"guided_choice": ["Paris", "Lyon"]})
    assert choice.choices[0].text in ("Paris", "Lyon")
    regex = client.completions.create(model=MODEL, prompt="A number:", max_tokens=8,
                                      extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert re.fullmatch("[0-9]{4}", regex.choices[0].text)


def test_penalties_bias_and_min_tokens_are_honoured(client):
    plain = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=8, temperature=0)
    first = plain.choices[0].text
    # A bias of -100 on the first token greedy chose moves the choice elsewhere.
    token = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=1, temperature=0,
                                      logprobs=0).choices[0].logprobs
    ids = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=1, temperature=0,
                                    extra_body={"return_token_ids": True}).choices[0]
    biased = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=8, temperature=0,
                                       logit_bias={str(ids.token_ids[0]): -100})
    assert not biased.choices[0].text.startswith(token.tokens[0]) and first.startswith(token.tokens[0])
    penalised = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=8, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=1.0,
                                          extra_body={"repetition_penalty": 1.5, "min_p": 0.05, "min_tokens": 8})
    assert penalised.usage.completion_tokens == 8


def test_health_is_503_with_the_phase_until_ready_then_200(server):
    status, body = server.before_ready["health"]
    assert status == 503 and body["status"] == "starting" and body["phase"] not in (None, "ready")
    status, body = server.before_ready["models"]
    assert status == 503 and body["error"]["code"] == "not_ready"
    status, body = server.get("/health")
    assert status == 200 and body["status"] == "ready" and body["phase"] == "ready"
    assert {"checkpoint", "weights"} <= set(body["phases_s"]) and body["ready_s"] > 0
    # The time between the named phases is a phase of its own: together they are the start.
    assert body["phases_s"]["other"] > 0 and abs(sum(body["phases_s"].values()) - body["ready_s"]) < 1e-6


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_chat_completion(client):
    out = _chat(client, "What is the capital of France?", max_tokens=32, temperature=0)
    choice = out.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason == "stop" and out.model == MODEL and out.object == "chat.completion"
    raw = client.chat.completions.with_raw_response.create(model=MODEL, max_tokens=2,
                                                           messages=[{"role": "user", "content": "hi"}])
    assert json.loads(raw.text)["system_fingerprint"] is None  # present, null, as vLLM sends it
    usage = out.usage
    assert usage.prompt_tokens > 10 and 0 < usage.completion_tokens <= 32
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion_with_text_token_ids_and_stop(client):
    free = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    assert free.choices[0].finish_reason == "length" and free.usage.completion_tokens == 12
    text = free.choices[0].text
    stop = text.split()[1]
    cut = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                                    temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and text.startswith(cut.choices[0].text)
    assert stop not in cut.choices[0].text
    ids = client.completions.create(model=MODEL, prompt=[504, 3458, 282, 4649, 314], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 5 and ids.usage.completion_tokens == 4


def test_return_token_ids_streams_every_step_tokens_and_all(client):
    """vLLM's return_token_ids: the choice carries the prompt's and the output's ids; a stream sends
    the prompt's in its first chunk and each chunk's new tokens, which add up to the whole answer."""
    prompt = [504, 3458, 282, 4649, 314]
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    assert whole.prompt_token_ids == prompt and len(whole.token_ids) == 8
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
    with_tokens = [c for c in chunks if c.finish_reason is None]
    assert with_tokens[0].prompt_token_ids == prompt and all(c.prompt_token_ids is None for c in with_tokens[1:])
    assert [t for c in with_tokens for t in c.token_ids] == whole.token_ids
    assert "".join(c.text for c in chunks) == whole.text
    with pytest.raises(openai.BadRequestError, match="return_token_ids"):
        _chat(client, "Hi", max_tokens=2, extra_body={"return_token_ids": True})


def test_several_prompts_in_one_completion_request(server, client):
    """OpenAI's list of prompts: prompt i's choice j is choice i * n + j, usage sums them all, a
    stream interleaves them; one refused prompt refuses the request and leaves nothing running."""
    prompts = ["The capital of France is", [504, 3458, 282, 4649, 314], "Once upon a time"]
    kwargs = dict(model=MODEL, n=2, max_tokens=6, temperature=0,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    texts = client.completions.create(model=MODEL, prompt=prompts[::2], n=2, max_tokens=6, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = [texts.choices[0].prompt_token_ids, prompts[1], texts.choices[2].prompt_token_ids]
    whole = client.completions.create(prompt=ids, **kwargs)  # token-id prompts, the same as text
    assert [c.index for c in whole.choices] == list(range(6))
    assert [c.prompt_token_ids for c in whole.choices] == [p for p in ids for _ in range(2)]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 6 for c in whole.choices)
    assert whole.usage.prompt_tokens == sum(map(len, ids)) and whole.usage.completion_tokens == 36
    assert [whole.choices[i].text for i in (0, 4)] == [texts.choices[i].text for i in (0, 2)]
    assert all(whole.choices[i].text == whole.choices[i + 1].text for i in (0, 2, 4))  # greedy: n equal choices
    assert whole.choices[0].text.startswith(" Paris")

    streamed, firsts = {i: "" for i in range(6)}, {}
    chunks = list(client.completions.create(prompt=ids, stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
            if choice.finish_reason is None:  # a chunk of tokens (the finish chunk has none)
                firsts.setdefault(choice.index, choice.prompt_token_ids)
    assert streamed == {c.index: c.text for c in whole.choices}
    assert firsts == {c.index: c.prompt_token_ids for c in whole.choices}
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == list(range(6))
    assert chunks[-1].usage == whole.usage

    with pytest.raises(openai.BadRequestError, match="prompt 1") as info:
        client.completions.create(model=MODEL, prompt=[[504, 3458], [504, 10**6]], max_tokens=400,
                                  extra_body={"ignore_eos": True})
    assert info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match="prompt 1 has") as info:
        client.completions.create(model=MODEL, prompt=["Hi", "hello " * MAX_MODEL_LEN], max_tokens=2)
    assert info.value.body["code"] == "context_length_exceeded"
    metrics = _wait_for(server, lambda m: m["kiln_kv_blocks_in_use"] == 0 and m["kiln_requests_running"] == 0)
    assert metrics["kiln_kv_blocks_in_use"] == 0 and metrics["kiln_requests_running"] == 0


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_tokenize_and_detokenize_as_vllm_answers_them(server, client):
    status, plain = _post(server, "/tokenize", {"model": MODEL, "prompt": "The capital of France is"})
    assert status == 200 and plain["count"] == len(plain["tokens"]) and plain["max_model_len"] == MAX_MODEL_LEN
    ids = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1,
                                    extra_body={"return_token_ids": True}).choices[0].prompt_token_ids
    assert plain["tokens"] == ids and plain["token_strs"] is None  # what a completion's prompt becomes
    status, named = _post(server, "/tokenize", {"prompt": "The capital of France is", "return_token_strs": True})
    assert named["tokens"] == ids and len(named["token_strs"]) == len(ids) and named["token_strs"][1] == "Ġcapital"
    status, back = _post(server, "/detokenize", {"model": MODEL, "tokens": ids})
    assert status == 200 and back["prompt"] == "The capital of France is"

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    status, chat = _post(server, "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200 and chat["count"] == _chat(client, messages[0]["content"], max_tokens=1).usage.prompt_tokens
    status, without = _post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert without["tokens"] == chat["tokens"][:without["count"]] and without["count"] < chat["count"]
    status, text = _post(server, "/detokenize", {"tokens": chat["tokens"]})
    assert text["prompt"].startswith("<|im_start|>")  # special tokens kept

    for path, body, param in [("/tokenize", {"model": MODEL}, "prompt"),
                              ("/tokenize", {"prompt": "hi", "messages": messages}, "prompt"),
                              ("/detokenize", {"tokens": [1, 49152]}, "tokens"),
                              ("/detokenize", {"tokens": "hi"}, "tokens")]:
        status, error = _post(server, path, body)
        assert status == 400 and error["error"]["param"] == param, (path, body, error)
    status, error = _post(server, "/tokenize", {"model": "gpt-4o", "prompt": "hi"})
    assert status == 404 and error["error"]["code"] == "model_not_found"
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("GET", "/version")
    assert json.loads(conn.getresponse().read()) == {"version": kiln_version}
    conn.close()


def test_chat_continues_the_final_message_and_passes_template_variables(server, client):
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                         extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert out.choices[0].message.content.startswith(" Paris")
    status, open_turn = _post(server, "/tokenize", {"messages": messages, "continue_final_message": True,
                                                    "add_generation_prompt": False})
    status, closed = _post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert closed["tokens"][:open_turn["count"]] == open_turn["tokens"] and closed["count"] > open_turn["count"]
    assert out.usage.prompt_tokens == open_turn["count"]
    # SmolLM2's template reads no variables: unknown ones change nothing, as with transformers.
    status, same = _post(server, "/tokenize", {"messages": messages[:1], "chat_template_kwargs": {"x": 1}})
    assert same["tokens"] == _post(server, "/tokenize", {"messages": messages[:1]})[1]["tokens"]


def test_vllm_s_prompt_truncation_and_allowed_tokens(client):
    cut = client.completions.create(model=MODEL, prompt=[504, 3458, 282, 4649, 314], max_tokens=2, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 3, "return_token_ids": True}).choices[0]
    assert cut.prompt_token_ids == [282, 4649, 314]
    long = "hello " * (MAX_MODEL_LEN + 10)  # fits once cut
    assert client.completions.create(model=MODEL, prompt=long, max_tokens=2,
                                     extra_body={"truncate_prompt_tokens": 100}).usage.prompt_tokens == 100
    allowed = [330, 1186, 2001]
    out = client.completions.create(model=MODEL, prompt="Pick one:", max_tokens=4, temperature=1.0, seed=1,
                                    extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    assert set(out.choices[0].token_ids) <= set(allowed)
    free = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=2, temperature=0)
    banned = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=2, temperature=0,
                                       extra_body={"bad_words": ["Paris"]})
    assert "Paris" in free.choices[0].text and "Paris" not in banned.choices[0].text


def test_echo_writes_the_prompt_back_with_its_logprobs(server, client):
    """Completions' echo, as lm-evaluation-harness scores a continuation: the prompt's text, then the
    choice's; with logprobs the prompt's tokens' too (the first has none)."""
    ids = [504, 3458, 282, 4649, 314]
    prompts = ["The capital of France is", "Once upon a time"]
    plain = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=3, temperature=0, echo=True)
    texts = [c.text for c in plain.choices]
    assert texts[0].startswith("The capital of France is ") and texts[0] == texts[1]
    assert texts[2].startswith("Once upon a time") and len(texts[2]) > len(prompts[1])
    spelled = _post(server, "/detokenize", {"tokens": ids})[1]["prompt"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True)
    assert by_ids.choices[0].text.startswith(spelled) and len(by_ids.choices[0].text) > len(spelled)
    streamed = {i: "" for i in range(4)}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=3, temperature=0,
                                           echo=True, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert list(streamed.values()) == texts

    scored = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, echo=True,
                                       logprobs=1).choices[0]
    lp = scored.logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and "".join(lp.tokens) == scored.text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    alone = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1).choices[0]
    assert lp.token_logprobs[-1] == pytest.approx(alone.logprobs.token_logprobs[0], abs=1e-5)
    # The token generated after the prompt, scored as a prompt token of a longer prompt: its log
    # probability again, from the prefill instead of the decode.
    longer = client.completions.create(model=MODEL, prompt=ids + [scored_id(client, ids)], max_tokens=1,
                                       temperature=0, echo=True, logprobs=1).choices[0].logprobs
    assert longer.token_logprobs[len(ids)] == pytest.approx(lp.token_logprobs[-1], abs=1e-4)
    assert longer.token_logprobs[:len(ids)] == pytest.approx(lp.token_logprobs[:len(ids)], abs=1e-4)

    with pytest.raises(openai.BadRequestError, match="echo with logprobs is answered whole") as info:
        client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1, stream=True)
    assert info.value.body["param"] == "echo"


def scored_id(client, ids: list[int]) -> int:
    return client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                     extra_body={"return_token_ids": True}).choices[0].token_ids[0]


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats (with include_usage)."""
    chunks = list(client.completions.create(
        model=MODEL, prompt="Once upon a time", n=2, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    usages = [c.usage for c in chunks]
    assert all(u is not None and u.prompt_tokens == usages[-1].prompt_tokens for u in usages)
    counts = [u.completion_tokens for u in usages]
    assert counts == sorted(counts) and counts[-1] == 12 and counts[-2] == 12
    plain = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3, stream=True,
                                           stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in plain)  # without include_usage, no usage at all (as vLLM)


def test_chat_stream_equals_non_stream(client):
    whole = _chat(client, "Name three colors.", max_tokens=24, temperature=0)
    chunks = list(_chat(client, "Name three colors.", max_tokens=24, temperature=0, stream=True,
                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_stream_holds_back_a_stop_string_until_it_is_known(client):
    free = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0)
    stop = free.choices[0].text[5:12]  # several tokens' worth, so it arrives across chunks
    streamed = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0,
                                         stop=stop, stream=True)
    text = "".join(c.choices[0].text for c in streamed)
    assert text == free.choices[0].text[:5]


def test_16_concurrent_streams_equal_the_same_prompts_alone(server, client):
    alone = [client.completions.create(model=MODEL, prompt=p, **GREEDY).choices[0].text for p in PROMPTS]
    peak_running = 0

    async def stream(aclient, prompt):
        chunks = await aclient.completions.create(model=MODEL, prompt=prompt, stream=True, **GREEDY)
        return "".join([c.choices[0].text async for c in chunks])

    async def watch_batch(done: asyncio.Event):
        nonlocal peak_running
        while not done.is_set():
            running = await asyncio.to_thread(lambda: server.metrics()["kiln_requests_running"])
            peak_running = max(peak_running, running)
            await asyncio.sleep(0.05)

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        done = asyncio.Event()
        watcher = asyncio.create_task(watch_batch(done))
        texts = await asyncio.gather(*(stream(aclient, p) for p in PROMPTS))
        done.set()
        await watcher
        await aclient.close()
        return texts

    assert asyncio.run(main()) == alone
    assert peak_running > 1  # they shared batches


def test_disconnect_mid_stream_aborts_and_frees_blocks(server, client):
    aborted_before = server.metrics().get("kiln_requests_total{endpoint=chat,finish_reason=abort}", 0)
    stream = _chat(client, "Tell me a long story about a dragon.", max_tokens=400, temperature=0, stream=True,
                   extra_body={"ignore_eos": True})
    for _ in range(4):
        next(stream)
    assert server.metrics()["kiln_kv_blocks_in_use"] > 0
    stream.close()  # closes the HTTP response: the server sees the client go
    metrics = _wait_for(server, lambda m: m["kiln_kv_blocks_in_use"] == 0 and m["kiln_requests_running"] == 0)
    assert metrics["kiln_kv_blocks_in_use"] == 0 and metrics["kiln_requests_running"] == 0
    assert metrics["kiln_requests_total{endpoint=chat,finish_reason=abort}"] == aborted_before + 1


def test_disconnect_mid_stream_of_several_prompts_aborts_them_all(server, client):
    stream = client.completions.create(model=MODEL, prompt=["Once upon a time", "The stock market"], max_tokens=400,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    seen = set()
    while seen != {0, 1}:
        seen.update(c.index for c in next(stream).choices)
    assert server.metrics()["kiln_requests_running"] == 2
    stream.close()
    metrics = _wait_for(server, lambda m: m["kiln_kv_blocks_in_use"] == 0 and m["kiln_requests_running"] == 0)
    assert metrics["kiln_kv_blocks_in_use"] == 0 and metrics["kiln_requests_running"] == 0


def test_disconnect_before_a_non_streamed_answer_aborts_too(server):
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    _wait_for(server, lambda m: m["kiln_kv_blocks_in_use"] > 0)
    conn.close()  # gone before the answer, which would take ~20 s more
    metrics = _wait_for(server, lambda m: m["kiln_kv_blocks_in_use"] == 0 and m["kiln_requests_running"] == 0)
    assert metrics["kiln_kv_blocks_in_use"] == 0 and metrics["kiln_requests_running"] == 0


def _wait_for(server, condition, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = server.metrics()
        if condition(metrics) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def _long_prompt():
    return "hello " * (MAX_MODEL_LEN + 10)


@pytest.mark.parametrize("call, status, param, code", [
    (lambda c: _chat(c, "hi", max_tokens="ten"), 400, "max_tokens", None),
    (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": 7}]), 400,
     "messages[0].content", None),
    (lambda c: c.completions.create(model=MODEL, prompt="hi", temperature="hot"), 400, "temperature", None),
    (lambda c: _chat(c, _long_prompt()), 400, "messages", "context_length_exceeded"),
    (lambda c: c.completions.create(model=MODEL, prompt=_long_prompt()), 400, "prompt", "context_length_exceeded"),
    (lambda c: _chat(c, "hi", max_tokens=MAX_MODEL_LEN), 400, "max_tokens", "context_length_exceeded"),
    (lambda c: _chat(c, "hi", max_completion_tokens=MAX_MODEL_LEN, stream=True), 400, "max_completion_tokens",
     "context_length_exceeded"),
    (lambda c: c.completions.create(model=MODEL, prompt="hi", max_tokens=MAX_MODEL_LEN), 400, "max_tokens",
     "context_length_exceeded"),
    (lambda c: _chat(c, "hi", max_tokens=0), 400, "max_tokens", None),
    (lambda c: _chat(c, "hi", extra_body={"allowed_token_ids": []}), 400, "allowed_token_ids", "invalid_value"),
    (lambda c: _chat(c, "hi", extra_body={"allowed_token_ids": [49152]}), 400, "allowed_token_ids", None),
    (lambda c: _chat(c, "hi", extra_body={"truncate_prompt_tokens": 0}), 400, "truncate_prompt_tokens",
     "invalid_value"),
    (lambda c: _chat(c, "hi", extra_body={"continue_final_message": True}), 400, "continue_final_message",
     "invalid_value"),
    (lambda c: c.completions.create(model=MODEL, prompt="hi", max_tokens=-3, stream=True), 400, "max_tokens", None),
    (lambda c: _chat(c, "hi", max_completion_tokens=0), 400, "max_completion_tokens", None),
    (lambda c: _chat(c, "hi", temperature=-0.5), 400, "temperature", None),
    (lambda c: _chat(c, "hi", temperature=-0.5, stream=True), 400, "temperature", None),
    (lambda c: _chat(c, "hi", n=0), 400, "n", "invalid_value"),
    (lambda c: _chat(c, "hi", top_logprobs=2), 400, "top_logprobs", "invalid_value"),
    (lambda c: _chat(c, "hi", logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
    (lambda c: c.completions.create(model=MODEL, prompt="hi", logprobs=30), 400, "logprobs", None),
    (lambda c: _chat(c, "hi", presence_penalty=3), 400, "presence_penalty", "invalid_value"),
    (lambda c: _chat(c, "hi", extra_body={"repetition_penalty": 0}), 400, "repetition_penalty", "invalid_value"),
    (lambda c: _chat(c, "hi", logit_bias={"49152": 1}), 400, "logit_bias", None),
    (lambda c: _chat(c, "hi", response_format={"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}),
     400, "response_format", None),
    (lambda c: _chat(c, "hi", response_format={"type": "yaml"}), 400, "response_format", "invalid_value"),
    (lambda c: _chat(c, "hi", extra_body={"guided_regex": "(", "guided_choice": ["a"]}), 400, "guided_choice",
     "invalid_value"),
    (lambda c: _chat(c, "hi", extra_body={"guided_regex": "(unclosed"}), 400, "guided_regex", None),
    (lambda c: c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}]), 404,
     "model", "model_not_found"),
    (lambda c: c.completions.create(model="gpt-4o", prompt="hi"), 404, "model", "model_not_found"),
], ids=["wrong-type", "wrong-type-nested", "wrong-type-float", "chat-over-context", "prompt-over-context",
        "max-tokens-over-context", "max-completion-tokens-over-context-stream", "completion-max-tokens-over-context",
        "max-tokens-0", "allowed-token-ids-empty", "allowed-token-ids-outside-vocab", "truncate-prompt-tokens-0",
        "continue-and-generation-prompt", "max-tokens-negative-stream", "max-completion-tokens-0", "negative-temperature",
        "negative-temperature-stream", "n-0", "top-logprobs-alone", "top-logprobs-21", "logprobs-30",
        "presence-penalty-3", "repetition-penalty-0", "logit-bias-outside-vocab", "bad-json-schema",
        "response-format-yaml", "two-structured-fields", "bad-regex", "unknown-model-chat",
        "unknown-model-completions"])
def test_bad_request_names_the_field_and_the_server_keeps_serving(client, call, status, param, code):
    with pytest.raises(openai.APIStatusError) as info:
        call(client)
    error = info.value.body  # the client unwraps {"error": {...}}
    assert info.value.status_code == status
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    if code is not None:
        assert error["code"] == code
    assert _chat(client, "hi", max_tokens=1).choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, message", [
    (b'{"model": "smollm2", "messages": [', "not valid JSON"),
    (b'["a", "list"]', "must be a JSON object"),
])
def test_malformed_body_is_an_openai_error(server, body, message):
    status, raw = server.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    error = json.loads(raw)["error"]
    assert status == 400 and message in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert server.get("/health")[0] == 200


def test_metrics(server, client):
    _chat(client, "hi", max_tokens=4, temperature=0)
    status, raw = server.request("GET", "/metrics")
    text = raw.decode()
    metrics = server.metrics()
    assert metrics["kiln_time_to_first_token_seconds_count"] > 0
    assert metrics["kiln_time_per_output_token_seconds_count"] > 0
    assert metrics["kiln_kv_blocks_total"] > 0 and metrics["kiln_ready"] == 1
    assert metrics["kiln_startup_phase_seconds{phase=weights}"] > 0
    for name in ("kiln_requests_running", "kiln_requests_waiting", "kiln_kv_blocks_in_use",
                 "kiln_compile_seconds", "kiln_graph_capture_seconds", "kiln_compile_cache_hits_total",
                 "kiln_compile_cache_misses_total"):
        assert name in metrics
    # The engine runs eagerly: no compile phases, and the help text says why the value is 0.
    assert metrics["kiln_compile_seconds"] == 0 and "0 when the engine recorded none" in text
    # ... and nothing compiled: no Dynamo graph, no Inductor piece, no Triton kernel (a CPU).
    assert metrics["kiln_dynamo_graphs_total"] == metrics["kiln_inductor_compiles_total"] == 0
    assert metrics["kiln_triton_kernels_compiled_total"] == 0
    # The CPU's default time budget, and how many steps overran it (the shared server's earlier
    # tests may have: tests/test_scheduler.py counts them exactly).
    assert metrics["kiln_step_time_budget_seconds"] == 1.0 and metrics["kiln_steps_over_time_budget_total"] >= 0


def test_a_body_over_the_limit_gets_413_at_once_and_health_stays_quick(server):
    import time

    start = time.perf_counter()
    status, body = server.request("POST", "/v1/completions", body=b"x" * (5 << 20),
                                  headers={"Content-Type": "application/json"})
    refused_s = time.perf_counter() - start
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large", body[:200]
    assert refused_s < 5, refused_s  # the old server parsed a body this size for tens of seconds
    assert server.get("/health")[0] == 200
