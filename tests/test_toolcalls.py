"""Tool calls per family (mlx_engine/toolcalls): text in each family's published format parses into calls
(arguments kept as written, key order included); an answer split at every point of its text gives the same
reasoning, content and calls as the whole (streamed deltas reassemble to the non-streamed call);
conversations with calls and results render through each family's template (tests/toolcall_templates.py)
and round-trip: the rendered call parses back into the same call; the family is detected from its
template; a forced call's grammar writes the family's own format."""

from __future__ import annotations

import json
import random

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from transformers import PreTrainedTokenizerFast

import grammar_util as gu
import reader_util
from mlx_engine.toolcalls import CallArgs, CallStart, Splitter, Text, detect, template_input
from mlx_engine.toolcalls.formats import DEEPSEEK, FUNCTION_GEMMA, GENERIC, JSON, mlx_lm_format
from mlx_engine.toolcalls.gemma4 import GEMMA4  # (our readers: detect() picks them for these families)
from mlx_engine.toolcalls.grammars import forced_call
from mlx_engine.toolcalls.llama import LLAMA3
from mlx_engine.toolcalls.mistral import MISTRAL
from toolcall_templates import DEEPSEEK_TEMPLATE, JSON_TEMPLATE, LLAMA3_TEMPLATE

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}, "required": ["b", "a"]}}}

