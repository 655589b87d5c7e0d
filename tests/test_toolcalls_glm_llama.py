"""GLM's and Llama's tool calls (toolcalls/glm.py, toolcalls/llama.py): read as the models write them, split
anywhere, a call cut at max_tokens never returned, and a forced call's grammar writing text the reader reads
back into the call."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

import grammar_util as gu
import reader_util
from mlx_engine.grammar import GrammarViolation
from mlx_engine.toolcalls import detect
from mlx_engine.toolcalls.llama import LLAMA3
from mlx_engine.toolcalls.glm import GLM, parse_glm
from mlx_engine.toolcalls.grammars import forced_call, optional_calls
from mlx_engine.toolcalls.llama import LLAMA4, parse_pythonic
from mlx_engine.toolcalls.stream import reader_for

WRITE = {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}, "n": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
    "required": ["path", "content"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"b": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["b", "a"], "additionalProperties": False}}}


def read(fmt, text, cuts=(), truncated=False, tools=(WRITE, ADD), think=None, reasoning=False):
    """`text` through the format's stream reader, cut at `cuts` -> (reasoning, content, [(name, arguments)])."""
    r, c, calls = reader_util.read(reader_for(fmt, think, reasoning, list(tools)), text, cuts, truncated)
    return r, c, [(n, json.loads(a)) for n, a, _ in calls]


def same_split_anywhere(fmt, text, **kw):
    whole = read(fmt, text, **kw)
    rng = random.Random(0)
    for n in list(range(1, len(text))) + [None] * 10:
        cuts = [n] if n is not None else rng.sample(range(1, len(text)), min(len(text) - 1, 12))
        assert read(fmt, text, cuts, **kw) == whole, cuts
    return whole


# -- GLM ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("nl", ["", "\n"], ids=["glm47", "glm45"])
def test_glm_values_are_kept_as_written_and_typed_by_the_schema(nl):
    text = (f"<tool_call>write_file{nl}<arg_key>path</arg_key>{nl}<arg_value>  a b.txt \n</arg_value>{nl}"
            f"<arg_key>content</arg_key>{nl}<arg_value>Use <tool_call> and </tool_call>; then </arg_value> too"
            f"</arg_value>{nl}<arg_key>mode</arg_key>{nl}<arg_value>420</arg_value>{nl}<arg_key>tags</arg_key>{nl}"
            f'<arg_value>["x", "y"]</arg_value>{nl}<arg_key>n</arg_key>{nl}<arg_value>007</arg_value>{nl}</tool_call>'
            f"{nl}<tool_call>add{nl}<arg_key>b</arg_key>{nl}<arg_value>2</arg_value>{nl}<arg_key>a</arg_key>{nl}"
            f"<arg_value>1</arg_value>{nl}</tool_call>")
    assert same_split_anywhere(GLM, text) == ("", "", [
        ("write_file", {"path": "  a b.txt \n", "content": "Use <tool_call> and </tool_call>; then </arg_value> too",
                        "mode": 420, "tags": ["x", "y"], "n": "007"}),
        ("add", {"b": 2, "a": 1})])


def test_glm_a_missing_last_arg_value_close_ends_with_the_call():
    for tail in ("", "<tool_call>add<arg_key>b</arg_key><arg_value>2</arg_value><arg_key>a</arg_key>"
                     "<arg_value>1</arg_value></tool_call>"):
        text = "<tool_call>write_file<arg_key>path</arg_key><arg_value>p</arg_value><arg_key>content</arg_key>" \
               "<arg_value>hi</tool_call>" + tail
        calls = same_split_anywhere(GLM, text)[2]
        assert calls[0] == ("write_file", {"path": "p", "content": "hi"})
        assert len(calls) == (2 if tail else 1)


def test_glm_reasoning_content_and_a_cut_call():
    think = ("<think>", "</think>")
    text = "Weigh it.</think>Checking.<tool_call>add<arg_key>b</arg_key><arg_value>2</arg_value>" \
           "<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"
    assert same_split_anywhere(GLM, text, think=think, reasoning=True) == (
        "Weigh it.", "Checking.", [("add", {"b": 2, "a": 1})])
    cut = text[: text.index("</tool_call>")]
    for end in (len(cut), len(cut) - 10, len(cut) - 30):  # max_tokens inside the call: never a call
        reasoning, content, calls = read(GLM, cut[:end], truncated=True, think=think, reasoning=True)
        assert calls == [] and content.startswith("Checking.")
    with pytest.raises(Exception, match="no tool name"):
        parse_glm("<arg_key>a</arg_key><arg_value>1</arg_value>", [ADD])


