"""The DFlash drafter: block logits against a numpy forward from the checkpoint's tensors (also after many
cycles, where the drafter's cached context K/V must equal a from-scratch pass over the committed prefix),
greedy output == mlx-lm's plain decoding for every k, the target's distribution at temperature 1."""

import functools
import itertools

import mlx.core as mx
import numpy as np
import pytest

import dflash_util as du
import tiny_models
from mlx_engine import Engine, GenerationConfig, SamplingConfig
from mlx_engine.drafters.dflash import DFlashDrafter, DFlashError, load_dflash
from mlx_engine.target.hidden import HiddenRequest
from mlx_engine.target.model import Target
from reference import mlx_lm_greedy

PROMPT = [3, 17, 42, 9, 128, 77, 5, 200, 17, 42, 9]
N_TOKENS = 40
IDS = (0, 2)


@functools.cache
def target(vocab=tiny_models.VOCAB):
    return tiny_models.build("qwen3", seed=1, vocab=vocab, num_hidden_layers=4)[0]


def prompt(vocab):
    return [t % vocab for t in PROMPT]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("dflash")


def checkpoint(root, vocab=tiny_models.VOCAB, sliding=False, seed=3):
    cfg = du.config(vocab, 48, IDS, sliding=sliding)
    path = root / f"d-{vocab}-{sliding}-{seed}"
    w = du.write(path, cfg, seed)
    return path, cfg, w


def reference(model, cfg, w, committed):
    """Numpy logits of the block after `committed` (features from a fresh one-pass prefill)."""
    t = Target(model)
    prefix = committed[:-1]
    _, feats = t.forward(mx.array(prefix), t.make_cache(), HiddenRequest(layers=IDS, final=False))
    embed = np.array(t.embed_tokens.weight)
    out = np.array(t.lm_head(mx.eye(48))).T
    block = [committed[-1]] + [cfg["dflash_config"]["mask_token_id"]] * (cfg["block_size"] - 1)
    return du.reference_logits(w, cfg, embed, out, np.array(feats), block)


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding-causal"])
def test_block_logits_match_numpy_reference(root, sliding):
    path, cfg, w = checkpoint(root, sliding=sliding)
    model = target()
    t = Target(model)
    drafter = DFlashDrafter(load_dflash(path), model)
    logits, feats = t.forward(mx.array(PROMPT), t.make_cache(), drafter.hidden_request)
    committed = PROMPT + [int(mx.argmax(logits[-1]))]
    drafter.begin(committed, feats)
    got = drafter.block_logits()
    assert got.shape == (cfg["block_size"] - 1, tiny_models.VOCAB)
    np.testing.assert_allclose(np.array(got), reference(model, cfg, w, committed), rtol=1e-4, atol=1e-4)


class CheckingDrafter(DFlashDrafter):
    """Every block: logits from the incrementally cached context == numpy from scratch on the prefix."""

    def __init__(self, *a, cfg, w, **kw):
        super().__init__(*a, **kw)
        self.cfg, self.w, self.checks = cfg, w, 0

    def block_logits(self):
        got = super().block_logits()
        ref = reference(self.target.model, self.cfg, self.w, self.history)
        np.testing.assert_allclose(np.array(got), ref, rtol=1e-4, atol=1e-4)
        self.checks += 1
        return got


def run(model, drafter, k, prompt_, n=N_TOKENS, sampling=None, seed=0):
    engine = Engine(model, drafter)
    cfg = GenerationConfig(max_tokens=n, num_draft=k, seed=seed, sampling=sampling or SamplingConfig())
    return [t for s in engine.generate(prompt_, cfg) for t in s.tokens], engine.stats


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding-causal"])
def test_cached_context_after_partial_accepts(root, sliding, temperature):
    """The context K/V the drafter keeps across cycles (only committed rows appended) is exact."""
    vocab = 8
    path, cfg, w = checkpoint(root, vocab, sliding, seed=7)  # a seed whose drafts are accepted at times
    model = target(vocab)
    drafter = CheckingDrafter(load_dflash(path), model, cfg=cfg, w=w)
    _, stats = run(model, drafter, 4, prompt(vocab), n=24, sampling=SamplingConfig(temperature=temperature))
    assert drafter.checks > 3
    assert 0 < stats.accepted < stats.drafted, "needs partial accepts"


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("vocab", [tiny_models.VOCAB, 8])
def test_greedy_equals_plain_decoding(root, vocab, k):
    path, _, _ = checkpoint(root, vocab, seed=7)
    model = target(vocab)
    tokens, stats = run(model, DFlashDrafter(load_dflash(path), model), k, prompt(vocab))
    assert tokens == mlx_lm_greedy(model, prompt(vocab), N_TOKENS)
    assert stats.drafted > 0
    assert len(stats.drafted_at) <= 4  # never more than the block: k <= block_size - 1
    if vocab == 8:
        assert stats.accepted > 0


def test_k_beyond_the_block_is_cut(root):
    path, cfg, _ = checkpoint(root)
    drafter = DFlashDrafter(load_dflash(path), target())
    assert drafter.max_draft() == cfg["block_size"] - 1
    _, stats = run(target(), drafter, 8, PROMPT, n=12)
    assert len(stats.drafted_at) == cfg["block_size"] - 1


def test_bad_checkpoints_are_refused(root, tmp_path):
    import json

    path, cfg, _ = checkpoint(root)
    bad = dict(cfg, architectures=["DFlash2DraftModel"])
    (tmp_path / "config.json").write_text(json.dumps(bad))
    (tmp_path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    with pytest.raises(DFlashError, match="DFlash2"):
        load_dflash(tmp_path)
    bad = dict(cfg, dflash_config={"target_layer_ids": [0, 9], "mask_token_id": 1})
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(DFlashError, match="layer 9"):
        DFlashDrafter(load_dflash(tmp_path), target())


@pytest.mark.parametrize("n_samples", [400, pytest.param(1500, marks=pytest.mark.slow)])
def test_distribution_at_temperature_one(root, n_samples):
    from test_distribution import PROMPT as P, VOCAB as V, chi_square_p_value, exact_joint

    model = tiny_models.build("qwen3", seed=1, vocab=V, num_hidden_layers=4)[0]
    path, _, _ = checkpoint(root, V, seed=4)
    engine = Engine(model, DFlashDrafter(load_dflash(path), model))
    cfg = SamplingConfig(temperature=1.0)
    counts = np.zeros((V, V))
    accepted = 0
    for seed in range(n_samples):
        gen = GenerationConfig(max_tokens=4, num_draft=2, sampling=cfg, seed=seed)
        toks = [t for s in itertools.islice(engine.generate(P, gen), 2) for t in s.tokens]
        counts[toks[0], toks[1]] += 1
        accepted += engine.stats.accepted_at[0] if engine.stats.accepted_at else 0
    assert 0 < accepted < n_samples
    expected = exact_joint(model, cfg) * n_samples
    assert np.all(counts[expected == 0] == 0)
    assert chi_square_p_value(counts.ravel(), expected.ravel()) > 1e-3
