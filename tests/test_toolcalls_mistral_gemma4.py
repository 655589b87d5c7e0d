"""Mistral's and Gemma 4's readers (toolcalls/mistral.py, gemma4.py): what a client gets of their answers, fed
whole and cut anywhere, and a forced call's grammar read back through the reader the server uses."""

from __future__ import annotations

import json

import numpy as np
import pytest

import grammar_util as gu
import reader_util
from mlx_engine.toolcalls.gemma4 import GEMMA4
from mlx_engine.toolcalls.grammars import forced_call
from mlx_engine.toolcalls.mistral import MISTRAL
from mlx_engine.toolcalls.stream import reader_for


def read(fmt, text: str, cuts=(), truncated=False, think=None):
    """(reasoning, content, [(name, arguments dict, id)]) of `text` fed cut at `cuts`."""
    r, c, calls = reader_util.read(reader_for(fmt, think, False, []), text, cuts, truncated)
    return r, c, [(n, json.loads(a), i) for n, a, i in calls]


def every_cut(fmt, text: str, **kw):
    """The same result whole, and cut at each single place."""
    whole = read(fmt, text, **kw)
    strip_ids = lambda res: (res[0], res[1], [c[:2] for c in res[2]])  # noqa: E731 (ids are fresh per call)
    for i in range(1, len(text)):
        assert strip_ids(read(fmt, text, [i], **kw)) == strip_ids(whole), i
    return whole


MISTRAL_ANSWERS = [  # (text, reasoning, content, [(name, arguments)])
    ('[THINK]Use [TOOL_CALLS] here.[/THINK]Sure.[TOOL_CALLS]write[ARGS]{"s": "[TOOL_CALLS]x[ARGS]{} [/THINK]"}'
     '[TOOL_CALLS]add[ARGS]{"a": 1}', "Use [TOOL_CALLS] here.", "Sure.",
     [("write", {"s": "[TOOL_CALLS]x[ARGS]{} [/THINK]"}), ("add", {"a": 1})]),
    ('[TOOL_CALLS] [{"arguments": {"name": "x"}, "name": "get"}, {"name": "add", "arguments": "{\\"a\\": 2}"}]', "", "",
     [("get", {"name": "x"}), ("add", {"a": 2})]),
    ("<think>r</think>\n\nc", "r", "c", []),
    ("[TOOL_CALLS] not json at all", "", "[TOOL_CALLS] not json at all", []),
]


@pytest.mark.parametrize("text,reasoning,content,calls", MISTRAL_ANSWERS, ids=["v13", "v3", "think_text", "not_a_call"])
def test_mistral_answers_split_the_same_wherever_cut(text, reasoning, content, calls):
    got = every_cut(MISTRAL, text)
    assert got[:2] == (reasoning, content) and [c[:2] for c in got[2]] == calls


def test_mistral_s_call_id_is_the_call_s_id_not_its_name():
    _, _, calls = read(MISTRAL, '[TOOL_CALLS]f[CALL_ID]123456789[ARGS]{"a": 1}[TOOL_CALLS]g[CALL_ID]123456789[ARGS]{}')
    assert [c[0] for c in calls] == ["f", "g"] and calls[0][2] == "123456789"
    assert calls[1][2].startswith("call_")  # a repeated id is replaced: a client keys results by id


GEMMA_CALL = ('<|tool_call>call:weather.get-now{key with space:1.5e-05,s:<|"|>a <tool_call|> {b}, "c"<|"|>,'
              'n:{x:[1, <|"|>t<|"|>],ok:true,none:null}}<tool_call|>')
GEMMA_ARGS = {"key with space": 1.5e-05, "s": 'a <tool_call|> {b}, "c"', "n": {"x": [1, "t"], "ok": True, "none": None}}


def test_gemma4_answers_split_the_same_wherever_cut():
    text = "<|channel>thought\nThink.\n<channel|>Before " + GEMMA_CALL + " after" + GEMMA_CALL
    reasoning, content, calls = every_cut(GEMMA4, text)
    assert (reasoning, content) == ("Think.", "Before  after")  # the text around calls as written
    assert [c[:2] for c in calls] == [("weather.get-now", GEMMA_ARGS)] * 2


@pytest.mark.parametrize("fmt,text", [
    (GEMMA4, GEMMA_CALL),
    (MISTRAL, MISTRAL_ANSWERS[0][0]),
    (MISTRAL, MISTRAL_ANSWERS[1][0]),
], ids=["gemma4", "mistral", "mistral_list"])
def test_an_answer_cut_at_its_token_limit_returns_only_the_calls_it_closed(fmt, text):
    whole = read(fmt, text)[2]
    for n in range(len(text)):
        calls = read(fmt, text[:n], truncated=True)[2]
        content = read(fmt, text[:n], truncated=True)[1]
        assert [c[:2] for c in calls] == [c[:2] for c in whole[: len(calls)]], n
        assert fmt.start not in content, n  # (nor the unclosed call's text as content)


def test_a_finished_answer_s_unclosed_gemma4_call_is_content():
    text = '<|tool_call>call:f{a:<|"|>x'
    assert read(GEMMA4, text) == ("", text, [])
    bad = "<|tool_call>call:bad no brace<tool_call|>"  # no argument object: not a call
    assert read(GEMMA4, bad) == ("", bad, [])


@pytest.mark.parametrize("fmt", [MISTRAL, GEMMA4], ids=lambda f: f.name)
def test_a_forced_call_s_grammar_reads_back_through_the_reader(fmt):
    """A random walk of tool_choice required's grammar (two tools, parallel calls) is calls the server's reader
    returns whole, each of one of the tools with its required arguments (strings holding the formats' markers
    among them)."""
    marked = {"enum": ['x, y} "z"', "[TOOL_CALLS]f[ARGS]{}", "<tool_call|>"]}
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
                 "type": "object", "properties": {"b": {"type": "integer", "minimum": 0, "maximum": 9}, "a": marked},
                 "required": ["b", "a"], "additionalProperties": False}}},
             {"type": "function", "function": {"name": "now", "parameters": {
                 "type": "object", "properties": {"tz": {"enum": ["utc", "local"]}}, "additionalProperties": False}}}]
    for seed in range(4):
        m = forced_call(fmt, tools, gu.llg_tokenizer()).matcher()
        rng, out = np.random.default_rng(seed), []
        while not m.complete and len(out) < 300:
            forced = m.forced()
            if forced:
                m.consume(forced)
                out += forced
                continue
            bits = np.unpackbits(m.mask()[0].view(np.uint8), bitorder="little")
            if bits[gu.eos()] and rng.random() < 0.5:  # the calls may end here: end them
                break
            out.append(int(rng.choice([t for t in np.flatnonzero(bits[: gu.VOCAB]) if t not in m.eos])))
            m.consume(out[-1:])
        text = gu.decode(out)
        reasoning, content, calls = read(fmt, text)
        assert calls and not content.strip() and not reasoning, text
        for name, args, _ in calls:
            assert name in ("add", "now") and (name == "now" or set(args) == {"a", "b"}), text
