"""logprobs and the OpenAI penalties through the server (openai SDK, embedded SmolLM2 with its MTP head):
chat logprobs / top_logprobs are the target's log-softmax at each emitted position (checked against the
model's own logits), the same with speculation on and off, streamed in chunks that add up to the whole;
completions' logprobs in the older shape; presence / frequency penalties and logit_bias change the answer
the same way with and without speculation; a logit_bias id outside the vocabulary is a 400."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import openai
import pytest

from serve_util import RunningServer

MSGS = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module", params=["continuous", "fair"])
def server(request):
    s = RunningServer("--batching", request.param, "--drafter", "mtp", "--max-concurrency", "4", "--max-tokens", "24")
    yield s
    s.close()


def chat(server, **kw):
    return server.client().chat.completions.create(model=server.model, messages=MSGS, max_tokens=12, **kw)


def test_chat_logprobs_are_the_target_s_with_speculation_on_and_off(server):
    spec = chat(server, logprobs=True, top_logprobs=3)
    plain = chat(server, logprobs=True, top_logprobs=3, extra_body={"num_draft": 0})
    a, b = spec.choices[0].logprobs.content, plain.choices[0].logprobs.content
    assert len(a) == spec.usage.completion_tokens == len(b)
    assert [e.token for e in a] == [e.token for e in b]
    np.testing.assert_allclose([e.logprob for e in a], [e.logprob for e in b], atol=1e-5)
    for e in a:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True) and e.logprob <= tops[0] + 1e-6
    # against the model itself: log-softmax of its logits at each position of prompt + answer
    tok = server.service.tokenizer
    from mlx_engine.serve.turn import encode_chat

    prompt = encode_chat(tok, MSGS)
    ids = [tok.encode(e.token, add_special_tokens=False) for e in a]
    if all(len(i) == 1 for i in ids):  # (each token's text re-encodes to itself)
        seq = prompt + [i[0] for i in ids]
        model = server.service.worker.engine.target.model
        logits = model(mx.array([seq]))[0, len(prompt) - 1 : -1].astype(mx.float32)
        ref = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        want = [ref[j, i[0]] for j, i in enumerate(ids)]
        np.testing.assert_allclose([e.logprob for e in a], want, atol=1e-4)


def test_streamed_logprobs_add_up_to_the_whole(server):
    whole = chat(server, logprobs=True, top_logprobs=1).choices[0].logprobs.content
    pieces = []
    for c in chat(server, logprobs=True, top_logprobs=1, stream=True):
        if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content:
            pieces += c.choices[0].logprobs.content
    assert [e.token for e in pieces] == [e.token for e in whole]
    np.testing.assert_allclose([e.logprob for e in pieces], [e.logprob for e in whole], atol=1e-5)


def test_completion_logprobs_in_the_older_shape(server):
    r = server.client().completions.create(model=server.model, prompt="The sky is", max_tokens=6, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(len(t) <= 2 and all(v <= 0 for v in t.values()) for t in lp.top_logprobs)
    assert all(v <= 0 and math.isfinite(v) for v in lp.token_logprobs)


def test_penalties_and_logit_bias_act_the_same_with_speculation_on_and_off(server):
    base = chat(server).choices[0].message.content
    for kw in ({"presence_penalty": 1.5}, {"frequency_penalty": 2.0}):
        spec = chat(server, **kw).choices[0].message.content
        assert spec == chat(server, extra_body={"num_draft": 0}, **kw).choices[0].message.content
    first = server.service.tokenizer.encode(base, add_special_tokens=False)[0]
    banned = chat(server, logit_bias={str(first): -100}).choices[0].message.content
    assert server.service.tokenizer.encode(banned, add_special_tokens=False)[0] != first  # that token is gone
    assert banned == chat(server, logit_bias={str(first): -100}, extra_body={"num_draft": 0}).choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="logit bias"):
        chat(server, logit_bias={str(10**7): 5})