def test_glm_s_forced_call_reads_back_through_its_reader():
    """GLM-4.7's grammar (xml_grammars.glm47_calls), walked at random to its end, parses back into a call of
    the tool, every argument typed."""
    from test_toolcalls import _walk

    assert detect(_tokenizer("<tool_call>{{ tc.name }}<arg_key>{{ k }}</arg_key><arg_value>")) is GLM
    for seed in range(3):
        m = forced_call(GLM, [ADD], gu.llg_tokenizer(), parallel=False).matcher()
        out = _walk(m, np.random.default_rng(seed))
        assert m.complete
        (name, args), = read(GLM, gu.decode(out), tools=[ADD])[2]
        assert name == "add" and set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())


# -- Llama 3 -----------------------------------------------------------------------------------------------

def test_llama3_calls_are_the_whole_answer_or_follow_the_python_tag():
    call = '{"name": "add", "parameters": {"b": 2, "a": 1}}'
    assert same_split_anywhere(LLAMA3, call) == ("", "", [("add", {"b": 2, "a": 1})])
    assert same_split_anywhere(LLAMA3, "Let me add. <|python_tag|>" + call) == ("", "Let me add. ",
                                                                               [("add", {"b": 2, "a": 1})])
    for text in ('{"a": 1} is a dict', "{}", '{"parameters": {}}', "The answer is 3."):  # no call: content
        assert same_split_anywhere(LLAMA3, text) == ("", text, [])
    assert read(LLAMA3, call[:-9], truncated=True)[2] == []  # cut at max_tokens
    assert read(LLAMA3, "<|python_tag|>" + call, truncated=True)[2] == []


# -- Llama 4 -----------------------------------------------------------------------------------------------

def test_llama4_pythonic_calls_are_read_with_ast_never_run():
    text = "[write_file(path='a\\'b.txt', content=\"x\", tags=['p', 'q'], mode=None, n=true), add(b=2,a=1)]"
    assert same_split_anywhere(LLAMA4, text) == ("", "", [
        ("write_file", {"path": "a'b.txt", "content": "x", "tags": ["p", "q"], "mode": None, "n": True}),
        ("add", {"b": 2, "a": 1})])
    assert read(LLAMA4, "<|python_start|>[add(b=2, a=1)]<|python_end|>")[2] == [("add", {"b": 2, "a": 1})]
    assert read(LLAMA4, "[get_time()]")[2] == [("get_time", {})]
    for text in ("[add(1, 2)]", "[add(b=__import__('os').getcwd())]", "[add(b={1, 2})]", "[]", "[1, 2] is a list",
                 "How can I help?"):  # no call: content, nothing evaluated
        assert same_split_anywhere(LLAMA4, text) == ("", text, [])
    assert read(LLAMA4, "[add(b=2, a=1)", truncated=True)[2] == []
    assert read(LLAMA4, "[add(b=2, a=1)]", truncated=True)[2] == []  # cut at max_tokens: never a call
    with pytest.raises(Exception, match="keyword"):
        parse_pythonic("[add(**x)]")


def test_llama4_is_detected_from_its_header_tokens():
    assert detect(_tokenizer("{{- '<|header_start|>assistant<|header_end|>' }}")) is LLAMA4


@pytest.mark.parametrize("parallel", [False, True])
def test_llama4_s_forced_call_reads_back_through_its_reader(parallel):
    from test_toolcalls import _ends_here, _walk

    for seed in range(3):  # random legal tokens to the grammar's end
        m = forced_call(LLAMA4, [ADD], gu.llg_tokenizer(), parallel=parallel).matcher()
        out = _walk(m, np.random.default_rng(seed))
        assert m.complete
        calls = read(LLAMA4, gu.decode(out))[2]
        assert calls and all(name == "add" and set(args) == {"a", "b"} for name, args in calls)
        assert parallel or len(calls) == 1
    text = '[write_file(path="a.txt", content="x\\ny", tags=["p"]), add(b=2, a=1)]'  # as the grammar writes them
    m = forced_call(LLAMA4, [ADD, WRITE], gu.llg_tokenizer(), parallel=parallel).matcher()
    if parallel:
        m.consume(gu.encode(text))
        assert _ends_here(m)
        assert read(LLAMA4, text)[2] == [("write_file", {"path": "a.txt", "content": "x\ny", "tags": ["p"]}),
                                         ("add", {"b": 2, "a": 1})]
    else:
        with pytest.raises(GrammarViolation):  # one call only
            m.consume(gu.encode(text))
    m = optional_calls(LLAMA4, [ADD], gu.llg_tokenizer()).matcher()
    m.consume(gu.encode("The sum is 3."))
    assert _ends_here(m)
    m = optional_calls(LLAMA4, [ADD], gu.llg_tokenizer()).matcher()
    m.consume(gu.encode("[add(b=2, a=1)]"))
    assert _ends_here(m)


def _tokenizer(template: str):
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=gu.tokenizer(), eos_token="<|im_end|>")
    hf.chat_template = template
    return TokenizerWrapper(hf)
