"""OpenAI's Responses API (POST /v1/responses) through the server, driven by the official openai SDK
(embedded SmolLM2-135M, its MTP head drafting, continuous batching). Its template has no tool section: tools
take the generic <tool_call> form, and tool_choice required / named is held to the tool's schema by a
grammar. Text with instructions; items with a developer message (the same prompt as chat completions'
system message); streamed and not, the same answer, the events in the API's order; a forced function call
(arguments valid against the schema, streamed deltas assembling to them); a conversation with
function_call and function_call_output items (the same prompt as chat completions' tool_calls and tool
messages); text.format json_schema; max_output_tokens -> incomplete; the refusals (previous_response_id,
images, background) and a skipped web_search tool with its log line. The translation itself is checked
without a server first."""

from __future__ import annotations

import json
import logging
import time

import jsonschema
import openai
import pytest

from mlx_engine.serve.errors import APIError
from mlx_engine.serve.responses_api import (ResponsesRequest, chat_tool_choice, conversation, function_tools,
                                            response_format)
from serve_util import RunningServer

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                  "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": WEATHER_PARAMS, "strict": True}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


def body(**kw) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", **kw})


# -- the translation, no server ---------------------------------------------------------------------

def test_items_become_chat_messages():
    b = body(instructions="Be brief.", input=[
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                        {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": {"city": "Lyon"}},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
        {"role": "user", "content": "Thanks."},
    ])
    assert conversation(b) == [
        {"role": "system", "content": "Be brief.\n\nUse tools."},  # instructions and developer: one system message
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Look.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                        {"id": "call_2", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "user", "content": "Thanks."},
    ]
    # a call with no assistant message before it opens one; reasoning with no assistant after it is dropped
    b = body(input=[{"role": "user", "content": "Hi"},
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c", "output": "ok"},
                    {"type": "reasoning", "id": "rs", "summary": [{"type": "summary_text", "text": "hm"}]}])
    assert conversation(b) == [{"role": "user", "content": "Hi"},
                               {"role": "assistant", "content": "",
                                "tool_calls": [{"id": "c", "type": "function",
                                                "function": {"name": "f", "arguments": "{}"}}]},
                               {"role": "tool", "tool_call_id": "c", "content": "ok"}]


@pytest.mark.parametrize("items, words", [
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}], "'input_image'"),
    ([{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file", "file_id": "f"}]}],
     "'input_file'"),
    ([{"type": "item_reference", "id": "msg_1"}], "stateless"),
    ([{"type": "web_search_call", "id": "ws_1"}], "'web_search_call'"),
    ([{"role": "tool", "content": "x"}], "role"),
    ([{"role": "system", "content": "only a system message"}], "no user message"),
])
def test_items_refused_by_name(items, words):
    with pytest.raises(APIError) as e:
        conversation(body(input=items))
    assert e.value.status == 400 and words in e.value.message


def test_tools_tool_choice_and_text_format(caplog):
    logger = logging.getLogger("mlx_engine.serve")
    logger.addHandler(caplog.handler)  # the server's own set-up may stop it propagating to the root
    try:
        tools = function_tools([WEATHER, {"type": "web_search"}, {"type": "file_search", "vector_store_ids": []}])
    finally:
        logger.removeHandler(caplog.handler)
    assert tools == [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                       "parameters": WEATHER_PARAMS, "strict": True}}]
    assert "'web_search' skipped" in caplog.text and "'file_search' skipped" in caplog.text
    assert chat_tool_choice("required", tools) == ("required", tools)
    assert chat_tool_choice({"type": "function", "name": "get_weather"}, tools)[0] == \
        {"type": "function", "function": {"name": "get_weather"}}
    assert chat_tool_choice({"type": "allowed_tools", "mode": "required",
                             "tools": [{"type": "function", "name": "get_weather"}]}, tools) == ("required", tools)
    assert chat_tool_choice({"type": "allowed_tools", "mode": "auto",
                             "tools": [{"type": "function", "name": "other"}]}, tools) == ("none", [])
    assert chat_tool_choice("auto", []) == ("none", [])
    with pytest.raises(APIError, match="no function tools"):
        chat_tool_choice("required", [])
    with pytest.raises(APIError, match="'web_search_preview'"):
        chat_tool_choice({"type": "web_search_preview"}, tools)
    assert response_format(None) is None and response_format({"format": {"type": "text"}}) is None
    assert response_format({"format": {"type": "json_schema", "name": "p", "schema": PERSON, "strict": True}}) == \
        {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}


