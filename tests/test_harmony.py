"""gpt-oss's Harmony answers (mlx_engine/toolcalls/harmony.py): each channel lands where agents read it, a call
comes whole when its message ends (never when the answer was cut inside it), the reading is the same however the
text is split into deltas, and a forced call's grammar (harmony_grammar.py) writes a call the reader reads back."""

from __future__ import annotations

import json

import pytest

import grammar_util as gu
import reader_util
from mlx_engine.toolcalls import detect
from mlx_engine.toolcalls.grammars import forced_call, optional_calls
from mlx_engine.toolcalls.harmony import HARMONY
from mlx_engine.toolcalls.stream import reader_for
from test_toolcalls import ADD, WEATHER, _tokenizer, _walk

ANALYSIS = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"

# (the answer after `<|start|>assistant`, with its stop token; reasoning, content, calls)
ANSWERS = [
    (ANALYSIS + ' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris", '
     '"unit": "c"}<|call|>', "Need the weather.", "", [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    (ANALYSIS + '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"b": 2, "a": 1}<|call|>',
     "Need the weather.", "", [("add", '{"b": 2, "a": 1}')]),  # the recipient after the channel
    ('<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.add<|channel|>commentary'
     ' json<|message|>{"b": 2, "a": 1}<|call|>', "", "Checking.", [("add", '{"b": 2, "a": 1}')]),  # a preamble
    (ANALYSIS + "<|channel|>final<|message|>It is sunny.<|return|>", "Need the weather.", "It is sunny.", []),
    (ANALYSIS + '<|channel|>commentary to=python <|constrain|>code<|message|>print("hi")<|call|>',
     "Need the weather.", "", []),  # a built-in tool: not the client's
    ('<|channel|>analysis<|message|>Write <|call|> or <|channel|>final? No.<|end|><|start|>assistant to=functions.add'
     '<|channel|>commentary <|constrain|>json<|message|>{"b": 1, "a": 0}<|call|>',
     "Write <|call|> or <|channel|>final? No.", "", [("add", '{"b": 1, "a": 0}')]),  # marker text in the reasoning
    (' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "a<|call|>b<|end|>", '
     '"unit": "f"}<|call|>', "", "", [("get_weather", '{"city": "a<|call|>b<|end|>", "unit": "f"}')]),
]


def read(text: str, cuts=(), truncated: bool = False):
    """`text` fed to the Harmony reader cut at `cuts` -> (reasoning, content, [(name, arguments)])."""
    reasoning, content, calls = reader_util.read(reader_for(HARMONY, None, False, [WEATHER, ADD]), text, cuts, truncated)
    assert all(i.startswith("call_") for _, _, i in calls)
    return reasoning, content, [(n, a) for n, a, _ in calls]


@pytest.mark.parametrize("text,reasoning,content,calls", ANSWERS)
def test_each_channel_lands_where_agents_read_it_however_the_text_is_split(text, reasoning, content, calls):
    assert read(text) == (reasoning, content, calls)
    for cut in range(1, len(text)):
        assert read(text, [cut]) == (reasoning, content, calls), cut
    assert read(text, range(1, len(text))) == (reasoning, content, calls)  # one character per delta


def test_an_answer_cut_inside_a_call_returns_no_call():
    text = ANSWERS[0][0].removesuffix("<|call|>")
    for end in range(len(ANALYSIS), len(text) + 1):  # cut in the call's header, or in its arguments
        reasoning, content, calls = read(text[:end], range(1, end), truncated=True)
        assert calls == [] and reasoning == "Need the weather." and content == ""
    assert read(text)[2] == [("get_weather", '{"city": "Paris", "unit": "c"}')]  # the same, ended by its stop token


def test_garbled_headers_and_unknown_channels_are_dropped_not_parsed():
    assert read("<|channel|>??<|end|><|start|>assistant<|channel|>final<|message|>Hi.<|return|>") == ("", "Hi.", [])
    assert read("<|channel|>comment<|message|>some text<|end|>") == ("", "", [])
    assert read(ANALYSIS + '<|channel|>final {"answer": "hi"}<|return|>') == ("Need the weather.", "", [])


def test_a_template_with_harmony_s_markers_is_detected():
    tok = _tokenizer("{%- for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endfor %}"
                     "{{- '<|start|>assistant to=' + 'functions.' + 'x' + '<|channel|>commentary json<|message|>' }}")
    assert detect(tok) is HARMONY


def test_a_forced_call_s_grammar_writes_a_call_the_reader_reads_back():
    import numpy as np

    small = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"b": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["b", "a"], "additionalProperties": False}}}
    g = forced_call(HARMONY, [small], gu.llg_tokenizer())
    for seed, head in enumerate([ANALYSIS, " to=", ANALYSIS + " to="]):  # (a random walk never ends free text)
        m = g.matcher()
        m.consume(gu.encode(head))
        out = gu.encode(head) + _walk(m, np.random.default_rng(seed))
        assert m.complete
        reasoning, content, calls = read(gu.decode(out))
        assert reasoning == ("Need the weather." if head.startswith(ANALYSIS) else "") and content == ""
        assert [c[0] for c in calls] == ["add"] and set(json.loads(calls[0][1])) == {"a", "b"}
    assert optional_calls(HARMONY, [small], gu.llg_tokenizer()) is None  # auto: parsed, not constrained


def test_a_forced_call_may_follow_the_reasoning_and_holds_the_tool_s_schema():
    from mlx_engine.grammar import GrammarViolation

    g = forced_call(HARMONY, [WEATHER, ADD], gu.llg_tokenizer())
    call = ANSWERS[0][0].removesuffix("<|call|>")  # the template's form, after the analysis message
    for text in (call, call[len(ANALYSIS):]):
        m = g.matcher()
        m.consume(gu.encode(text))
        assert m.complete
    m = g.matcher()
    with pytest.raises(GrammarViolation):  # arguments outside the schema
        m.consume(gu.encode(' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": 3'))
    m = g.matcher()
    with pytest.raises(GrammarViolation):  # content instead of a call
        m.consume(gu.encode("<|channel|>final<|message|>Hi"))