# the published formats (families' model cards and templates), each with the calls it holds
PUBLISHED = [
    (JSON, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
           '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"b": 2, "a": 1}}\n</tool_call>',
     "Let me check.", [("get_weather", '{"city": "Paris", "unit": "c"}'), ("add", '{"b": 2, "a": 1}')]),
    (DEEPSEEK, 'Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
               '{"city": "Paris", "unit": "c"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n'
               '```json\n{"b": 2, "a": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "Checking.", [("get_weather", '{"city": "Paris", "unit": "c"}'), ("add", '{"b": 2, "a": 1}')]),
    (DEEPSEEK, '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo", "unit": "f"}'
               '<｜tool▁call▁end｜><｜tool▁calls▁end｜>',  # V3.1's form
     "", [("get_weather", '{"city": "Oslo", "unit": "f"}')]),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', "",
     [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    (LLAMA3, '<|python_tag|>{"name": "add", "parameters": {"b": 2, "a": 1}}', "", [("add", '{"b": 2, "a": 1}')]),
    (mlx_lm_format("qwen3_coder"), '<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
                                   '<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>', "",
     [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    (mlx_lm_format("glm47"), '<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>'
                             '<arg_key>unit</arg_key><arg_value>c</arg_value></tool_call>', "",
     [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    (mlx_lm_format("pythonic"), '<|tool_call_start|>[get_weather(city="Paris", unit="c"), add(b=2, a=1)]'
                                '<|tool_call_end|>Checking both.', "Checking both.",  # LFM2's (text may follow)
     [("get_weather", '{"city": "Paris", "unit": "c"}'), ("add", '{"b": 2, "a": 1}')]),
    (FUNCTION_GEMMA, "<start_function_call>call:get_weather{city:<escape>Paris, {France}<escape>,unit:<escape>c<escape>}"
                     "<end_function_call><start_function_call>call:add{b:2,a:1}<end_function_call>", "",
     [("get_weather", '{"city": "Paris, {France}", "unit": "c"}'), ("add", '{"b": 2, "a": 1}')]),
]


def split(fmt, text, cuts, think=None, reasoning=False, tools=(WEATHER, ADD)):
    """Feed `text` cut at `cuts`; -> (reasoning, content, [(name, arguments)], the events)."""
    events = reader_util.fed(Splitter(fmt, think, reasoning, list(tools)), text, cuts)
    reasoning_text, content, calls = reader_util.merged(events)
    assert all(i.startswith("call_") or fmt.name == "kimi_k2" for _, _, i in calls)
    return reasoning_text, content, [(n, a) for n, a, _ in calls], events


@pytest.mark.parametrize("fmt,text,content,calls", PUBLISHED, ids=[p[0].name for p in PUBLISHED])
def test_published_formats_parse_into_calls_split_anywhere(fmt, text, content, calls):
    whole = split(fmt, text, [])
    assert whole[:3] == ("", content, calls)
    rng = random.Random(0)
    for n in list(range(1, len(text))) + [None] * 20:  # every single cut, then random many-cut splits
        cuts = [n] if n is not None else rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 30)))
        assert split(fmt, text, cuts)[:3] == whole[:3], cuts


def test_a_json_call_comes_whole_at_its_end_marker_and_a_cut_one_never():
    """No piece of a call before its end marker (a call the answer never finishes must never reach the client,
    canitoolcall's spec); `</tool_call>` inside a JSON string is text; an answer cut at its token limit drops
    the call it left open, markup included."""
    text = ('<tool_call>\n{"name": "echo", "arguments": {"text": "Use <tool_call> ... </tool_call> tags."}}\n'
            '</tool_call>')
    s = Splitter(JSON, None, False, [WEATHER, ADD])
    for i, ch in enumerate(text):  # a character at a time
        events = s.feed(ch)
        if i < len(text) - 1:
            assert not any(isinstance(e, (CallStart, CallArgs)) for e in events), (i, events)
    assert [type(e).__name__ for e in events] == ["CallStart", "CallArgs"]
    assert events[0].name == "echo" and json.loads(events[1].text) == {"text": "Use <tool_call> ... </tool_call> tags."}
    cut = Splitter(JSON, None, False, [WEATHER, ADD])
    events = cut.feed('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    events += cut.finish(truncated=True)
    assert events == [Text("content", "I will check.")] and not cut.made_calls


def test_reasoning_is_split_off_and_markers_inside_it_are_text():
    think = ("<think>", "</think>")
    text = 'I should call <tool_call> maybe.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"b": 1, "a": 2}}\n</tool_call>'
    for cuts in ([], list(range(1, len(text), 3)), [5, 17, 40]):
        reasoning, content, calls, _ = split(JSON, text, cuts, think, reasoning=True)
        assert reasoning == "I should call <tool_call> maybe." and content == ""  # (the template's newline not)
        assert calls == [("add", '{"b": 1, "a": 2}')]
    opened = "<think>hmm</think>The answer is 4."  # the model opens its reasoning itself
    assert split(JSON, opened, [3, 9], think)[:3] == ("hmm", "The answer is 4.", [])
    assert split(None, "no tools <tool_call>{}</tool_call>", [4])[:3] == ("", "no tools <tool_call>{}</tool_call>", [])


def test_text_between_markers_that_is_no_call_stays_content():
    text = "Use <tool_call>not json</tool_call> here"
    for cuts in ([], [4], [3, 4, 5], list(range(1, len(text)))):
        assert split(JSON, text, cuts)[:3] == ("", text, [])


def _tokenizer(template: str):
    hf = PreTrainedTokenizerFast(tokenizer_object=gu.tokenizer(), eos_token="<|im_end|>")
    hf.chat_template = template
    return TokenizerWrapper(hf)


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris, and 2 + 1?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "c", "city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"b": 2, "a": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "3"},
]


@pytest.mark.parametrize("template,fmt", [(JSON_TEMPLATE, JSON), (DEEPSEEK_TEMPLATE, DEEPSEEK), (LLAMA3_TEMPLATE, LLAMA3),
                                          (None, GENERIC)], ids=["json", "deepseek_v3", "llama3_json", "generic"])
def test_a_history_with_calls_and_results_renders_through_the_family_s_template(template, fmt):
    from mlx_engine.serve.turn import Turn, prepare

    tok = _tokenizer(template or "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert detect(tok) is fmt
    prepared = prepare(Turn("m", messages=HISTORY, tools=[WEATHER, ADD]), tok, gu.VOCAB)
    text = tok.decode(prepared.prompt, skip_special_tokens=False)
    assert "18 C, sunny" in text and "Be brief." in text and "get_weather" in text
    assert '{"unit": "c", "city": "Paris"}' in text  # the arguments' key order as the model wrote them
    if fmt is not LLAMA3:  # (Llama 3's template writes each call alone, as its JSON)
        calls = [c for c in _calls_in(text, fmt)]
        assert calls == [("get_weather", '{"unit": "c", "city": "Paris"}'), ("add", '{"b": 2, "a": 1}')]
    assert prepared.answer.fmt is fmt


def _calls_in(text: str, fmt) -> list:
    """The calls in a rendered prompt, read back by the format's own splitter."""
    start = text.index(fmt.start)
    end = text.rindex(fmt.end) + len(fmt.end)
    return split(fmt, text[start:end], [])[2]


QWEN3_CODER, GLM47, LAGUNA = mlx_lm_format("qwen3_coder"), mlx_lm_format("glm47"), mlx_lm_format("laguna")
KIMI_K2, MINIMAX = mlx_lm_format("kimi_k2"), mlx_lm_format("minimax_m2")
PYTHONIC = mlx_lm_format("pythonic")
CONSTRAINED = [JSON, GENERIC, DEEPSEEK, KIMI_K2, MISTRAL, QWEN3_CODER, GLM47, LAGUNA, MINIMAX, GEMMA4, PYTHONIC,
               FUNCTION_GEMMA]


@pytest.mark.parametrize("fmt", CONSTRAINED + [LLAMA3], ids=lambda f: f.name)
def test_a_forced_call_s_grammar_writes_the_family_s_format(fmt):
    """Walk the grammar to its end (a valid call of `add`), then parse the text as the family's call."""
    import numpy as np

    small = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"b": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["b", "a"], "additionalProperties": False}}}
    g = forced_call(fmt, [small], gu.llg_tokenizer(), parallel=False)
    m = g.matcher()
    out = _walk(m, np.random.default_rng(1))
    assert m.complete
    calls = split(fmt, gu.decode(out), [])[2]
    assert len(calls) == 1 and calls[0][0] == "add" and set(json.loads(calls[0][1])) == {"a", "b"}


# -- tool_choice auto with strict tools: free text, and any call held to its tool's schema --------------------

SMALL = {"type": "function", "function": {"name": "add", "strict": True, "parameters": {
    "type": "object", "properties": {"b": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["b", "a"], "additionalProperties": False}}}


def _walk(m, rng, limit=400) -> list[int]:
    """Random legal tokens (forced runs taken whole) until the grammar is complete."""
    import numpy as np

    out = []
    while not m.complete and len(out) < limit:
        forced = m.forced()
        if forced:
            m.consume(forced)
            out += forced
            continue
        bits = np.unpackbits(m.mask()[0].view(np.uint8), bitorder="little")[: gu.VOCAB]
        allowed = [t for t in np.flatnonzero(bits) if t not in m.eos]
        out.append(int(rng.choice(allowed)))
        m.consume(out[-1:])
    return out


def _ends_here(m) -> bool:
    import numpy as np

    bits = np.unpackbits(m.mask()[0].view(np.uint8), bitorder="little")
    return bool(bits[gu.eos()])


BAD_ADD = {"json": '\n{"name": "add", "arguments": {"b": "x"', "generic": '\n{"name": "add", "arguments": {"b": "x"',
           "deepseek_v3": '<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{"b": "x"',
           "qwen3_coder": "\n<function=add>\n<parameter=b>\nx", "glm47": "add<arg_key>b</arg_key><arg_value>x",
           "laguna": "add<arg_key>b</arg_key><arg_value>x",
           "kimi_k2": '<|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>{"b": "x"',
           "mistral": '[TOOL_CALLS]add[ARGS]{"b": "x"', "minimax_m2": '\n<invoke name="add">\n<parameter name="b">x',
           "gemma4": 'call:add{a:<|"|>x', "pythonic": '[add(b="x"',
           "function_gemma": "call:add{b:<escape>x"}


@pytest.mark.parametrize("fmt", CONSTRAINED, ids=lambda f: f.name)
def test_an_optional_call_s_grammar_takes_free_text_then_calls_held_to_the_schema(fmt):
    import numpy as np
    from mlx_engine.grammar import GrammarViolation
    from mlx_engine.toolcalls.grammars import optional_calls, strict_view

    g = optional_calls(fmt, strict_view([SMALL]), gu.llg_tokenizer(), parallel=False)
    m = g.matcher()
    m.consume(gu.encode("The quick brown fox jumps over the lazy dog."))  # free text, and the answer may end
    assert _ends_here(m)
    for seed in range(3):  # text, the opener, then whatever the grammar allows: a call of add, in the format
        m = g.matcher()
        head = gu.encode("Hello, world! " + fmt.start)
        m.consume(head)
        assert not _ends_here(m)  # an opened call must be finished
        out = head + _walk(m, np.random.default_rng(seed))
        assert m.complete
        _, content, calls, _ = split(fmt, gu.decode(out), [], tools=[SMALL])
        assert content.strip() == "Hello, world!" and len(calls) == 1 and calls[0][0] == "add"
        assert set(json.loads(calls[0][1])) == {"a", "b"} and all(0 <= v <= 9 for v in json.loads(calls[0][1]).values())
    m = g.matcher()  # a call whose arguments break the strict tool's schema is refused
    with pytest.raises(GrammarViolation):
        m.consume(gu.encode(fmt.start + BAD_ADD[fmt.name]))


EDIT = {"type": "function", "function": {"name": "edit", "strict": True, "parameters": {
    "type": "object", "$defs": {"span": {"type": "object", "properties": {"line": {"type": "integer"}},
                                         "required": ["line"], "additionalProperties": False}},
    "properties": {"path": {"type": "string"}, "mode": {"enum": ["replace", "insert"]}, "dry": {"type": "boolean"},
                   "at": {"$ref": "#/$defs/span"}, "note": {"type": "string"}},
    "required": ["path", "mode", "at"], "additionalProperties": False}}}
EDIT_ARGS = {"path": 'src/a "b".py', "mode": "insert", "dry": True, "at": {"line": 3}, "note": "x < y\nand </p>"}


def _xml_call(fmt, args: dict, glm_newlines: bool = False) -> str:
    """A call of `edit` as the family's template renders it (Qwen: Python's True for a boolean)."""
    def text(v):
        return v if isinstance(v, str) else "True" if v is True else json.dumps(v)

    if fmt is QWEN3_CODER:
        body = "".join(f"<parameter={k}>\n{text(v)}\n</parameter>\n" for k, v in args.items())
        return f"<tool_call>\n<function=edit>\n{body}</function>\n</tool_call>"
    if fmt in (GEMMA4, FUNCTION_GEMMA):  # strings between marks, keys bare (in the order given)
        mark = '<|"|>' if fmt is GEMMA4 else "<escape>"

        def gemma(v):
            if isinstance(v, str):
                return f"{mark}{v}{mark}"
            if isinstance(v, dict):
                return "{" + ",".join(f"{k}:{gemma(x)}" for k, x in v.items()) + "}"
            return json.dumps(v)
        if fmt is FUNCTION_GEMMA:
            return f"<start_function_call>call:edit{gemma(args)}<end_function_call>"
        return f"<|tool_call>call:edit{gemma(args)}<tool_call|>"
    if fmt is PYTHONIC:  # LFM2's: keyword arguments, Python's True, JSON for the rest
        body = ", ".join(f"{k}={'True' if v is True else json.dumps(v)}" for k, v in args.items())
        return f"<|tool_call_start|>[edit({body})]<|tool_call_end|>"
    if fmt is MINIMAX:  # (its template: tojson for what is not a string)
        body = "".join(f'<parameter name="{k}">{v if isinstance(v, str) else json.dumps(v)}</parameter>\n'
                       for k, v in args.items())
        return f'<minimax:tool_call>\n<invoke name="edit">\n{body}</invoke>\n</minimax:tool_call>'
    nl = "\n" if glm_newlines else ""
    body = "".join(f"{nl}<arg_key>{k}</arg_key>{nl}<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>"
                   for k, v in args.items())
    return f"<tool_call>edit{body}{nl}</tool_call>"


@pytest.mark.parametrize("fmt,newlines", [(QWEN3_CODER, False), (GLM47, False), (GLM47, True), (LAGUNA, False),
                                          (MINIMAX, False), (GEMMA4, False), (PYTHONIC, False), (FUNCTION_GEMMA, False)],
                         ids=["qwen3_coder", "glm47", "glm45", "laguna", "minimax_m2", "gemma4", "pythonic",
                              "function_gemma"])
def test_xml_calls_hold_each_argument_to_its_parameter_s_schema(fmt, newlines):
    """Strings as raw text (quotes, newlines, tags other than the closer kept), enums, booleans, a $ref'd object;
    the call parses back into the arguments; a wrong enum, a missing required or an unknown parameter, an
    object off its schema, and a reordered call are refused."""
    from jsonschema import validate

    from mlx_engine.grammar import GrammarViolation
    from mlx_engine.toolcalls.grammars import forced_call, optional_calls, strict_view

    edit = dict(sorted(EDIT_ARGS.items())) if fmt is GEMMA4 else EDIT_ARGS  # (Gemma 4's template sorts keys)
    for g in (forced_call(fmt, [EDIT, ADD], gu.llg_tokenizer()), optional_calls(fmt, [EDIT, ADD], gu.llg_tokenizer())):
        text = _xml_call(fmt, edit, newlines)
        m = g.matcher()
        m.consume(gu.encode(text))
        assert _ends_here(m)
        (name, args), = split(fmt, text, [], tools=[EDIT])[2]
        assert name == "edit" and json.loads(args) == EDIT_ARGS
        validate(json.loads(args), EDIT["function"]["parameters"])
        without = {k: v for k, v in edit.items() if k not in ("dry", "note")}  # optional ones left out
        m = g.matcher()
        m.consume(gu.encode(_xml_call(fmt, without, newlines)))
        assert _ends_here(m)
        for bad in ({**edit, "mode": "delete"}, {k: v for k, v in edit.items() if k != "mode"},
                    {**edit, "extra": "1"}, {**edit, "at": {"line": "3"}}, dict(reversed(list(edit.items())))):
            m = g.matcher()
            with pytest.raises(GrammarViolation):
                m.consume(gu.encode(_xml_call(fmt, bad, newlines)))
                assert _ends_here(m), bad  # (a prefix of a call may be legal; its end is not)
                m.consume([gu.eos()])
    loose = optional_calls(fmt, strict_view([{**EDIT, "function": {k: v for k, v in EDIT["function"].items()
                                                                   if k != "strict"}}]), gu.llg_tokenizer())
    m = loose.matcher()  # a tool not marked strict: any parameters, text values
    m.consume(gu.encode(_xml_call(fmt, {"anything": "goes", "mode": "delete"}, newlines)))
    assert _ends_here(m)


@pytest.mark.parametrize("fmt,call", [
    (JSON, '<tool_call>\n{{"name": "edit", "arguments": {a}}}\n</tool_call>'),
    (GENERIC, '<tool_call>\n{{"name": "edit", "arguments": {a}}}\n</tool_call>'),
    (LLAMA3, '{{"name": "edit", "parameters": {a}}}'),
    (MISTRAL, '[TOOL_CALLS][{{"name": "edit", "arguments": {a}}}]'),
    (MISTRAL, '[TOOL_CALLS]edit[ARGS]{a}'),
    (DEEPSEEK, '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>edit<｜tool▁sep｜>{a}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    (KIMI_K2, '<|tool_calls_section_begin|><|tool_call_begin|>functions.edit:0<|tool_call_argument_begin|>{a}'
              '<|tool_call_end|><|tool_calls_section_end|>'),
], ids=["json", "generic", "llama3_json", "mistral_list", "mistral", "deepseek_v31", "kimi_k2"])
def test_json_calls_hold_arguments_whose_schema_refers_to_its_own_defs(fmt, call):
    """A parameters schema with $defs (what pydantic writes) held in the JSON forms, forced and under auto:
    its local $refs resolve against the parameters, wherever the call's grammar puts them (they were
    resolved against the call's whole JSON, and compiling failed); a value off the referenced schema is
    refused."""
    from mlx_engine.grammar import GrammarViolation
    from mlx_engine.toolcalls.grammars import optional_calls

    good, bad = json.dumps(EDIT_ARGS), json.dumps({**EDIT_ARGS, "at": {"line": "3"}})
    for g in (forced_call(fmt, [EDIT, ADD], gu.llg_tokenizer()), optional_calls(fmt, [EDIT, ADD], gu.llg_tokenizer())):
        m = g.matcher()
        m.consume(gu.encode(call.format(a=good)))
        assert _ends_here(m)
        with pytest.raises(GrammarViolation):
            g.matcher().consume(gu.encode(call.format(a=bad)))


PUBLISHED_KIMI = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                  '{"city": "Paris", "unit": "c"}<|tool_call_end|><|tool_call_begin|>functions.add:1'
                  '<|tool_call_argument_begin|>{"b": 2, "a": 1}<|tool_call_end|><|tool_calls_section_end|>')


@pytest.mark.parametrize("fmt,text", [
    (DEEPSEEK, PUBLISHED[1][1][PUBLISHED[1][1].index(DEEPSEEK.start):]),  # V3's form, two calls
    (DEEPSEEK, '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo", "unit": "f"}'
               '<｜tool▁call▁end｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"b": 2, "a": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),  # V3.1's
    (KIMI_K2, PUBLISHED_KIMI),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}[TOOL_CALLS]add[ARGS]{"b": 2, "a": 1}'),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
              '{"name": "add", "arguments": {"b": 2, "a": 1}}]'),  # the older list form
], ids=["deepseek_v3", "deepseek_v31", "kimi_k2", "mistral", "mistral_list"])
def test_each_family_s_published_calls_are_what_its_forced_grammar_allows(fmt, text):
    from mlx_engine.grammar import GrammarViolation

    g = forced_call(fmt, [WEATHER, ADD], gu.llg_tokenizer())
    m = g.matcher()
    m.consume(gu.encode(text))
    assert _ends_here(m)
    assert [c[0] for c in split(fmt, text, [], tools=[WEATHER, ADD])[2]] == ["get_weather", "add"]
    one = forced_call(fmt, [WEATHER, ADD], gu.llg_tokenizer(), parallel=False).matcher()
    with pytest.raises(GrammarViolation):  # one call only
        one.consume(gu.encode(text))
        one.consume([gu.eos()])