def test_output_events_and_response_validate_against_the_sdk_types():
    """Reasoning, content and two calls (the embedded model writes no reasoning): every stream event and
    the final Response validate against the SDK's pydantic types (required fields included)."""
    from pydantic import TypeAdapter
    from openai.types.responses import Response, ResponseStreamEvent

    from mlx_engine.serve.jobs import Done
    from mlx_engine.serve.responses_api import Output, Reply
    from mlx_engine.toolcalls.stream import CallArgs, CallStart, Text

    class Service:
        model_id = "m"

        class tokenizer:
            @staticmethod
            def encode(text, add_special_tokens=True):
                return text.split()

    class Job:
        name = "resp_1"

    reply = Reply(Job, body(input="Hi", tools=[WEATHER, {"type": "web_search"}], reasoning={"effort": "high"}),
                  Service)
    out = Output()
    events = [out.event("response.created", response=reply.snapshot())]
    for ev in [Text("reasoning", "Think "), Text("reasoning", "twice."), Text("content", "Calling."),
               CallStart(0, "call_a", "get_weather"), CallArgs(0, '{"city": '), CallArgs(0, '"Paris"}'),
               CallStart(1, "call_b", "get_weather"), CallArgs(1, '{"city": "Lyon"}')]:
        events += out.feed(ev)
    done = Done("tool_calls", 5, 9, {})
    events += out.finish(done)
    final = reply.final(out, done)
    events.append(out.event("response.completed", response=final))
    parsed = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in events]
    assert [e.sequence_number for e in parsed] == list(range(len(events)))
    assert [e.type for e in parsed] == [
        "response.created",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    r = Response.model_validate(final)
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call", "function_call"]
    assert r.output[0].content[0].text == "Think twice." and r.output_text == "Calling."
    assert [(o.call_id, o.arguments) for o in r.output[2:]] == [("call_a", '{"city": "Paris"}'),
                                                                ("call_b", '{"city": "Lyon"}')]
    assert r.status == "completed" and r.usage.output_tokens_details.reasoning_tokens == 2
    assert [t.name for t in r.tools] == ["get_weather"] and r.reasoning.effort == "high"
    # the items as each was added: empty, in progress
    assert parsed[1].item.status == "in_progress" and parsed[14].item.arguments == ""


# -- through the server, with the SDK ---------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    s = RunningServer("--batching", "continuous", "--drafter", "mtp", "--max-concurrency", "4", "--max-tokens", "64")
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_text_with_instructions(server, client):
    r = client.responses.create(model=server.model, instructions="You are a helpful assistant.", input="Say hello.",
                                max_output_tokens=24)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == server.model
    assert r.status == "completed", r
    assert r.output_text.strip()
    [msg] = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content[0].type == "output_text" and msg.content[0].text == r.output_text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 24
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "You are a helpful assistant." and r.max_output_tokens == 24


def test_items_with_a_developer_message_are_chat_completions_system_message(client):
    r = client.responses.create(input=[{"role": "developer", "content": "Answer in one word."},
                                       {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]}],
                                max_output_tokens=8, store=True, include=["reasoning.encrypted_content"],
                                prompt_cache_key="session-1", metadata={"k": "v"}, user="u", truncation="auto",
                                reasoning={"effort": "low"})
    chat = client.chat.completions.create(model="m", max_tokens=8, messages=[
        {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.prompt_cache_key == "session-1" and r.metadata == {"k": "v"} and r.reasoning.effort == "low"


def test_streamed_and_not_the_same_answer_events_in_order(client):
    ask = dict(instructions="Be brief.", input="Tell me about Paris.", max_output_tokens=12)
    whole = client.responses.create(**ask)
    events = list(client.responses.create(**ask, stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    deltas = types[4:-4]
    assert deltas and set(deltas) == {"response.output_text.delta"}
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{'completed' if whole.status == 'completed' else 'incomplete'}"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.id == final.id and events[2].item.id == final.output[0].id


def test_forced_function_call_named_and_required_streamed_and_not(client):
    ask = dict(input="What is the weather in Paris?", tools=[WEATHER], parallel_tool_calls=False,
               max_output_tokens=40)
    named = client.responses.create(**ask, tool_choice={"type": "function", "name": "get_weather"})
    assert named.status == "completed", named
    [call] = named.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    assert named.tool_choice.name == "get_weather" and named.tools[0].name == "get_weather"

    with client.responses.stream(**ask, model="m", tool_choice="required") as s:  # the SDK's own accumulator
        events = list(s)
        final = s.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    [streamed] = final.output
    assert streamed.type == "function_call" and "".join(deltas) == done.arguments == streamed.arguments
    assert streamed.arguments == call.arguments  # greedy: the same call as the answer whole
    assert [e.type for e in events if not e.type.endswith(".delta")] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]


def test_a_conversation_with_function_call_and_output_items(client):
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": "call_abc", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_abc", "output": "Sunny, 21 C"}]
    r = client.responses.create(input=items, tools=[WEATHER], max_output_tokens=8)
    assert r.status in ("completed", "incomplete") and r.output
    chat = client.chat.completions.create(model="m", max_tokens=8, tools=[{"type": "function", "function": {
        k: v for k, v in WEATHER.items() if k != "type"}}], messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_abc", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "Sunny, 21 C"}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens  # the same prompt as chat completions renders


def test_text_format_json_schema(client):
    r = client.responses.create(input="Ada Lovelace was 36. Give her name and age in JSON.", max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                 "strict": True}})
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema"


def test_max_output_tokens_cut_is_incomplete(client):
    r = client.responses.create(input="Write a long story about a dragon.", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[-1].status == "incomplete"


@pytest.mark.parametrize("extra, words", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, "input_image"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "nope"),
])
def test_refusals_name_what_is_refused(client, extra, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"input": "Hi", "max_output_tokens": 4, **extra})
    assert words in e.value.message


def test_a_web_search_tool_is_skipped_with_a_log_line(client, caplog):
    logger = logging.getLogger("mlx_engine.serve")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="mlx_engine.serve")
    try:
        r = client.responses.create(input="Hi", tools=[{"type": "web_search"}], max_output_tokens=4)
        deadline = time.time() + 5  # the request log's line is written once the answer is sent
        while "POST /v1/responses 200" not in caplog.text and time.time() < deadline:
            time.sleep(0.05)
    finally:
        logger.removeHandler(caplog.handler)
    assert r.output and r.tools == []
    assert "tools[0] of type 'web_search' skipped" in caplog.text
    assert "POST /v1/responses 200" in caplog.text  # the request log's line
