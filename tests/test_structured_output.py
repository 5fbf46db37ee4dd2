"""Structured output through llguidance on the embedded SmolLM2: a JSON schema, any JSON object,
a regex, a choice and a Lark grammar; the output always parses and matches, with the
synchronous engine and with async scheduling (which then reads each step's tokens before
scheduling the next), for n > 1 too; a bad grammar or a contradiction is refused up front."""

import json
import random
import re

import pytest

from kiln import LLM, SamplingParams
from kiln.engine.structured_output import GuidedDecodingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name, an age and a city."}]


@pytest.fixture(scope="module")
def engines():
    return {mode: LLM("smollm2", device="cpu", dtype="float32", async_scheduling=mode) for mode in (False, True)}


def check_person(text: str) -> None:
    person = json.loads(text)
    assert set(person) == {"name", "age", "city"}
    assert isinstance(person["name"], str) and len(person["name"]) <= 12
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 150 and person["city"] in ("Paris", "Rome", "Oslo")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_json_schema_is_always_met(engines, async_scheduling):
    llm = engines[async_scheduling]
    params = SamplingParams(max_tokens=80, temperature=0.9, seed=2, n=2, structured_outputs={"json": SCHEMA})
    out = llm.chat(ASK, params)[0]
    for choice in out.outputs:
        assert choice.finish_reason == "stop"
        check_person(choice.text)
    greedy = SamplingParams(max_tokens=80, temperature=0, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    texts = [engines[mode].chat(ASK, greedy)[0].outputs[0].text for mode in (False, True)]
    assert texts[0] == texts[1]  # the look-ahead is off while a grammar runs: same tokens


def test_json_object_regex_choice_and_lark(engines):
    llm = engines[False]
    out = llm.chat(ASK, SamplingParams(max_tokens=80, temperature=0, structured_outputs={"json_object": True}))
    assert isinstance(json.loads(out[0].outputs[0].text), dict)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    choices = ["Paris", "London", 'a "quoted" city']
    for seed in range(3):
        got = llm.chat(question, SamplingParams(max_tokens=20, temperature=1.0, seed=seed,
                                                guided_decoding=GuidedDecodingParams(choice=choices)))[0]
        assert got.outputs[0].text in choices
    got = llm.chat(question, SamplingParams(max_tokens=20, structured_outputs={"regex": r"[0-9]{3}-[a-z]{2}"}))[0]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", got.outputs[0].text)
    lark = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    got = llm.chat(question, SamplingParams(max_tokens=20, structured_outputs={"grammar": lark}))[0]
    assert got.outputs[0].text in ("The answer is yes.", "The answer is no.")


@pytest.mark.parametrize("so, message", [
    ({"json": {"type": "bogus"}}, "the grammar is not valid"),
    ({"regex": "(unclosed"}, "the grammar is not valid"),
    ({"json": SCHEMA, "regex": "x"}, "exactly one of json, regex, choice, grammar, json_object; got json, regex"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"shape": "round"}, "unknown key"),
])
def test_a_bad_grammar_is_refused_up_front(engines, so, message):
    engine = engines[False].engine
    with pytest.raises(ValueError, match=message):
        engine.add_request("hi", SamplingParams(structured_outputs=so))
    assert not engine.has_unfinished()


def test_contradictions_are_refused():
    with pytest.raises(ValueError, match="ignore_eos contradicts structured output"):
        SamplingParams(ignore_eos=True, structured_outputs={"json_object": True})
    with pytest.raises(ValueError, match="the same setting"):
        SamplingParams(structured_outputs={"regex": "a"}, guided_decoding={"regex": "a"})
    tiny = LLM("tiny-llama", device="cpu", num_kv_blocks=16, max_model_len=64)
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        tiny.engine.add_request([1, 2, 3], SamplingParams(structured_outputs={"regex": "a"}))


def random_schema(rng: random.Random) -> dict:
    """An object of 1-4 required properties: bounded strings and integers, booleans, enums, short arrays."""
    kinds = [lambda: {"type": "string", "maxLength": rng.randint(1, 10)},
             lambda: {"type": "integer", "minimum": -rng.randint(0, 99), "maximum": rng.randint(0, 999)},
             lambda: {"type": "boolean"},
             lambda: {"enum": rng.sample(["red", "green", "blue", "cyan", "amber"], rng.randint(1, 4))},
             lambda: {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                      "minItems": 1, "maxItems": 3}]
    names = rng.sample(["id", "name", "size", "ok", "colour", "tags", "count"], rng.randint(1, 4))
    return {"type": "object", "properties": {n: rng.choice(kinds)() for n in names}, "required": names,
            "additionalProperties": False}


def test_twenty_random_schemas_validate_with_jsonschema(engines):
    jsonschema = pytest.importorskip("jsonschema")
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(20)]
    ask = [[{"role": "user", "content": f"Fill in this JSON: {', '.join(s['properties'])}."}] for s in schemas]
    params = [SamplingParams(max_tokens=120, temperature=0.7, seed=i, structured_outputs={"json": s})
              for i, s in enumerate(schemas)]
    outs = engines[True].chat(ask, params)
    for schema, out in zip(schemas, outs):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
