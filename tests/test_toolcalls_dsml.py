"""DeepSeek V3.2 / V4 / V4.1's DSML calls (mlx_engine/toolcalls/dsml.py, dsml_grammar.py): what DeepSeek's own
encoder writes (mlx-lm's port, mlx_lm/chat_templates/deepseek_v32.py) parses back into the same calls, split
anywhere; the checkpoint is detected from its template text or mlx-lm's DSML renderer; a forced call's
grammar writes the dialect and reads back through the reader; tag text in a value stays in the value; a cut
answer keeps its complete invokes only; a block that is no calls is content."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from mlx_lm.chat_templates import deepseek_v32
from mlx_lm.tokenizer_utils import TokenizerWrapper

import grammar_util as gu
import reader_util
from mlx_engine.toolcalls import detect
from mlx_engine.toolcalls.dsml import FORMATS
from mlx_engine.toolcalls.grammars import forced_call
from mlx_engine.toolcalls.stream import reader_for
from test_toolcalls import ADD, WEATHER, _ends_here, _tokenizer, _walk

THINK = ("<think>", "</think>")
V32, V4, V41 = FORMATS["dsml_v32"], FORMATS["dsml_v4"], FORMATS["dsml_v41"]


def read(fmt, text, cuts=(), reasoning=False, truncated=False):
    """`text` fed in pieces cut at `cuts` -> (reasoning, content, [(name, arguments as a dict)])."""
    r, c, calls = reader_util.read(reader_for(fmt, THINK, reasoning, [WEATHER, ADD]), text, cuts, truncated)
    return r, c, [(n, json.loads(a)) for n, a, _ in calls]


def encoded(calls: list[tuple[str, dict]], content: str = "") -> str:
    """An assistant turn with `calls` as DeepSeek's encoder renders it, the end-of-sentence token cut."""
    msg = {"role": "assistant", "content": content,
           "tool_calls": [{"type": "function", "function": {"name": n, "arguments": json.dumps(a)}} for n, a in calls]}
    return deepseek_v32.render_message(0, [msg], thinking_mode="chat").removesuffix(deepseek_v32.eos_token)


CALLS = [("get_weather", {"city": "  Zürich\n", "unit": "c"}),
         ("add", {"b": 2, "a": -1.5, "tags": ["x", {"y": None}], "ok": True, "code": "007"})]


def test_the_encoder_s_calls_read_back_the_same_split_anywhere():
    text = "Reasoning here.</think>" + encoded(CALLS, "Checking both.")
    whole = read(V32, text, reasoning=True)
    assert whole == ("Reasoning here.", "Checking both.", CALLS)  # string values' whitespace kept, types kept
    rng = random.Random(0)
    for n in list(range(1, len(text), 7)) + [None] * 30:
        cuts = [n] if n is not None else rng.sample(range(1, len(text)), rng.randint(2, 40))
        assert read(V32, text, cuts, reasoning=True) == whole, cuts


@pytest.mark.parametrize("prefix,block", [("｜DSML｜", "tool_calls"), ("｜DSML｜ ", "calls")])
def test_every_dialect_is_read_whatever_the_checkpoint_s(prefix, block):
    text = encoded(CALLS).replace("｜DSML｜", prefix).replace(f"{prefix}function_calls", f"{prefix}{block}")
    assert read(V32, text)[2] == CALLS and read(V41, text)[2] == CALLS


def test_tag_text_in_a_value_stays_in_the_value():
    value = 'Write <｜DSML｜invoke name="x"> inside <｜DSML｜function_calls> then </｜DSML｜invoke> to call.'
    text = encoded([("echo", {"text": value})])
    assert read(V32, text) == ("", "", [("echo", {"text": value})])


def test_a_cut_answer_keeps_its_complete_invokes_only_and_a_bad_block_is_content():
    text = encoded(CALLS)
    cut = text[: text.index('name="b"') + 4]  # inside the second invoke
    assert read(V32, cut, truncated=True) == ("", "", [CALLS[0]])
    first = text[: text.index('name="city"') + 12]  # inside the first: no call, its text as content
    assert read(V32, first, truncated=True) == ("", first, [])  # the text as written
    bad = text.replace('string="false">2<', 'string="false">two<')  # string="false" that is no JSON
    assert read(V32, bad + "Done.") == ("", bad + "Done.", [])


def test_a_dsml_checkpoint_is_detected_by_its_template_or_mlx_lm_s_renderer():
    assert detect(_tokenizer("{{ '<｜Assistant｜>' }}{{ '<｜DSML｜tool_calls>' }}")) is V4
    assert detect(_tokenizer("{{ '<｜DSML｜ calls>' }}")) is V41
    plain = _tokenizer("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert detect(plain).name not in FORMATS
    wrapped = TokenizerWrapper(plain._tokenizer, chat_template=deepseek_v32.apply_chat_template)
    assert detect(wrapped) is V32  # tokenizer_config.json's chat_template_type: deepseek_v32


SMALL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"b": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["b", "a"], "additionalProperties": False}}}


@pytest.mark.parametrize("fmt", [V32, V4, V41], ids=lambda f: f.name)
def test_a_forced_call_s_grammar_writes_the_dialect_and_reads_back(fmt):
    m = forced_call(fmt, [SMALL], gu.llg_tokenizer(), parallel=False).matcher()
    out = gu.decode(_walk(m, np.random.default_rng(1)))
    assert m.complete and out.startswith(fmt.start) and out.endswith(fmt.end)
    calls = read(fmt, out)[2]
    assert len(calls) == 1 and calls[0][0] == "add" and set(calls[0][1]) == {"a", "b"}


def test_the_encoder_s_calls_are_what_the_forced_grammar_allows():
    from mlx_engine.grammar import GrammarViolation

    calls = [("get_weather", {"city": "Paris <b>", "unit": "c"}), ("add", {"b": 2, "a": 1})]
    text = encoded(calls).lstrip()
    m = forced_call(V32, [WEATHER, ADD], gu.llg_tokenizer()).matcher()
    m.consume(gu.encode(text))
    assert _ends_here(m) and read(V32, text)[2] == calls
    with pytest.raises(GrammarViolation):  # a unit outside the enum
        forced_call(V32, [WEATHER, ADD], gu.llg_tokenizer()).matcher().consume(
            gu.encode(text.replace('string="true">c<', 'string="true">k<')))
    with pytest.raises(GrammarViolation):  # one call only
        one = forced_call(V32, [WEATHER, ADD], gu.llg_tokenizer(), parallel=False).matcher()
        one.consume(gu.encode(text))
        one.consume([gu.eos()])
