"""Gemma 4's assistant drafter: logits against a numpy forward from the checkpoint's tensors, greedy output
== mlx-lm's plain decoding for every k, the target's distribution at temperature 1, and the target KV it
reads after partial accepts == a fresh prefill of the committed prefix (the target's rollback, a wrapped
sliding window included, is the only rollback)."""

import functools

import mlx.core as mx
import numpy as np
import pytest

import gemma4_util as g
from mlx_engine import Engine, GenerationConfig, SamplingConfig
from mlx_engine.drafters.gemma4_assistant import Gemma4AssistantDrafter, load_assistant
from mlx_engine.target_model.hidden import FINAL_HIDDEN
from mlx_engine.target_model.model import Target
from reference import mlx_lm_greedy

VOCAB = 32
PROMPT = [3, 17, 22, 9, 28, 7, 5, 20, 17, 22, 9]
N_TOKENS = 40


@functools.cache
def target():
    return g.build_target(VOCAB, seed=2)


@functools.cache
def assistant_dir(tmp_root, ordered=False, echo=False):
    """A random assistant (drafts nearly always rejected) or an 'echo' one (often accepted: gemma4_util.echo)."""
    from pathlib import Path

    path = Path(tmp_root) / f"assistant-{ordered}-{echo}"
    embed = np.array(target().model.embed_tokens.weight) if echo else None
    tensors = g.write_assistant(path, VOCAB, ordered=ordered, echo_embed=embed)
    return path, tensors


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("gemma4"))


def prefix_kv(model, tokens):
    """The target's shared K/V of `tokens`, from a fresh one-pass prefill, read straight off the arrays."""
    cache = Target(model).make_cache()
    model(mx.array(tokens)[None], cache=cache)
    k0, v0 = cache[0].keys[0, :, : cache[0].offset], cache[0].values[0, :, : cache[0].offset]  # sliding: layer 0
    k1, v1 = cache[1].keys[0, :, : cache[1].offset], cache[1].values[0, :, : cache[1].offset]  # full: layer 1
    return {"sliding_attention": (np.array(k0[:, -g.WINDOW :]), np.array(v0[:, -g.WINDOW :])),
            "full_attention": (np.array(k1), np.array(v1))}


@pytest.mark.parametrize("ordered", [False, True], ids=["tied-head", "ordered-embeddings"])
def test_logits_match_numpy_reference(root, ordered):
    path, w = assistant_dir(root, ordered)
    model = target()
    t = Target(model)
    cache = t.make_cache()
    logits, hidden = t.forward(mx.array(PROMPT), cache, FINAL_HIDDEN)
    first = int(mx.argmax(logits[-1]))
    drafter = Gemma4AssistantDrafter(load_assistant(path), model)
    drafter.attach_target_cache(cache)
    drafter.begin(PROMPT + [first], hidden)
    assert drafter.store == {"sliding_attention": 0, "full_attention": 1}

    kv_ref = prefix_kv(model, PROMPT)
    E = np.array(model.model.embed_tokens.weight)
    kv = drafter.shared_kv()
    tok, h, h_ref = first, drafter._h, np.array(hidden[-1])
    for _ in range(4):  # chained steps at the one fixed position
        lg, h = drafter.step(mx.array([tok]), h, kv, len(PROMPT))
        x = np.concatenate([E[tok] * np.sqrt(g.TARGET_H), h_ref])
        lg_ref, h_ref = g.reference_step(w, g.assistant_config(VOCAB, ordered), x, kv_ref, len(PROMPT))
        np.testing.assert_allclose(np.array(lg[0]), lg_ref, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.array(h[0]), h_ref, rtol=1e-4, atol=1e-4)
        tok = int(np.argmax(lg_ref))


@functools.cache
def plain():
    return mlx_lm_greedy(target(), PROMPT, N_TOKENS)


def run(drafter, k, n=N_TOKENS, sampling=None, seed=0):
    engine = Engine(target(), drafter)
    cfg = GenerationConfig(max_tokens=n, num_draft=k, seed=seed, sampling=sampling or SamplingConfig())
    return [t for s in engine.generate(PROMPT, cfg) for t in s.tokens], engine.stats


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("echo", [False, True], ids=["random", "echo"])
def test_greedy_equals_plain_decoding(root, echo, k):
    drafter = Gemma4AssistantDrafter(load_assistant(assistant_dir(root, echo=echo)[0]), target())
    tokens, stats = run(drafter, k)
    assert tokens == plain()
    assert stats.drafted > 0
    if echo:
        assert stats.accepted > 0


class CheckingDrafter(Gemma4AssistantDrafter):
    """Before every draft: the target KV and hidden row it reads equal a fresh prefill of the prefix."""

    checks = 0

    def propose(self, k, sampling, key):
        prefix = self.history[:-1]
        ref = prefix_kv(self.target.model, prefix)
        for t, (K, V) in self.shared_kv().items():
            np.testing.assert_allclose(np.array(K[0]), ref[t][0], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(np.array(V[0]), ref[t][1], rtol=1e-5, atol=1e-5)
        _, h = Target(self.target.model).forward(mx.array(prefix), Target(self.target.model).make_cache(), True)
        np.testing.assert_allclose(np.array(self._h[0]), np.array(h[-1]), rtol=1e-5, atol=1e-5)
        self.checks += 1
        return super().propose(k, sampling, key)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("echo, temperature", [(True, 0.0), (False, 1.0)], ids=["echo-greedy", "random-t1"])
def test_rollback_is_exact_after_partial_accepts(root, echo, temperature, k):
    drafter = CheckingDrafter(load_assistant(assistant_dir(root, echo=echo)[0]), target())
    tokens, stats = run(drafter, k, sampling=SamplingConfig(temperature=temperature))
    assert drafter.checks > 5
    assert len(PROMPT) + N_TOKENS > 2 * g.WINDOW  # the sliding window wrapped
    assert 0 < stats.accepted < stats.drafted, "needs partial accepts"


@pytest.mark.parametrize("n_samples", [400, pytest.param(1500, marks=pytest.mark.slow)])
def test_distribution_at_temperature_one(tmp_path, n_samples):
    from test_distribution import VOCAB as V, assert_follows_target

    model = g.build_target(V, seed=3)
    path = tmp_path / "a"
    g.write_assistant(path, V, seed=4)
    engine = Engine(model, Gemma4AssistantDrafter(load_assistant(path), model))
    assert_follows_target(engine, model, SamplingConfig(temperature=1.0), n_samples)


def test_batch_engine_leaves_it_to_the_single_sequence_engine(root):
    """It reads the single-sequence target cache: the server's batch engine says it cannot batch it."""
    from mlx_engine.core.batch_engine import BatchEngine

    drafter = Gemma4AssistantDrafter(load_assistant(assistant_dir(root)[0]), target())
    assert BatchEngine(target(), drafter).supported is not None
