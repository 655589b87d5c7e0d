"""Qwen's XML tool calls (toolcalls/qwen3_xml.py) and the Hermes JSON calls' end (toolcalls/stream.py): the values
as the template wrote them, closing tags inside a value, left-out close tags, bare `<function=` calls, a call
inside the reasoning, a cut answer, and a forced call's grammar read back by the reader."""

from __future__ import annotations

import json
import random

import grammar_util as gu
import reader_util
from mlx_engine.toolcalls.formats import JSON
from mlx_engine.toolcalls.qwen3_xml import QWEN3_XML, parse_qwen3_xml, typed_value
from mlx_engine.toolcalls.stream import CallArgs, CallStart, reader_for

WRITE = {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}}}}}
ALARM = {"type": "function", "function": {"name": "set_alarm", "parameters": {"type": "object", "properties": {
    "hour": {"type": "integer"}, "volume": {"type": "number"}, "repeat": {"type": "boolean"},
    "label": {"type": ["string", "null"]}, "note": {"type": "string"},
    "when": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "tags": {"$ref": "#/$defs/tags"}},
    "$defs": {"tags": {"type": "array", "items": {"type": "string"}}}}}}
TOOLS = [WRITE, ALARM]
THINK = ("<think>", "</think>")


def read(fmt, text, cuts=(), reasoning=False, truncated=False):
    """`text` through fmt's reader cut at `cuts` -> (reasoning, content, [(name, arguments as a dict)])."""
    r, c, calls = reader_util.read(reader_for(fmt, THINK, reasoning, TOOLS), text, cuts, truncated)
    return r, c, [(n, json.loads(a)) for n, a, _ in calls]


def every_split(fmt, text, **kw):
    """The reading of `text` whole, checked equal under every single cut and random many-cut splits."""
    whole, rng = read(fmt, text, **kw), random.Random(0)
    for n in list(range(1, len(text))) + [None] * 10:
        cuts = [n] if n is not None else rng.sample(range(1, len(text)), min(len(text) - 1, 25))
        assert read(fmt, text, cuts, **kw) == whole, cuts
    return whole


def test_closing_tags_inside_a_value_are_its_text_and_whitespace_is_kept():
    value = "  Close with </parameter> and </function> then </tool_call>; open <parameter=path> <tool_call>.\n"
    text = (f"Writing.\n<tool_call>\n<function=write_file>\n<parameter=path>\nx.md\n</parameter>\n"
            f"<parameter=content>\n{value}\n</parameter>\n</function>\n</tool_call>")
    assert every_split(QWEN3_XML, text) == ("", "Writing.", [("write_file", {"path": "x.md", "content": value})])


def test_values_are_typed_by_the_schema():
    body = ("\n<function=set_alarm>\n<parameter=hour>\n7\n</parameter>\n<parameter=volume>\n1e20\n</parameter>\n"
            "<parameter=repeat>\nTrue\n</parameter>\n<parameter=label>\nNone\n</parameter>\n<parameter=note>\nnull\n"
            "</parameter>\n<parameter=when>\n5\n</parameter>\n<parameter=tags>\n['a', \"b\"]\n</parameter>\n"
            "<parameter=extra>\n{\"k\": 1}\n</parameter>\n</function>\n")
    [call] = parse_qwen3_xml(body, TOOLS)
    assert json.loads(call.arguments) == {"hour": 7, "volume": 1e20, "repeat": True, "label": None, "note": "null",
                                          "when": 5, "tags": ["a", "b"], "extra": {"k": 1}}
    assert typed_value("02139", {"type": "string"}, {}) == "02139"  # a string never read as a number
    assert typed_value("some text", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, {}) == "some text"
    assert typed_value("7.5", {"type": "integer"}, {}) == 7.5  # fits no type: kept as the model wrote it


def test_left_out_close_tags_and_calls_without_their_opener():
    text = ("<function=set_alarm>\n<parameter=hour>\n6\n<parameter=note>\ngym\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=write_file>\n<parameter=path>\na\n</parameter>\n</function>\n</tool_call>")
    assert every_split(QWEN3_XML, text) == ("", "", [("set_alarm", {"hour": 6, "note": "gym"}),
                                                     ("write_file", {"path": "a"})])
    prose = "Write <function=name> to open a call, then <function=x>."  # no call: text as it came
    assert every_split(QWEN3_XML, prose) == ("", prose, [])


def test_a_call_inside_the_reasoning_ends_it_and_a_cut_call_is_never_returned():
    text = "Need the directory.\n<tool_call>\n<function=write_file>\n<parameter=path>\n.\n</parameter>\n</function>\n</tool_call>"
    assert every_split(QWEN3_XML, text, reasoning=True) == ("Need the directory.", "", [("write_file", {"path": "."})])
    cut = "Sure.\n</think>\n\nOk.\n<tool_call>\n<function=write_file>\n<parameter=content>\nrm -rf /"
    assert every_split(QWEN3_XML, cut, reasoning=True, truncated=True) == ("Sure.", "Ok.", [])
    hermes = 'Ok.\n<tool_call>\n{"name": "write_file", "arguments": {"path": "a.md", "content": "</tool_call>"}}\n</tool_call>'
    assert every_split(JSON, hermes) == ("", "Ok.", [("write_file", {"path": "a.md", "content": "</tool_call>"})])
    assert every_split(JSON, hermes[:-20], truncated=True) == ("", "Ok.", [])


def test_a_forced_call_s_grammar_is_read_back_by_the_reader():
    import numpy as np

    from mlx_engine.toolcalls.grammars import forced_call

    small = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"b": {"type": "integer", "minimum": 0, "maximum": 9}, "s": {"type": "string",
                                                                                                  "enum": [" a</parameter> b "]}},
        "required": ["b", "s"], "additionalProperties": False}}}
    m = forced_call(QWEN3_XML, [small], gu.llg_tokenizer(), parallel=False).matcher()
    rng, out = np.random.default_rng(3), []
    while not m.complete and len(out) < 400:  # random legal tokens (forced runs whole) to the grammar's end
        forced = m.forced()
        if not forced:
            bits = np.unpackbits(m.mask()[0].view(np.uint8), bitorder="little")[: gu.VOCAB]
            forced = [int(rng.choice([t for t in np.flatnonzero(bits) if t not in m.eos]))]
        m.consume(forced)
        out += forced
    assert m.complete
    r = reader_for(QWEN3_XML, None, False, [small])
    events = r.feed(gu.decode(out)) + r.finish()
    starts = [e for e in events if isinstance(e, CallStart)]
    args = json.loads("".join(e.text for e in events if isinstance(e, CallArgs)))
    assert [s.name for s in starts] == ["add"] and isinstance(args.pop("b"), int) and args == {"s": " a</parameter> b "}