# LFM2's template as its model card describes it: the tools listed in the system turn, each message's content
# (a tool result between its markers), and never a message's tool_calls
LFM2_TEMPLATE = ("{%- if tools -%}<|im_start|>system\nList of tools: <|tool_list_start|>{{ tools | tojson }}"
                 "<|tool_list_end|><|im_end|>\n{%- endif -%}{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
                 "{%- if m.role == 'tool' -%}<|tool_response_start|>{{ m.content }}<|tool_response_end|>"
                 "{%- else -%}{{ m.content }}{%- endif -%}<|im_end|>\n{%- endfor -%}"
                 "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")


def test_the_parser_a_checkpoint_names_wins_over_the_template_s():
    """mlx-lm's conversions name their parser in tokenizer_config.json (`tool_parser_type`: Laguna's "laguna",
    whose template reads as GLM-4.7's): detect takes it, as mlx-lm does, and its calls are constrained in
    GLM-4.7's form; a name mlx-lm has no parser for is ignored."""
    template = "{% for m in messages %}{{ m.content }}{% endfor %}<tool_call>{{ name }}<arg_key>"
    tok = _tokenizer(template)
    assert detect(tok).name == "glm47"
    tok._tokenizer.init_kwargs["tool_parser_type"] = "laguna"
    fmt = detect(tok)
    assert fmt.name == "laguna"
    m = forced_call(fmt, [SMALL], gu.llg_tokenizer(), parallel=False).matcher()
    m.consume(gu.encode(fmt.start + "add<arg_key>b</arg_key><arg_value>3</arg_value>"))
    for bad in ("../json_tools", "no_such_parser", 3):
        tok._tokenizer.init_kwargs["tool_parser_type"] = bad
        assert detect(tok).name == "glm47"


