"""A verify pass that crosses a rotating window's boundary, then a rollback (issue 26).

The target is a gemma3-like tiny model whose sliding layer keeps WINDOW tokens in mlx-lm's
RotatingKVCache. With fewer than WINDOW tokens cached, a pass that brings the cache past WINDOW grows the
buffer beyond the window (mlx-lm keeps max_size + S - 1 entries after a multi-token update), so dropping
the rejected tail by offset leaves stale entries that a later one-token step rotates into the window. The
rollback must see the pass's own growth. Checked: after a rollback to every kept length, the logits of the
following passes (one token, several) equal those of a fresh run over the kept tokens; and the engine's
greedy output equals mlx-lm's own, every verify pass's logits equal to a fresh forward.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_engine import DraftModelDrafter, GenerationConfig, SamplingConfig
from mlx_engine.target_model import cache as cache_ops
from reference import mlx_lm_greedy
from window_util import VOCAB, WINDOW, CheckingEngine, ScriptedPolicy, build, fresh_logits

AFTER = (1, 3, 1, 1, 2, 1)  # the passes after the rollback: one-token steps and short passes


def feed(model, cache, tokens) -> np.ndarray:
    return np.array(model(mx.array(tokens)[None], cache=cache)[0])


@pytest.mark.parametrize("length", [3, 5, 7])
def test_rollback_after_a_pass_across_the_window_boundary_equals_a_fresh_run(length):
    model = build()
    rng = np.random.default_rng(length)
    prompt = rng.integers(0, VOCAB, length).tolist()
    passes = [WINDOW - length, WINDOW - length + 1, WINDOW - length + 4]  # up to the boundary, across it
    for n_new in passes:
        verify = rng.integers(0, VOCAB, n_new).tolist()
        later = rng.integers(0, VOCAB, sum(AFTER)).tolist()
        for n_keep in range(n_new + 1):
            cache = cache_ops.make_cache(model)
            feed(model, cache, prompt)
            ckpt = cache_ops.checkpoint(cache, n_new)
            feed(model, cache, verify)
            replay = cache_ops.rollback(cache, ckpt, n_keep)
            seq = prompt + verify[:n_keep]
            if replay:  # kept tokens handed back: fed again, in a pass of their own as the engine does
                feed(model, cache, seq[len(seq) - replay :])
            at = 0
            for size in AFTER:
                got = feed(model, cache, later[at : at + size])
                seq = seq + later[at : at + size]
                at += size
                np.testing.assert_allclose(
                    got, fresh_logits(model, seq)[-size:], rtol=1e-4, atol=2e-4,
                    err_msg=f"{length} cached + a {n_new}-token pass, {n_keep} kept, then {len(seq)} tokens")


def run(prompt, k, script=None, n=24, sampling=None):
    engine = CheckingEngine(build(), DraftModelDrafter(build(noise=0.03), VOCAB))
    if script is not None:
        engine.policy = ScriptedPolicy(script)
    cfg = GenerationConfig(max_tokens=n, num_draft=k if script is None else "auto",
                           sampling=sampling or SamplingConfig())
    return [t for s in engine.generate(prompt, cfg) for t in s.tokens], engine


@pytest.mark.parametrize("k, script", [(2, None), (3, None), (5, None), ("auto", [4, 0]), ("auto", [6, 0, 3])],
                         ids=["k2", "k3", "k5", "k4-then-plain", "k6-plain-k3"])
def test_engine_greedy_equals_plain_across_the_window_boundary(k, script):
    """Short prompts, so the first verify passes cross the boundary; a plain token after a drafting cycle
    is the one-token step that would rotate stale entries in."""
    drafted = accepted = 0
    for length in (3, 4, 5, 6):
        prompt = np.random.default_rng(length).integers(0, VOCAB, length).tolist()
        out, engine = run(prompt, k, script)
        assert out == mlx_lm_greedy(build(), prompt, 24), f"prompt of {length}"
        assert engine.checks > 0
        drafted, accepted = drafted + engine.stats.drafted, accepted + engine.stats.accepted
    assert 0 < accepted < drafted, "the test needs partial accepts"


def test_sampled_passes_across_the_boundary_keep_exact_logits():
    """At temperature 1 (other tokens, other rollbacks), every verify pass still sees exact logits."""
    for seed in range(3):
        prompt = np.random.default_rng(10 + seed).integers(0, VOCAB, 4).tolist()
        engine = CheckingEngine(build(), DraftModelDrafter(build(noise=0.03), VOCAB))
        engine.policy = ScriptedPolicy([3, 0, 5])
        cfg = GenerationConfig(max_tokens=24, num_draft="auto", sampling=SamplingConfig(temperature=1.0), seed=seed)
        out = [t for s in engine.generate(prompt, cfg) for t in s.tokens]
        assert len(out) == 24 and engine.checks > 3
