"""Anthropic's Messages API (serve/anthropic_api.py) through the official `anthropic` SDK against a running
server on the embedded model with its MTP head: a plain message, system as a string / blocks / folded from
later in the conversation, streaming assembled by the SDK equal to the whole answer, tools (any, a named
tool) with inputs valid against their schema, streamed input_json_delta, a history with tool_use and
tool_result, count_tokens equal to the prompt the engine sees, stop_sequences, errors in Anthropic's
envelope, x-api-key beside Bearer, and the raw stream's event order. The embedded SmolLM2's template has
no tool section: tools take the generic <tool_call> form, a forced call held to the schema by a grammar."""

import argparse
import asyncio
import dataclasses
import json
import threading
import time

import anthropic
import httpx2 as httpx
import jsonschema
import pytest

from mlx_engine.serve import anthropic_api
from mlx_engine.serve.jobs import Done, Job, Request
from mlx_engine.serve.main import make_server
from mlx_engine.serve.turn import prepare
from mlx_engine.toolcalls.stream import CallArgs, CallStart, Text
from serve_util import RunningServer, free_port

WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                             "unit": {"type": "string", "enum": ["c", "f"]}},
                            "required": ["city", "unit"]}}
TIME = {"name": "get_time", "description": "Get the time in a timezone",
        "input_schema": {"type": "object", "properties": {"timezone": {"type": "string"}},
                         "required": ["timezone"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    s = RunningServer("--batching", "continuous", "--drafter", "mtp", "--max-concurrency", "4", "--max-tokens", "64")
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base, api_key="none", max_retries=0, timeout=120)


def post(server, path, body, headers=None):
    return httpx.post(server.base + path, json=body, headers=headers or {}, timeout=120)


def count(server, **body) -> int:
    r = post(server, "/v1/messages/count_tokens", {"model": server.model, **body})
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def prompt_tokens(message) -> int:
    """The whole prompt: Anthropic's input_tokens leaves out what the prefix cache read (issue 54)."""
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


def anthropic_error(r, status: int, kind: str = "invalid_request_error") -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]
    return body["error"]["message"]


def test_a_plain_message(server, client):
    m = client.messages.create(model=server.model, max_tokens=12, messages=FRANCE)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == server.model
    assert [b.type for b in m.content] == ["text"] and "Paris" in m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert prompt_tokens(m) == count(server, messages=FRANCE) and 0 < m.usage.output_tokens <= 12
    assert m.model_extra["speculation"]["drafter"] == "mtp"
    # another model's name (Claude Code sends its own) is served by the one model
    assert client.messages.create(model="claude-haiku-4-5", max_tokens=4, messages=FRANCE).model == server.model


def test_system_as_a_string_as_blocks_and_folded_from_later_messages(server, client):
    tok = server.service.tokenizer

    def prompt(**body) -> str:  # what the template reads
        turn = anthropic_api.messages_turn(anthropic_api.CountBody.model_validate({"model": "m", **body}))
        return tok.decode(prepare(turn, tok, server.service.vocab_size).prompt)

    as_string = count(server, system="You are terse.", messages=FRANCE)
    assert "You are terse." in prompt(system="You are terse.", messages=FRANCE)
    assert count(server, system=[{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
                 messages=FRANCE) == as_string
    two = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in English."}]
    assert prompt(system=two, messages=FRANCE) == prompt(system="You are terse.\n\nAnswer in English.", messages=FRANCE)
    # a system message later in the conversation is folded into the leading system text, not refused
    later = [FRANCE[0], {"role": "assistant", "content": "Paris."},
             {"role": "system", "content": "Answer in English."}, {"role": "user", "content": "And Spain?"}]
    folded = prompt(system="You are terse.", messages=later)
    assert folded == prompt(system=two, messages=[m for m in later if m["role"] != "system"])
    assert folded.index("Answer in English.") < folded.index("What is the capital of France?")
    m = client.messages.create(model=server.model, max_tokens=6, system="You are terse.", messages=later)
    assert m.content and prompt_tokens(m) == count(server, system="You are terse.", messages=later)


def test_streamed_equals_whole_and_stop_sequences(server, client):
    whole = client.messages.create(model=server.model, max_tokens=16, messages=FRANCE,
                                  extra_body={"temperature": 0})
    with client.messages.stream(model=server.model, max_tokens=16, messages=FRANCE,
                                  extra_body={"temperature": 0}) as s:
        texts = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(texts) == whole.content[0].text == final.content[0].text and len(texts) > 1
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert prompt_tokens(final) == prompt_tokens(whole)
    # a stop sequence ends the answer before it and is named
    text = whole.content[0].text
    word = text.split()[2]
    cut = client.messages.create(model=server.model, max_tokens=16, messages=FRANCE, stop_sequences=["zzz", word])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == text[:text.index(word)]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_a_forced_tool_call_valid_against_its_schema_streamed_alike(server, client, choice):
    m = client.messages.create(model=server.model, max_tokens=48, tools=[TIME, WEATHER], tool_choice=choice,
                               messages=ASK)
    assert m.stop_reason == "tool_use"
    calls = [b for b in m.content if b.type == "tool_use"]
    assert calls and all(b.id.startswith("toolu_") for b in calls)
    if choice["type"] == "tool":
        assert calls[0].name == "get_weather"
    for b in calls:
        jsonschema.validate(b.input, {"get_weather": WEATHER, "get_time": TIME}[b.name]["input_schema"])
    deltas = []
    with client.messages.stream(model=server.model, max_tokens=48, tools=[TIME, WEATHER], tool_choice=choice,
                                messages=ASK) as s:
        for event in s:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                deltas.append(event.delta.partial_json)
        final = s.get_final_message()
    assert deltas and final.stop_reason == "tool_use"  # (a call's input comes whole once closed: toolcalls.stream)
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in streamed] == [(b.name, b.input) for b in calls]
    if len(streamed) == 1:
        assert json.loads("".join(deltas)) == streamed[0].input
    assert all(b.id.startswith("toolu_") for b in streamed)


def test_a_history_with_tool_use_and_tool_result(server, client):
    history = ASK + [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "The user wants the weather.", "signature": "abc"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"unit": "c", "city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "22 degrees and sunny"},
            {"type": "text", "text": "Thanks. Is that warm?"}]}]
    m = client.messages.create(model=server.model, max_tokens=8, tools=[WEATHER], messages=history)
    assert m.content and prompt_tokens(m) == count(server, tools=[WEATHER], messages=history)
    # the result is in the prompt: a longer result makes a longer prompt
    longer = json.loads(json.dumps(history))
    longer[-1]["content"][0]["content"] = [{"type": "text", "text": "22 degrees and sunny, light wind from the west"}]
    assert count(server, tools=[WEATHER], messages=longer) > prompt_tokens(m)
    # what the template reads: the call (its key order kept), the result before the user's text
    body = anthropic_api.MessagesBody.model_validate({"model": "m", "max_tokens": 8, "tools": [WEATHER],
                                                      "messages": history})
    turn = anthropic_api.messages_turn(body)
    assert [x["role"] for x in turn.messages] == ["user", "assistant", "tool", "user"]
    assistant = turn.messages[1]
    assert assistant["reasoning_content"] == "The user wants the weather." and assistant["content"] == "Let me check."
    assert assistant["tool_calls"] == [{"id": "toolu_01", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"unit": "c", "city": "Paris"}'}}]
    assert turn.messages[2] == {"role": "tool", "tool_call_id": "toolu_01", "content": "22 degrees and sunny"}
    tok = server.service.tokenizer
    text = tok.decode(prepare(turn, tok, server.service.vocab_size).prompt)
    assert '"arguments": {"unit": "c", "city": "Paris"}' in text
    assert text.index("22 degrees and sunny") < text.index("Thanks. Is that warm?")


def test_tool_translation():
    body = anthropic_api.MessagesBody.model_validate({
        "model": "m", "max_tokens": 8, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 1024},
        "tool_choice": {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
        "tools": [WEATHER, TIME, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
        "metadata": {"user_id": "u"}, "service_tier": "auto", "top_k": 5})
    turn = anthropic_api.messages_turn(body)
    assert [t["function"]["name"] for t in turn.tools] == ["get_weather", "get_time"]  # the server tool skipped
    assert turn.tools[0]["function"]["parameters"] == WEATHER["input_schema"]
    assert turn.tool_choice == {"type": "function", "function": {"name": "get_time"}} and not turn.parallel_tool_calls
    assert turn.template_kwargs == {"enable_thinking": True} and turn.sampling.top_k == 5 and turn.max_tokens == 8
    for given, want in ([{"type": "auto"}, "auto"], [{"type": "any"}, "required"], [{"type": "none"}, "none"]):
        assert anthropic_api.tool_choice(given, turn.tools) == (want, True)
    assert anthropic_api.tool_choice(None, []) == ("none", True)
    assert anthropic_api.template_kwargs({"type": "disabled"}) == {"enable_thinking": False}
    strict = anthropic_api.function_tools([{**WEATHER, "strict": True}, TIME])  # strict tool use, kept for auto
    assert strict[0]["function"]["strict"] is True and "strict" not in strict[1]["function"]


def test_count_tokens_is_the_prompt_the_engine_sees(server, client):
    for body in ({"messages": FRANCE}, {"system": "Be brief.", "messages": ASK, "tools": [WEATHER, TIME]},
                 {"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "any"}}):
        n = client.messages.count_tokens(model=server.model, **body).input_tokens
        m = client.messages.create(model=server.model, max_tokens=2, **body)
        assert n == prompt_tokens(m) > 10


def test_errors_in_anthropics_envelope(server, client):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as e:
        what = [{"type": "text", "text": "What is this?"}, image]
        client.messages.create(model=server.model, max_tokens=4, messages=[{"role": "user", "content": what}])
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error" and "image" in e.value.body["error"]["message"]
    doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
    r = post(server, "/v1/messages", {"model": server.model, "max_tokens": 4,
                                      "messages": [{"role": "user", "content": [doc]}]})
    assert "document" in anthropic_error(r, 400)
    r = post(server, "/v1/messages", {"model": server.model, "messages": FRANCE})  # max_tokens is required
    assert "max_tokens" in anthropic_error(r, 400)
    r = post(server, "/v1/messages", {"model": server.model, "max_tokens": 4, "messages": FRANCE,
                                      "tool_choice": {"type": "any"}})
    assert "tool_choice" in anthropic_error(r, 400)
    r = post(server, "/v1/messages", {"model": server.model, "max_tokens": 4, "messages": FRANCE, "tools": [WEATHER],
                                      "tool_choice": {"type": "tool", "name": "nope"}})
    assert "nope" in anthropic_error(r, 400)
    r = httpx.post(server.base + "/v1/messages", content=b"{not json", timeout=60)
    assert "not valid JSON" in anthropic_error(r, 400)
    # the OpenAI routes keep OpenAI's shape
    r = post(server, "/v1/chat/completions", {"model": server.model, "messages": FRANCE, "n": 2})
    assert r.status_code == 400 and set(r.json()) == {"error"}


def test_the_raw_streams_event_order(server):
    body = {"model": server.model, "max_tokens": 8, "stream": True, "messages": FRANCE, "unknown_field": 1}
    with httpx.stream("POST", server.base + "/v1/messages?beta=true", json=body, timeout=120,
                      headers={"anthropic-beta": "fine-grained-tool-streaming-2025-05-14",
                               "anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    events = []
    for name, data in zip(lines[::2], lines[1::2]):
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[6:])
        assert payload["type"] == name[7:]
        events.append(payload)
    kinds = [e["type"] for e in events if e["type"] != "ping"]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == ["content_block_stop",
                                                                                    "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0]["message"]["usage"]["input_tokens"] == count(server, messages=FRANCE)
    assert events[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens") and events[-2]["usage"]["output_tokens"] > 0


def _fake_run(items, streamed: bool):
    """The adapter on a job fed by hand (a reasoning model's answer: the embedded model has no markers)."""

    class HTTP:
        async def receive(self):
            await asyncio.Event().wait()

    class Worker:
        def cancel(self, job):
            pass

    async def go():
        job = Job(Request([1, 2, 3], 16))
        for item in items:
            job.events.put_nowait(item)
        service = argparse.Namespace(worker=Worker())
        message = {"id": "msg_x", "type": "message", "role": "assistant", "model": "m"}
        if not streamed:
            return await anthropic_api.complete(job, message, HTTP(), service)
        return [chunk async for chunk in anthropic_api.stream(job, message, 3, HTTP(), service)]

    return asyncio.run(go())


def test_thinking_text_and_tool_use_blocks_whole_and_streamed():
    items = [Text("reasoning", "Paris is in "), Text("reasoning", "France."), Text("content", "Let me look."),
             CallStart(0, "call_abc", "get_weather"), CallArgs(0, '{"city": '), CallArgs(0, '"Paris", "unit": "c"}'),
             Done("tool_calls", 3, 9, {})]
    whole = _fake_run(items, streamed=False)
    assert whole["content"] == [{"type": "thinking", "thinking": "Paris is in France.", "signature": ""},
                                {"type": "text", "text": "Let me look."},
                                {"type": "tool_use", "id": "toolu_abc", "name": "get_weather",
                                 "input": {"city": "Paris", "unit": "c"}}]
    assert whole["stop_reason"] == "tool_use" and whole["usage"] == {"input_tokens": 3, "output_tokens": 9,
                                                                  "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    chunks = _fake_run(items, streamed=True)
    events = [json.loads(c.split("\ndata: ", 1)[1]) for c in chunks]
    snapshot = None
    json_bufs: dict = {}
    from anthropic.lib.streaming._messages import accumulate_event  # the SDK's own assembly
    for e in events:
        if e["type"] in ("ping", "message_stop"):
            continue
        snapshot = accumulate_event(event=e, current_snapshot=snapshot, json_bufs=json_bufs)
    assert [b.to_dict() if hasattr(b, "to_dict") else b for b in snapshot.content] == whole["content"]
    indexed = [(e["type"], e["index"]) for e in events if "index" in e]
    assert indexed[:3] == [("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0)]
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


@pytest.fixture(scope="module")
def keyed(server):
    """A second HTTP front on the same engine, with --api-key."""
    args = argparse.Namespace(host="127.0.0.1", shutdown_timeout=1.0)
    front = make_server(dataclasses.replace(server.service, api_key="sekrit"), args, port := free_port())
    thread = threading.Thread(target=front.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not front.started and time.time() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    front.should_exit = True
    thread.join(timeout=10)


def test_x_api_key_beside_bearer(server, keyed):
    ok = anthropic.Anthropic(base_url=keyed, api_key="sekrit", max_retries=0, timeout=120)
    assert ok.messages.create(model=server.model, max_tokens=2, messages=FRANCE).usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=keyed, api_key="wrong", max_retries=0).messages.create(
            model=server.model, max_tokens=2, messages=FRANCE)
    assert e.value.body["error"]["type"] == "authentication_error"
    body = {"model": server.model, "max_tokens": 2, "messages": FRANCE}
    r = httpx.post(keyed + "/v1/messages/count_tokens", json=body, timeout=60)
    assert "x-api-key" in anthropic_error(r, 401, "authentication_error")
    assert httpx.post(keyed + "/v1/messages", json=body, headers={"Authorization": "Bearer sekrit"},
                      timeout=120).status_code == 200
    # x-api-key opens the OpenAI routes too; their 401 stays in OpenAI's shape
    chat = {"model": server.model, "max_tokens": 2, "messages": FRANCE}
    assert httpx.post(keyed + "/v1/chat/completions", json=chat, headers={"x-api-key": "sekrit"},
                      timeout=120).status_code == 200
    r = httpx.post(keyed + "/v1/chat/completions", json=chat, headers={"x-api-key": "wrong"}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