def test_an_lfm2_history_s_calls_are_written_into_its_content():
    """LFM2's template renders an assistant's content only: a history's calls reach it as the model writes
    them, `<|tool_call_start|>[name(key=value, ...)]<|tool_call_end|>` (Python's True, a nested object as a
    dict), and its parser reads them back into the same calls, key order kept. A template that reads
    tool_calls gets them as they are."""
    from mlx_engine.serve.turn import Turn, prepare
    from mlx_engine.toolcalls import template_input

    tok = _tokenizer(LFM2_TEMPLATE)
    assert detect(tok).name == "pythonic"
    edit = {"id": "call_3", "type": "function", "function": {
        "name": "edit", "arguments": '{"path": "a \\"b\\".py", "dry": true, "at": {"line": 3}}'}}
    history = HISTORY[:2] + [{**HISTORY[2], "content": "Checking.", "tool_calls": HISTORY[2]["tool_calls"] + [edit]}]
    text = tok.decode(prepare(Turn("m", messages=history, tools=[WEATHER, ADD]), tok, gu.VOCAB).prompt,
                      skip_special_tokens=False)
    assert ('<|tool_call_start|>[get_weather(unit="c", city="Paris"), add(b=2, a=1), '
            'edit(path="a \\"b\\".py", dry=True, at={"line": 3})]<|tool_call_end|>Checking.') in text
    assert _calls_in(text, PYTHONIC) == [("get_weather", '{"unit": "c", "city": "Paris"}'), ("add", '{"b": 2, "a": 1}'),
                                         ("edit", '{"path": "a \\"b\\".py", "dry": true, "at": {"line": 3}}')]
    reads = LFM2_TEMPLATE + "{% for m in messages %}{{ m.tool_calls }}{% endfor %}"
    messages, _ = template_input(history, PYTHONIC, [WEATHER], template=reads)
    assert messages[2]["tool_calls"] and messages[2]["content"] == "Checking."


