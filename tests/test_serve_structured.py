"""Structured output through the server, driven by the official openai SDK (embedded SmolLM2-135M, its MTP
head drafting): response_format json_schema (strict) and json_object, streamed and not, in continuous
batching and one at a time; four concurrent requests under four schemas; every answer valid (jsonschema);
the grammar drafts its forced tokens with the MTP head on; the same greedy answer with and without
speculation."""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest

from serve_util import RunningServer

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"type": "string", "maxLength": 40}},
          "required": ["name", "age", "city"], "additionalProperties": False}
SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["colour", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                "maxItems": 3}}, "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                      "country": {"type": "string", "maxLength": 30}},
     "required": ["city", "country"], "additionalProperties": False},
]
ASK = "Give the name, age and city of the person: Ada Lovelace was 36 and lived in London. Answer in JSON."


def fmt(schema, name="answer"):
    return {"type": "json_schema", "json_schema": {"name": name, "strict": True, "schema": schema}}


@pytest.fixture(scope="module", params=["continuous", "fair"])
def server(request):
    s = RunningServer("--batching", request.param, "--drafter", "mtp", "--max-concurrency", "4", "--max-tokens", "64")
    yield s
    s.close()


def ask(server, schema=PERSON, question=ASK, stream=False, **kw):
    client = server.client()
    msgs = [{"role": "user", "content": question}]
    if stream:
        text = ""
        for chunk in client.chat.completions.create(model=server.model, messages=msgs, response_format=fmt(schema),
                                                    max_tokens=64, stream=True, **kw):
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        return text, None
    r = client.chat.completions.create(model=server.model, messages=msgs, response_format=fmt(schema),
                                       max_tokens=64, **kw)
    return r.choices[0].message.content, r


def test_json_schema_answers_are_valid_and_the_grammar_drafts(server):
    text, r = ask(server)
    jsonschema.validate(json.loads(text), PERSON)
    assert r.choices[0].finish_reason == "stop"
    spec = r.model_extra["speculation"]
    assert spec["forced"] > 0 and spec["forced_accepted"] > 0, spec  # keys and punctuation drafted by the grammar
    assert spec["drafter"] == "mtp"
    streamed, _ = ask(server, stream=True)
    assert streamed == text


def test_json_object_answers_are_a_json_object(server):
    r = server.client().chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Describe a cat as JSON with a name and a colour."}],
        response_format={"type": "json_object"}, max_tokens=64)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut at max_tokens: still a prefix of an object
        assert r.choices[0].message.content.startswith("{")


def test_four_concurrent_requests_under_four_schemas(server):
    out = [None] * 4

    def one(i):
        out[i] = ask(server, SCHEMAS[i], question=f"{ASK} ({i})", temperature=0.7, seed=i)[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for text, schema in zip(out, SCHEMAS):
        try:
            jsonschema.validate(json.loads(text), schema)
        except json.JSONDecodeError:  # cut at max_tokens: nothing outside the grammar all the same
            assert text.startswith("{")


def test_the_answer_is_the_same_without_speculation(server):
    with_spec, _ = ask(server)
    without, _ = ask(server, extra_body={"num_draft": 0})
    assert with_spec == without


def test_a_schema_the_engine_cannot_compile_is_a_400_naming_it(server):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        ask(server, {"type": "object", "properties": {"a": {"type": "strin"}}})
    assert "response_format" in str(e.value) and "strin" in str(e.value)
