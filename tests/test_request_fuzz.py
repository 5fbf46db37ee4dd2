"""Property-based fuzz of the OpenAI request bodies (hypothesis): whatever JSON arrives, even
NaN, infinities, huge integers and wrong types in every field, the server answers with a
2xx or a 4xx error body, never a 500, and never hangs (every request ends within the
context of a tiny model)."""

import json
import math

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

MODEL = "smollm2"

numbers = (st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=True, allow_infinity=True)
           | st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64, 0.5, 1e-300, 1e300, math.nan, math.inf, -math.inf]))
scalars = st.none() | st.booleans() | numbers | st.text(max_size=12)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=6), inner, max_size=3), max_leaves=6)
token_ids = st.lists(st.integers(min_value=-5, max_value=2000), max_size=6)

SAMPLING = {
    "max_tokens": st.integers(min_value=-3, max_value=10**12) | values,
    "temperature": numbers | values, "top_p": numbers | values, "top_k": numbers | values,
    "seed": numbers | values, "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3) | values,
    "stream": st.booleans() | values, "ignore_eos": st.booleans() | values, "stop_token_ids": token_ids | values,
    "n": numbers | values, "presence_penalty": numbers | values, "frequency_penalty": numbers | values,
    "repetition_penalty": numbers | values, "min_p": numbers | values, "min_tokens": numbers | values,
    "logit_bias": values | st.dictionaries(st.sampled_from(["1", "7", "-3", "99999", "x"]), numbers, max_size=2),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | values,
                                             "continuous_usage_stats": st.booleans() | values}) | values,
    "response_format": values | st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "yaml"},
                                                 {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
                                                 {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}]),
    "guided_regex": values | st.sampled_from(["[0-9]+", "(", "a|b"]),
    "guided_choice": values | st.lists(st.text(max_size=4), max_size=3),
    "structured_outputs": values | st.sampled_from([{"json_object": True}, {"regex": "x+"}, {"bad": 1}]),
    "model": values, "allowed_token_ids": token_ids | values, "truncate_prompt_tokens": numbers | values,
    "skip_special_tokens": st.booleans() | values, "bad_words": st.lists(st.text(max_size=6), max_size=3) | values,
}
COMPLETION = {**SAMPLING, "prompt": st.text(max_size=20) | token_ids | st.lists(st.text(max_size=8), max_size=2)
              | st.lists(token_ids, max_size=2) | values, "echo": values, "logprobs": values}
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]) | values,
                                 "content": st.text(max_size=20) | values})
CHAT = {**SAMPLING, "messages": st.lists(message, max_size=3) | values, "max_completion_tokens": numbers | values,
        "logprobs": st.booleans() | values, "top_logprobs": numbers | values}
# The chat template's options reach Jinja: variables named as the template's own, or as its helpers.
TEMPLATE_OPTIONS = {
    "add_generation_prompt": st.booleans() | values, "continue_final_message": st.booleans() | values,
    "chat_template_kwargs": values | st.dictionaries(
        st.sampled_from(["enable_thinking", "raise_exception", "messages", "bos_token", "add_generation_prompt"]),
        values, max_size=2)}
CHAT.update(TEMPLATE_OPTIONS)
TOKENIZE = {"model": values, "prompt": st.text(max_size=20) | values, "messages": st.lists(message, max_size=3) | values,
            "add_special_tokens": st.booleans() | values, "return_token_strs": st.booleans() | values,
            **TEMPLATE_OPTIONS}
DETOKENIZE = {"model": values, "tokens": st.lists(st.integers(min_value=-5, max_value=10**6), max_size=6) | values}
VALID = {"/v1/completions": {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4},
         "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
         "/tokenize": {"model": MODEL, "prompt": "Once upon a time"},
         "/detokenize": {"model": MODEL, "tokens": [1, 2, 3]}}


@st.composite
def _bodies(draw, path: str, fields: dict):
    """A valid body with 0-3 fields replaced by fuzzed values (or dropped): both the engine and
    every refusal are reached."""
    body = dict(VALID[path])
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True)):
        if draw(st.integers(0, 9)) == 0:
            body.pop(name, None)
        else:
            body[name] = draw(fields[name])
    return body


def _check(client, path: str, body: dict) -> None:
    # Python's json writes NaN and Infinity, and the server's parser reads them: they arrive.
    response = client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    STATUSES.append(response.status_code)
    assert response.status_code < 500, (body, response.status_code, response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"], (body, error)
    elif "text/event-stream" in response.headers.get("content-type", ""):
        lines = [line for line in response.text.splitlines() if line]
        assert lines[-1] == "data: [DONE]", (body, lines[-3:])


STATUSES = []
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])


@FUZZ
@given(body=_bodies("/v1/completions", COMPLETION))
def test_completions_never_fail_with_500(app_client, body):
    _check(app_client, "/v1/completions", body)


@FUZZ
@given(body=_bodies("/v1/chat/completions", CHAT))
def test_chat_completions_never_fail_with_500(app_client, body):
    _check(app_client, "/v1/chat/completions", body)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from([("/tokenize", TOKENIZE), ("/detokenize", DETOKENIZE)]).flatmap(
    lambda route: st.tuples(st.just(route[0]), _bodies(*route))))
def test_tokenize_and_detokenize_never_fail_with_500(app_client, case):
    _check(app_client, *case)


def test_the_fuzz_reached_the_engine():
    """Some fuzzed bodies were valid: the checks above ran generations, not only refusals."""
    assert STATUSES.count(200) >= 5 and any(400 <= s < 500 for s in STATUSES), sorted(set(STATUSES))