def test_a_pythonic_call_names_only_python_identifiers():
    """LFM2's calls are Python: a tool or parameter name Python cannot write is refused by name, not
    constrained into text the parser cannot read; a dotted name is a Python name."""
    from mlx_engine.grammar.spec import GrammarError

    def tool(name, key="x"):
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {key: {"type": "integer"}}, "required": [key]}}}

    for bad, named in ((tool("get-weather"), "get-weather"), (tool("f", "from"), "from"), (tool("f", "a b"), "a b")):
        with pytest.raises(GrammarError, match=named):
            forced_call(PYTHONIC, [bad], gu.llg_tokenizer())
    m = forced_call(PYTHONIC, [tool("tools.add")], gu.llg_tokenizer()).matcher()
    text = "<|tool_call_start|>[tools.add(x=3)]<|tool_call_end|>"
    m.consume(gu.encode(text))
    assert _ends_here(m) and split(PYTHONIC, text, [], tools=[tool("tools.add")])[2] == [("tools.add", '{"x": 3}')]
    # the server: a forced call of such a tool is a 400 naming it; under auto the answer is parsed, not held
    from mlx_engine.serve.errors import APIError
    from mlx_engine.serve.turn import Turn, prepare

    tok = _tokenizer("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "{% if tools %}{{- '<|tool_call_start|>' }}{% endif %}")
    dashed = {**tool("get-weather"), "function": {**tool("get-weather")["function"], "strict": True}}
    messages = [{"role": "user", "content": "weather?"}]
    with pytest.raises(APIError, match="get-weather"):
        prepare(Turn("m", messages=messages, tools=[dashed], tool_choice="required"), tok, gu.VOCAB)
    assert prepare(Turn("m", messages=messages, tools=[dashed], tool_choice="auto"), tok, gu.VOCAB).grammar is None


def test_a_recursive_schema_is_held_to_its_first_level_in_gemma4_s_calls():
    from mlx_engine.grammar import GrammarViolation

    tree = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "$defs": {"node": {"type": "object", "properties": {
            "name": {"type": "string"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "required": ["name"]}},
        "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"]}}}
    g = forced_call(GEMMA4, [tree], gu.llg_tokenizer())
    text = '<|tool_call>call:tree{root:{kids:[{name:<|"|>b<|"|>}],name:<|"|>a<|"|>}}<tool_call|>'
    m = g.matcher()
    m.consume(gu.encode(text))
    assert _ends_here(m)
    assert json.loads(split(GEMMA4, text, [], tools=[tree])[2][0][1]) == {"root": {"kids": [{"name": "b"}], "name": "a"}}
    with pytest.raises(GrammarViolation):  # the first level is held: root needs its name
        g.matcher().consume(gu.encode('<|tool_call>call:tree{root:{kids:[]}}'))


