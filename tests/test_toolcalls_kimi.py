"""Kimi's tool calls (mlx_engine/toolcalls/kimi_k2.py, kimi_k3.py, kimi_k3_grammar.py): each published form
read into the same reasoning, content and calls however the text is split; marker text inside an argument
stays in it; a call the answer never closed is never returned; a forced call's grammar writes a call that
the reader reads back (K3 with its XTML markers as the control tokens K3's tokenizer holds them)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

import grammar_util as gu
import reader_util
from mlx_engine.toolcalls.grammars import forced_call
from mlx_engine.toolcalls.kimi_k2 import KIMI_K2
from mlx_engine.toolcalls.kimi_k3 import KIMI_K3
from mlx_engine.toolcalls.stream import reader_for

THINK_K2 = ("<think>", "</think>")
THINK_K3 = ("<|open|>think<|sep|>", "<|close|>think<|sep|>")
EDIT = {"type": "function", "function": {"name": "edit", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "mode": {"enum": ["replace", "insert"]},
                                     "line": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "dry": {"type": "boolean"}},
    "required": ["path", "mode", "line"], "additionalProperties": False}}}


def read(fmt, text, cuts=(), think=None, reasoning=False, truncated=False):
    """`text` fed cut at `cuts` -> (reasoning, content, [(name, arguments)], ids)."""
    r, c, calls = reader_util.read(reader_for(fmt, think, reasoning, [EDIT]), text, cuts, truncated)
    return r, c, [(n, json.loads(a)) for n, a, _ in calls], [i for _, _, i in calls]


def split_anywhere(fmt, text, **kw):
    whole = read(fmt, text, **kw)
    rng = random.Random(0)
    for n in list(range(1, len(text))) + [None] * 30:
        cuts = [n] if n is not None else rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 40)))
        assert read(fmt, text, cuts, **kw)[:3] == whole[:3], cuts
    return whole


K2_TWO = ('Checking both. <|tool_calls_section_begin|><|tool_call_begin|>functions.edit:0<|tool_call_argument_begin|>'
          '{"path": "a <|tool_call_end|> b.txt", "mode": "insert", "line": 3}<|tool_call_end|> noise '
          '<|tool_call_begin|>functions.edit:1 <|tool_call_argument_begin|>{"path": "c</think>", "mode": "replace", '
          '"line": 0} <|tool_call_end|><|tool_calls_section_end|> Done.')


def test_kimi_k2_calls_keep_marker_text_inside_a_string_and_content_around_them():
    reasoning, content, calls, ids = split_anywhere(KIMI_K2, "Think first.</think>" + K2_TWO, think=THINK_K2,
                                                    reasoning=True)
    assert reasoning == "Think first." and content == "Checking both.  Done."
    assert calls == [("edit", {"path": "a <|tool_call_end|> b.txt", "mode": "insert", "line": 3}),
                     ("edit", {"path": "c</think>", "mode": "replace", "line": 0})]
    assert ids == ["functions.edit:0", "functions.edit:1"]  # the model's own ids (its template renders them)
    assert KIMI_K2.parse(K2_TWO[K2_TWO.index(KIMI_K2.start) + len(KIMI_K2.start):], [EDIT])[0].name == "edit"


def test_kimi_k2_reads_an_id_without_its_prefix_and_an_empty_section():
    _, content, calls, ids = read(KIMI_K2, '<|tool_calls_section_begin|><|tool_call_begin|>edit:7'
                                           '<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>')
    assert calls == [("edit", {})] and ids[0].startswith("call_") and content == ""
    assert read(KIMI_K2, "Hi. <|tool_calls_section_begin|><|tool_calls_section_end|>")[1:3] == ("Hi. ", [])


@pytest.mark.parametrize("fmt,text", [
    (KIMI_K2, '<|tool_calls_section_begin|><|tool_call_begin|>functions.edit:0<|tool_call_argument_begin|>'
              '{"path": "a", "mode": "insert", "line": 1}<|tool_call_end|><|tool_call_begin|>functions.edit:1'
              '<|tool_call_argument_begin|>{"path": "b", "mode":'),
    (KIMI_K3, '<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="edit" index="1"<|sep|><|open|>argument '
              'key="path" type="string"<|sep|>a<|close|>argument<|sep|><|close|>call<|sep|><|open|>call tool="edit" '
              'index="2"<|sep|><|open|>argument key="path" type="string"<|sep|>b<|close|>argument<|sep|>'),
], ids=["kimi_k2", "kimi_k3"])
def test_an_answer_cut_inside_its_second_call_keeps_the_first_and_never_returns_the_second(fmt, text):
    for cuts in ([], list(range(1, len(text), 7))):
        _, content, calls, _ = read(fmt, text, cuts, truncated=True)
        assert [c[1]["path"] for c in calls] == ["a"]
        assert "b" in content  # the unclosed call's text: content, never a call


K3_CALL = ('Look it up.<|close|>think<|sep|><|open|>response<|sep|>On it.<|close|>response<|sep|><|open|>tools<|sep|>'
           '<|open|>call tool="edit" index="1"<|sep|><|open|>argument key="path" type="string"<|sep|>x <|close|>argument'
           '<|sep|> y\n "q"<|close|>argument<|sep|><|open|>argument key="line" type="number"<|sep|>3<|close|>argument'
           '<|sep|><|open|>argument key="a&amp;&quot;b&quot;" type="boolean"<|sep|>true<|close|>argument<|sep|>'
           '<|close|>call<|sep|><|open|>call tool="edit" index="2"<|sep|><|open|>json type="object"<|sep|>'
           '{"path": "<|close|>json<|sep|>", "line": 2}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
           '<|close|>message<|sep|>')


def test_kimi_k3_channels_split_into_reasoning_content_and_calls():
    reasoning, content, calls, _ = split_anywhere(KIMI_K3, K3_CALL, think=THINK_K3, reasoning=True)
    assert reasoning == "Look it up." and content == "On it."
    assert calls == [("edit", {"path": "x <|close|>argument<|sep|> y\n \"q\"", "line": 3, 'a&"b"': True}),
                     ("edit", {"path": "<|close|>json<|sep|>", "line": 2})]
    assert KIMI_K3.parse(K3_CALL[K3_CALL.index(KIMI_K3.start) + len(KIMI_K3.start):K3_CALL.index(KIMI_K3.end)],
                         [EDIT])[1] .arguments == '{"path": "<|close|>json<|sep|>", "line": 2}'


def test_kimi_k3_answer_that_skips_its_reasoning_or_opens_in_the_response():
    text = "<|open|>response<|sep|>Hello<|close|>response<|sep|><|close|>message<|sep|>"
    assert split_anywhere(KIMI_K3, text, think=THINK_K3, reasoning=True)[:3] == ("", "Hello", [])
    assert split_anywhere(KIMI_K3, "Hi!<|close|>response<|sep|>", think=THINK_K3)[:3] == ("", "Hi!", [])


def _walk(m, rng, vocab: int, closer: list[int], limit: int = 2000) -> list[int]:
    """Random legal tokens (forced runs taken whole) until the grammar is complete; where the closer's first
    token is legal, it is written now and then (a random string value would run on for long)."""
    out = []
    while not m.complete and len(out) < limit:
        forced = m.forced()
        if forced:
            m.consume(forced)
            out += forced
            continue
        bits = np.unpackbits(m.mask()[0].view(np.uint8), bitorder="little")[:vocab]
        allowed = [t for t in np.flatnonzero(bits) if t not in m.eos]
        if bits[closer[0]] and rng.random() < 0.1:
            m.consume(closer)
            out += closer
            continue
        out.append(int(rng.choice(allowed)))
        m.consume(out[-1:])
    return out


def _k3_tokenizer():
    """K3's markers as the control tokens its tokenizer holds them (tests/toolcall_replay.py's kimi-k3)."""
    import toolcall_replay
    from mlx_engine.serve.turn import _llg

    tok = toolcall_replay.tokenizer("kimi-k3")
    return tok, _llg(tok, len(tok._tokenizer))


@pytest.mark.parametrize("markers", ["special", "text"])
def test_a_forced_kimi_k3_call_is_xtml_its_reader_reads_back(markers):
    if markers == "special":
        tok, llg = _k3_tokenizer()
        vocab, decode = len(tok._tokenizer), lambda ids: tok._tokenizer.decode(ids, skip_special_tokens=False)
        assert "<[" in forced_call(KIMI_K3, [EDIT], llg).source  # the markers as their control tokens
    else:
        llg, vocab, decode = gu.llg_tokenizer(), gu.VOCAB, gu.decode
    closer = llg.tokenize_str("<|close|>") if markers == "special" else llg.tokenize_str("<|close|>argument<|sep|>")
    for seed in range(3 if markers == "special" else 0):  # (random text against a text closer: too long a walk)
        m = forced_call(KIMI_K3, [EDIT], llg, parallel=False).matcher()
        out = _walk(m, np.random.default_rng(seed), vocab, closer)
        assert m.complete
        _, content, calls, _ = read(KIMI_K3, decode(out))
        assert content == "" and len(calls) == 1 and calls[0][0] == "edit"
        args = calls[0][1]
        assert {"path", "mode", "line"} <= set(args) and args["mode"] in ("replace", "insert")
        assert isinstance(args["line"], int) and 0 <= args["line"] <= 9 and isinstance(args.get("dry", True), bool)
    m = forced_call(KIMI_K3, [EDIT], llg).matcher()  # the published render of a call is what it allows
    text = ('<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="edit" index="1"'
            '<|sep|><|open|>argument key="path" type="string"<|sep|>a "b"\n<|close|>argument<|sep|><|open|>argument '
            'key="mode" type="string"<|sep|>insert<|close|>argument<|sep|><|open|>argument key="line" type="number"'
            '<|sep|>4<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>')
    m.consume(llg.tokenize_str(text) if markers == "text" else tok._tokenizer.encode(text, add_special_tokens=False))
    bits = np.unpackbits(m.mask()[0].view(np.uint8), bitorder="little")
    assert all(bits[e] for e in m.eos)  # the answer may end here
    from mlx_engine.grammar import GrammarViolation

    bad = text.replace(">insert<", ">delete<")  # a value off its enum is refused
    with pytest.raises(GrammarViolation):
        forced_call(KIMI_K3, [EDIT], llg).matcher().consume(
            llg.tokenize_str(bad) if markers == "text" else tok._tokenizer.encode(bad, add_special_tokens=False))


def test_a_forced_kimi_k2_call_is_read_back_by_our_reader():
    m = forced_call(KIMI_K2, [EDIT], gu.llg_tokenizer(), parallel=False).matcher()
    out = _walk(m, np.random.default_rng(0), gu.VOCAB, [gu.eos()])
    assert m.complete
    _, _, calls, _ = read(KIMI_K2, gu.decode(out))
    assert len(calls) == 1 and calls[0][0] == "edit" and {"path", "mode", "line"} <= set(calls[0][1])
