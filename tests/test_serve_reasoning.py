"""Reasoning through the server: a template that opens <think> when `chat_template_kwargs` asks for it
(Qwen3's enable_thinking), a tiny reasoning model over the grammar tests' tokenizer (<think> and </think>
are special tokens there), served with and without speculation (the target as its own draft): the thinking
comes back as reasoning_content (streamed as delta.reasoning_content), never in content, the same with
speculation on and off; without enable_thinking there is no reasoning."""

from __future__ import annotations

import json

import pytest
from mlx_lm.utils import save_config, save_model

import grammar_util as gu
import tiny_models
from serve_util import RunningServer
from toolcall_templates import JSON_TEMPLATE


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("reasoner")
    model, config = tiny_models.build("llama", seed=1, vocab=gu.VOCAB)
    save_model(path, model)
    save_config(dict(config), path / "config.json")
    gu.tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "chat_template": JSON_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


@pytest.fixture(scope="module")
def servers(folder):
    plain = RunningServer("--model", str(folder), "--batching", "fair", "--drafter", "none", "--max-tokens", "24")
    spec = RunningServer("--model", str(folder), "--batching", "fair", "--drafter", "draft", "--draft-model",
                         str(folder), "--num-draft", "3", "--max-tokens", "24")
    yield plain, spec
    plain.close()
    spec.close()


def ask(server, thinking: bool, stream: bool = False):
    client = server.client()
    kw = dict(model=server.model, messages=[{"role": "user", "content": "Think, then answer."}], max_tokens=24,
              extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    if not stream:
        m = client.chat.completions.create(**kw).choices[0].message
        return (m.model_extra or {}).get("reasoning_content") or "", m.content or ""
    reasoning = content = ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        d = chunk.choices[0].delta if chunk.choices else None
        if d is not None:
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
    return reasoning, content


def test_thinking_comes_apart_from_the_content_with_speculation_on_and_off(servers):
    plain, spec = servers
    r_plain = ask(plain, True)
    assert r_plain[0], "the prompt opened <think>: the answer starts in the reasoning"
    for server in (plain, spec):
        for stream in (False, True):
            reasoning, content = ask(server, True, stream)
            assert (reasoning, content) == r_plain  # lossless: the same split with speculation on
            assert "<think>" not in content and "</think>" not in content and reasoning not in content


def test_without_enable_thinking_there_is_no_reasoning(servers):
    plain, spec = servers
    for server in (plain, spec):
        reasoning, content = ask(server, False)
        assert reasoning == "" and content