def test_a_model_s_own_call_ids_are_kept():
    """Kimi K2 writes `functions.NAME:N` as each call's id and its template renders that id back (in the call
    and its result): the client gets the model's id; a repeated one is replaced."""
    ids = [e.id for e in split(KIMI_K2, PUBLISHED_KIMI, [])[3] if isinstance(e, CallStart)]
    assert ids == ["functions.get_weather:0", "functions.add:1"]
    repeated = PUBLISHED_KIMI.replace("functions.add:1", "functions.get_weather:0")
    ids = [e.id for e in split(KIMI_K2, repeated, [])[3] if isinstance(e, CallStart)]
    assert ids[0] == "functions.get_weather:0" and ids[1].startswith("call_")


def test_kimi_k2_s_template_gets_call_ids_in_its_own_form():
    """Kimi K2's template renders each call's id (and `## Return of ID`): a client's own ids (OpenAI's
    call_..., Anthropic's toolu_...) reach it as `functions.NAME:N`, N the conversation's running call index,
    the same in the call and its result; the model's own ids are kept."""
    from mlx_engine.toolcalls import template_input

    def call(cid, name):
        return {"id": cid, "type": "function", "function": {"name": name, "arguments": "{}"}}

    history = [{"role": "user", "content": "go"},
               {"role": "assistant", "content": "", "tool_calls": [call("functions.get_weather:0", "get_weather"),
                                                                   call("toolu_01A", "add")]},
               {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
               {"role": "tool", "tool_call_id": "toolu_01A", "content": "3"},
               {"role": "assistant", "content": "", "tool_calls": [call("call_xyz", "add")]},
               {"role": "tool", "tool_call_id": "call_xyz", "content": "4"}]
    got, _ = template_input(history, KIMI_K2, [WEATHER, ADD])
    assert [c["id"] for m in got for c in m.get("tool_calls", [])] == [
        "functions.get_weather:0", "functions.add:1", "functions.add:2"]
    assert [m["tool_call_id"] for m in got if m["role"] == "tool"] == [
        "functions.get_weather:0", "functions.add:1", "functions.add:2"]
    other, _ = template_input(history, QWEN3_CODER, [WEATHER, ADD])  # other families: ids as the client sent
    assert [m["tool_call_id"] for m in other if m["role"] == "tool"][1:] == ["toolu_01A", "call_xyz"]


def test_llama3_auto_is_text_or_one_call_held_to_the_schema():
    """Llama 3 has no opener: the whole answer is a call or it is text. Text may not begin as a call does."""
    import numpy as np
    from mlx_engine.grammar import GrammarViolation
    from mlx_engine.toolcalls.grammars import optional_calls, strict_view

    g = optional_calls(LLAMA3, strict_view([SMALL]), gu.llg_tokenizer())
    for text, calls in (("The answer is 3.", []), ('{"name": "add", "parameters": {"b": 2, "a": 1}}', [("add", '{"b": 2, "a": 1}')]),
                        ('<|python_tag|>{"name": "add", "parameters": {"b": 2, "a": 1}}', [("add", '{"b": 2, "a": 1}')])):
        m = g.matcher()
        m.consume(gu.encode(text))
        assert _ends_here(m) and split(LLAMA3, text, [], tools=[SMALL])[2] == calls
    for bad in ('{"name": "add", "parameters": {"b": "x"', '{"name": "sub"', "{not a call}"):
        with pytest.raises(GrammarViolation):
            g.matcher().consume(gu.encode(bad))
    m = g.matcher()
    m.consume(gu.encode("{"))
    out = gu.encode("{") + _walk(m, np.random.default_rng(0))
    (name, args), = split(LLAMA3, gu.decode(out), [], tools=[SMALL])[2]
    assert name == "add" and set(json.loads(args)) == {"a", "b"}


def test_a_tool_not_marked_strict_takes_any_object_under_auto():
    from mlx_engine.grammar import GrammarViolation
    from mlx_engine.toolcalls.grammars import optional_calls, strict_view

    g = optional_calls(GENERIC, strict_view([SMALL, WEATHER]), gu.llg_tokenizer())
    m = g.matcher()
    m.consume(gu.encode('<tool_call>\n{"name": "get_weather", "arguments": {"anything": [1, 2]}}\n</tool_call>'))
    assert _ends_here(m)  # get_weather's own schema is not held (not strict); its name is
    m = g.matcher()
    with pytest.raises(GrammarViolation):
        m.consume(gu.encode('<tool_call>\n{"name": "get_time"'))


def test_an_opener_that_is_one_special_token_is_named_by_the_grammar():
    """Qwen's `<tool_call>` is one special token: free text cannot write it, the call starts with it."""
    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from mlx_engine.grammar import grammar_tokenizer
    from mlx_engine.toolcalls.grammars import optional_calls, strict_view

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=gu.VOCAB, special_tokens=gu.SPECIALS + ["<tool_call>", "</tool_call>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(gu._corpus(), trainer)
    eos, opener = tok.token_to_id("<|im_end|>"), tok.token_to_id("<tool_call>")
    g = optional_calls(JSON, strict_view([SMALL]), grammar_tokenizer(tok, gu.VOCAB, [eos]), parallel=False)
    m = g.matcher()
    m.consume(tok.encode("Sure.").ids)
    bits = np.unpackbits(m.mask()[0].view(np.uint8), bitorder="little")
    assert bits[opener] and bits[eos]  # the call may start here, or the answer end
    m.consume([opener])
    assert tok.decode(m.forced(), skip_special_tokens=False).startswith('\n{"name": "add"')


def test_auto_holds_calls_to_the_grammar_only_with_a_strict_tool():
    from mlx_engine.serve.turn import Turn, prepare

    tok = _tokenizer(JSON_TEMPLATE)
    messages = [{"role": "user", "content": "2 + 1?"}]
    loose = {"type": "function", "function": {k: v for k, v in SMALL["function"].items() if k != "strict"}}
    assert prepare(Turn("m", messages=messages, tools=[loose]), tok, gu.VOCAB).grammar is None
    strict = prepare(Turn("m", messages=messages, tools=[SMALL, WEATHER]), tok, gu.VOCAB).grammar
    assert strict is not None
    m = strict.matcher()
    m.consume(gu.encode("Let me add.\n"))  # free text before a call
    assert prepare(Turn("m", messages=messages, tools=[SMALL], tool_choice="none"), tok, gu.VOCAB).grammar is None


@pytest.mark.parametrize("fmt,marker", [(QWEN3_CODER, "{{- '<tool_call>\\n<function=' }}"),
                                        (PYTHONIC, "{{- '<|tool_call_start|>' }}"),
                                        (FUNCTION_GEMMA, "{{- '<start_function_call>' }}")],
                         ids=["qwen3_coder", "pythonic", "function_gemma"])
def test_a_model_s_forced_and_strict_auto_calls_are_constrained(fmt, marker):
    """The server's wiring: a template in Qwen3-Coder's (LFM2's) form is detected, and tool_choice required / auto
    with a strict tool get its call grammar (before, they went unconstrained)."""
    from mlx_engine.serve.turn import Turn, prepare

    tok = _tokenizer("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "{% if tools %}" + marker + "{% endif %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert detect(tok).name == fmt.name
    messages = [{"role": "user", "content": "edit it"}]
    text = _xml_call(fmt, EDIT_ARGS)
    for choice, head in (("required", ""), ("auto", "Sure.\n")):
        g = prepare(Turn("m", messages=messages, tools=[EDIT], tool_choice=choice), tok, gu.VOCAB).grammar
        m = g.matcher()
        m.consume(gu.encode(head + text))
        assert _ends_here(m)
