"""The DFlash block drafter: block logits against a numpy forward from the checkpoint's tensors (z-lab's
DFlashDraftModel), at the first cycle and at every later one inside the engine (the cached context K/V
== the reference recomputed from a fresh prefill's features of the committed prefix, so partial accepts
left nothing stale); greedy output == mlx-lm's plain decoding for every k; the target's distribution at
temperature 1; clear errors for checkpoints it cannot run."""

import functools
import json

import mlx.core as mx
import numpy as np
import pytest

import dflash_util as d
import tiny_models
from mlx_engine import Engine, GenerationConfig, SamplingConfig
from mlx_engine.drafters.dflash import DFlashDrafter, DFlashError, load_dflash
from mlx_engine.target_model.hidden import HiddenRequest
from mlx_engine.target_model.model import Target
from reference import mlx_lm_greedy

VOCAB = 64
PROMPT = [3, 17, 22, 9, 28, 7, 5, 20, 17, 22, 9]
N_TOKENS = 40
VARIANTS = {  # (layer_ids, layer_types, sliding_window, is_causal)
    "full": dict(layer_ids=(0, 1)),
    "sliding": dict(layer_ids=(-1, 0), layer_types=("sliding_attention", "full_attention"), sliding_window=5),
    "causal": dict(layer_ids=(1,), is_causal=True),
}


@functools.cache
def target():
    return tiny_models.build("qwen3", seed=2, vocab=VOCAB)[0]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("dflash")


def checkpoint(root, variant):
    path = root / variant
    if not (path / "config.json").exists():
        d.write_dflash(path, 48, VOCAB, **VARIANTS[variant])
    cfg = json.loads((path / "config.json").read_text())
    w = {k: np.array(v) for k, v in mx.load(str(path / "model.safetensors")).items()}
    return path, cfg, w


def features(model, tokens, layer_ids):
    """A fresh prefill's target layer outputs of `tokens`."""
    t = Target(model)
    _, h = t.forward(mx.array(tokens), t.make_cache(), HiddenRequest(layers=tuple(layer_ids), final=False))
    return np.array(h)


def matrices(model):
    t = Target(model)
    E = np.array(t.embed_tokens.weight)
    return E, E  # qwen3 tiny: tied output layer


class CheckingDrafter(DFlashDrafter):
    """Before every draft: the block's logits == the numpy reference over the whole committed prefix."""

    checks = 0

    def __init__(self, model, target_model, cfg, w):
        super().__init__(model, target_model)
        self.cfg, self.w = cfg, w

    def block_hidden(self):
        h = super().block_hidden()
        s = self.model.settings
        feats = features(self.target.model, self.history[:-1], s["target_layer_ids"])
        block = [self.history[-1]] + [s["mask_token_id"]] * (self.block_size - 1)
        E, head = matrices(self.target.model)
        ref = d.reference_block(self.w, self.cfg, feats, block, E, head)
        np.testing.assert_allclose(np.array(self.logits(h[1:])), ref, rtol=2e-4, atol=2e-4)
        self.checks += 1
        return h


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_block_logits_match_numpy_reference(root, variant):
    path, cfg, w = checkpoint(root, variant)
    model = target()
    drafter = DFlashDrafter(load_dflash(path), model)
    t = Target(model)
    logits, hidden = t.forward(mx.array(PROMPT), t.make_cache(), drafter.hidden_request)
    drafter.begin(PROMPT + [int(mx.argmax(logits[-1]))], hidden)
    h = drafter.block_hidden()
    feats = features(model, PROMPT, cfg["dflash_config"]["target_layer_ids"])
    E, head = matrices(model)
    block = drafter.history[-1:] + [0] * (cfg["block_size"] - 1)
    ref = d.reference_block(w, cfg, feats, block, E, head)
    np.testing.assert_allclose(np.array(drafter.logits(h[1:])), ref, rtol=2e-4, atol=2e-4)


@functools.cache
def plain():
    return mlx_lm_greedy(target(), PROMPT, N_TOKENS)


