"""Tool calls through /v1/chat/completions, driven by the official openai SDK against the embedded SmolLM2
(its template has no tool section: the generic <tool_call> form, tools described in the system message)
with its MTP head drafting: tool_choice required and named held to the tool's schema (valid arguments,
finish_reason tool_calls), streamed delta.tool_calls reassembling to the non-streamed call, a history
with calls and results rendered into the prompt, tool_choice none hiding the tools, auto parsed; and the
engine thread's split of an answer with reasoning, content and calls (jobs.Output) over special-token
markers, as the engine emits tokens a cycle at a time."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

import grammar_util as gu
from mlx_engine.serve.jobs import Done, Job, Output, Request
from mlx_engine.serve.turn import AnswerSpec
from mlx_engine.toolcalls import CallArgs, CallStart, Text
from mlx_engine.toolcalls.formats import JSON
from serve_util import RunningServer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["continuous", "fair"])
def server(request):
    s = RunningServer("--batching", request.param, "--drafter", "mtp", "--max-concurrency", "4", "--max-tokens", "80")
    yield s
    s.close()


def call_of(r):
    assert r.choices[0].finish_reason == "tool_calls", r
    calls = r.choices[0].message.tool_calls
    assert calls and all(c.id.startswith("call_") and c.type == "function" for c in calls)
    return calls


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_forced_call_is_valid_and_streams_as_deltas(server, choice):
    client = server.client()
    r = client.chat.completions.create(model=server.model, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                       max_tokens=80)
    calls = call_of(r)
    by_name = {"get_weather": WEATHER, "get_time": TIME}
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), by_name[c.function.name]["function"]["parameters"])
    if isinstance(choice, dict):
        assert {c.function.name for c in calls} == {"get_weather"}
    assert r.choices[0].message.content is None  # only calls
    assert r.model_extra["speculation"]["forced"] > 0  # the grammar drafted the call's fixed text
    # streamed: the id and name first, then the arguments whole once the call is closed (a call the answer
    # never finished is never sent: toolcalls.stream); the same call
    pieces = {}
    for chunk in client.chat.completions.create(model=server.model, messages=ASK, tools=[WEATHER, TIME],
                                                tool_choice=choice, max_tokens=80, stream=True):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = pieces.setdefault(d.index, {"id": None, "name": None, "arguments": "", "deltas": 0})
            if d.id:
                assert entry["id"] is None and entry["arguments"] == ""  # id and name come first, once
                entry["id"], entry["name"] = d.id, d.function.name
            entry["arguments"] += d.function.arguments or ""
            entry["deltas"] += 1
    assert [(p["name"], p["arguments"]) for _, p in sorted(pieces.items())] == \
        [(c.function.name, c.function.arguments) for c in calls]
    assert all(p["deltas"] == 2 for p in pieces.values())  # its name, then its arguments in one piece


def test_a_history_with_calls_and_results_is_rendered(server):
    client = server.client()
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_7", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"unit": "celsius", "city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "It is 18 degrees and sunny in Paris."}]
    r = client.chat.completions.create(model=server.model, messages=history, tools=[WEATHER], max_tokens=24)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    from mlx_engine.serve.turn import Turn, prepare

    prompt = prepare(Turn(server.model, messages=history, tools=[WEATHER]), server.service.tokenizer,
                     server.service.vocab_size).prompt
    text = server.service.tokenizer.decode(prompt)
    assert "18 degrees and sunny" in text and '{"unit": "celsius", "city": "Paris"}' in text  # order as written
    assert r.usage.prompt_tokens == len(prompt)


def test_tool_choice_none_hides_the_tools_and_auto_is_parsed(server):
    client = server.client()
    none = client.chat.completions.create(model=server.model, messages=ASK, tools=[WEATHER], tool_choice="none",
                                          max_tokens=16)
    plain = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=16)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # no tool section in the prompt
    assert none.choices[0].message.tool_calls is None
    auto = client.chat.completions.create(model=server.model, messages=ASK, tools=[WEATHER], max_tokens=80)
    msg = auto.choices[0].message
    if msg.tool_calls:  # whatever the small model chooses, a call is parsed out of the content
        assert auto.choices[0].finish_reason == "tool_calls" and "<tool_call>" not in (msg.content or "")
    else:
        assert msg.content


# -- the engine thread's split, over special-token markers -------------------------------------------------------

def _special_tokenizer():
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(gu.tokenizer().to_str())  # a copy: the shared one stays as every other test knows it
    tok.add_special_tokens([AddedToken("<tool_call>", special=True), AddedToken("</tool_call>", special=True)])
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>"))


def test_the_engine_thread_splits_reasoning_content_and_calls_over_special_markers():
    async def run():
        tok = _special_tokenizer()
        inner = tok._tokenizer
        special = frozenset(inner.all_special_ids)
        text = ('<think>\nThe user wants weather.\n</think>\n\nChecking.<tool_call>\n{"name": "get_weather", '
                '"arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>')
        ids = inner.encode(text, add_special_tokens=False) + [gu.eos()]
        assert all(m in ids for m in (gu.think_end(), inner.convert_tokens_to_ids("<tool_call>")))  # markers: one token
        answer = AnswerSpec(JSON, (WEATHER,), ("<think>", "</think>"), reasoning=False)
        job = Job(Request(list(range(5)), 200, answer=answer))
        out = Output(job, tok, special, frozenset([gu.eos()]))
        at, sizes = 0, [1, 3, 5, 2, 4]  # the engine's cycles: several tokens at a time
        while at < len(ids):
            n = sizes[at % len(sizes)]
            if out.add(ids[at: at + n]):
                break
            at += n
        out.finish({})
        await asyncio.sleep(0)
        events = []
        while not job.events.empty():
            events.append(job.events.get_nowait())
        return events

    events = asyncio.run(run())
    reasoning = "".join(e.text for e in events if isinstance(e, Text) and e.kind == "reasoning")
    content = "".join(e.text for e in events if isinstance(e, Text) and e.kind == "content")
    starts = [e for e in events if isinstance(e, CallStart)]
    args = "".join(e.text for e in events if isinstance(e, CallArgs))
    assert reasoning.strip() == "The user wants weather." and content == "Checking."
    assert [s.name for s in starts] == ["get_weather"] and json.loads(args) == {"city": "Paris", "unit": "celsius"}
    assert isinstance(events[-1], Done) and events[-1].finish_reason == "tool_calls"
