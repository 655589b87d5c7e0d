"""The replay path on its own: a rollback to a snapshot (a wrapped rotating window cannot drop a tail)
hands every kept token back, and the engine feeds them before anything else reads the cache.

The target is window_util's gemma3-like model with prompts longer than its window, so every verify pass is
snapshotted. Checked: `_commit` after a snapshot rollback leaves `_replay` == the kept inputs [last,
d_1..d_n] and `_cached` without them; `_feed_replay` then makes the cache continue exactly as a fresh run;
in whole generations (fixed k, and drafting cycles followed by plain tokens, which feed the replay with
their first step) every verify pass starts from a cache holding exactly the committed tokens and gives a
fresh forward's logits, and the greedy output equals mlx-lm's.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_engine import DraftModelDrafter, Engine, GenerationConfig, SamplingConfig
from mlx_engine.drafters.base import Draft, Verdict
from reference import mlx_lm_greedy
from window_util import VOCAB, WINDOW, CheckingEngine, ScriptedPolicy, build, fresh_logits

PROMPT = np.random.default_rng(0).integers(0, VOCAB, WINDOW + 3).tolist()  # the window has wrapped
DRAFTS = [5, 9, 13]


@pytest.mark.parametrize("n_accepted", [0, 1, 2, 3])
def test_commit_hands_back_the_kept_tokens_and_feed_replay_restores_the_cache(n_accepted):
    model = build()
    engine = Engine(model)
    engine._target_key = mx.random.key(0)  # what generate() sets before _start
    first = engine._start(PROMPT, GenerationConfig(max_tokens=8, num_draft=3), None)
    ckpt, _, _ = engine._verify(Draft(mx.array(DRAFTS, dtype=mx.int32), None), None, False)
    assert not ckpt.exact_trim, "the test needs the snapshot path"
    corrected = 7
    engine._commit(ckpt, Verdict(len(DRAFTS), n_accepted, DRAFTS[:n_accepted] + [corrected]), None)
    kept = [first] + DRAFTS[:n_accepted]
    if n_accepted < len(DRAFTS):  # restored to the snapshot: every kept input is handed back, in order
        assert engine._replay == kept and engine._cached == PROMPT
    else:  # a full accept keeps the pass as it is
        assert engine._replay == [] and engine._cached == PROMPT + kept
    assert engine._last == corrected
    engine._feed_replay(None)
    assert engine._replay == [] and engine._cached == PROMPT + kept
    got = np.array(model(mx.array([[corrected, 11]]), cache=engine.cache)[0])
    np.testing.assert_allclose(got, fresh_logits(model, PROMPT + kept + [corrected, 11])[-2:], rtol=1e-4, atol=2e-4)


def generate(engine, prompt, k, n=32, sampling=None, seed=0):
    cfg = GenerationConfig(max_tokens=n, num_draft=k, sampling=sampling or SamplingConfig(), seed=seed)
    return [t for s in engine.generate(prompt, cfg) for t in s.tokens]


@pytest.mark.parametrize("k, script", [(2, None), (4, None), ("auto", [3, 0]), ("auto", [5, 0, 0, 2])],
                         ids=["k2", "k4", "k3-then-plain", "k5-plain-plain-k2"])
def test_generation_with_replays_is_exact(k, script):
    engine = CheckingEngine(build(), DraftModelDrafter(build(noise=0.03), VOCAB))
    if script is not None:
        engine.policy = ScriptedPolicy(script)
    out = generate(engine, PROMPT, k)
    assert out == mlx_lm_greedy(build(), PROMPT, 32)
    assert engine.replayed > 0 and engine.checks > 3
    assert 0 < engine.stats.accepted < engine.stats.drafted, "the test needs partial accepts"


def test_sampled_generation_with_replays_keeps_exact_logits():
    for seed in range(3):
        engine = CheckingEngine(build(), DraftModelDrafter(build(noise=0.03), VOCAB))
        engine.policy = ScriptedPolicy([4, 0, 2])
        out = generate(engine, PROMPT, "auto", sampling=SamplingConfig(temperature=1.0), seed=seed)
        assert len(out) == 32 and engine.replayed > 0