def run(drafter, k, n=N_TOKENS, sampling=None, seed=0):
    engine = Engine(target(), drafter)
    cfg = GenerationConfig(max_tokens=n, num_draft=k, seed=seed, sampling=sampling or SamplingConfig())
    return [t for s in engine.generate(PROMPT, cfg) for t in s.tokens], engine.stats


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("variant", ["full", "sliding"])
def test_greedy_equals_plain_decoding(root, variant, k):
    drafter = DFlashDrafter(load_dflash(checkpoint(root, variant)[0]), target())
    tokens, stats = run(drafter, k)
    assert tokens == plain()
    assert stats.drafted > 0


def test_auto_draft_length_is_cut_to_the_block(root):
    """num_draft 'auto' (the policy picks k) and a fixed k beyond the block: cut to block_size - 1."""
    drafter = DFlashDrafter(load_dflash(checkpoint(root, "full")[0]), target())
    assert drafter.max_draft() == 5
    engine = Engine(target(), drafter, max_draft=8)
    for k in ("auto", 8):
        cfg = GenerationConfig(max_tokens=N_TOKENS, num_draft=k)
        assert [t for s in engine.generate(PROMPT, cfg) for t in s.tokens] == plain()
        assert engine.stats.drafted > 0


@pytest.mark.parametrize("variant", ["full", "sliding"])
def test_context_after_partial_accepts_equals_fresh_prefill(root, variant):
    """Every cycle's block (T=1: partial accepts) == the reference from a fresh prefill of the prefix:
    the drafter's cached context K/V hold exactly the committed tokens' rows."""
    path, cfg, w = checkpoint(root, variant)
    drafter = CheckingDrafter(load_dflash(path), target(), cfg, w)
    tokens, stats = run(drafter, 4, sampling=SamplingConfig(temperature=1.0))
    assert drafter.checks > 5
    assert 0 < stats.accepted < stats.drafted, "needs partial accepts"
    pending = sum(r.shape[0] for r in drafter._pending)
    assert drafter.cache[0].offset + pending == len(drafter.history) - 1  # one context row per fed token


@pytest.mark.parametrize("n_samples", [400, pytest.param(1500, marks=pytest.mark.slow)])
def test_distribution_at_temperature_one(tmp_path, n_samples):
    from test_distribution import VOCAB as V, assert_follows_target

    model = tiny_models.build("qwen3", seed=3, vocab=V)[0]
    d.write_dflash(tmp_path / "a", 48, V, seed=4, layer_ids=(0, 1), mask_token_id=V - 1)
    engine = Engine(model, DFlashDrafter(load_dflash(tmp_path / "a"), model))
    assert_follows_target(engine, model, SamplingConfig(temperature=1.0), n_samples)


def test_bad_checkpoints_are_refused(tmp_path):
    with pytest.raises(DFlashError, match="no config.json"):
        load_dflash(tmp_path)
    cfg, _ = d.write_dflash(tmp_path / "v2", 48, VOCAB)
    cfg["architectures"] = ["DFlash2DraftModel"]
    (tmp_path / "v2" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match="DFlash2"):
        load_dflash(tmp_path / "v2")
    d.write_dflash(tmp_path / "deep", 48, VOCAB, layer_ids=(0, 7))
    with pytest.raises(DFlashError, match="layer 7"):
        DFlashDrafter(load_dflash(tmp_path / "deep"), target())

def test_continuous_batching_equals_each_request_alone(root):
    """The server's batch engine: each sequence drafts with its own DFlash state; outputs == plain greedy."""
    from mlx_engine.core.batch_engine import BatchEngine

    path, _, _ = checkpoint(root, "full")
    model = target()
    engine = BatchEngine(model, DFlashDrafter(load_dflash(path), model), num_draft=3)
    assert engine.supported is None
    prompts = {"a": PROMPT, "b": PROMPT[:5]}
    for sid, p in prompts.items():
        engine.add(sid, p, 24)
    out = {sid: [] for sid in prompts}
    while engine.running():
        for o in engine.step():
            out[o.seq_id] += o.tokens
    for sid, p in prompts.items():
        assert out[sid] == mlx_lm_greedy(model, p, 24)
