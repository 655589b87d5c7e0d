"""Greedy speculative output equals mlx-lm's own plain greedy output, for every family, drafter and k."""

import functools

import mlx.core as mx
import pytest
from mlx.utils import tree_map

import tiny_models
from mlx_engine import DraftModelDrafter, Engine, GenerationConfig, NgramDrafter
from reference import mlx_lm_greedy

PROMPT = [3, 17, 42, 9, 128, 77, 5, 200, 17, 42, 9]
N_TOKENS = 64


@functools.cache
def target(family):
    return tiny_models.build(family, seed=1)[0]


@functools.cache
def plain(family):
    return mlx_lm_greedy(target(family), PROMPT, N_TOKENS)


@functools.cache
def noisy_copy(family, scale=0.02):
    """The target with small weight noise: agrees often but not always, so rollbacks are partial."""
    model, _ = tiny_models.build(family, seed=1)
    mx.random.seed(7)
    model.update(tree_map(lambda w: w + scale * mx.random.normal(w.shape) if w.dtype == mx.float32 else w, model.parameters()))
    mx.eval(model.parameters())
    return model


def make_drafter(kind, family):
    if kind == "self":
        return DraftModelDrafter(target(family), tiny_models.VOCAB)
    if kind == "random":
        return DraftModelDrafter(tiny_models.build("llama", seed=99)[0], tiny_models.VOCAB)
    if kind == "noisy":
        return DraftModelDrafter(noisy_copy(family), tiny_models.VOCAB)
    return NgramDrafter()


def run(family, drafter, k, n=N_TOKENS):
    engine = Engine(target(family), drafter)
    tokens = [t for step in engine.generate(PROMPT, GenerationConfig(max_tokens=n, num_draft=k)) for t in step.tokens]
    return tokens, engine.stats


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_plain_decoding_equals_mlx_lm(family):
    tokens, stats = run(family, None, 0)
    assert tokens == plain(family)
    assert stats.cycles == N_TOKENS - 1 and stats.drafted == 0


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["self", "random", "ngram", "noisy"])
@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_speculative_greedy_equals_plain(family, kind, k):
    tokens, stats = run(family, make_drafter(kind, family), k)
    ref = plain(family)
    assert len(tokens) == N_TOKENS
    assert tokens == ref, f"first difference at {first_difference(tokens, ref)}"
    if kind == "self":  # the target as its own draft must accept every draft at temperature 0
        assert stats.drafted > 0 and stats.accepted == stats.drafted
        assert stats.cycles < N_TOKENS - 1
    if kind == "random":
        assert stats.drafted > 0 and stats.acceptance_rate < 0.5


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_target_captures_the_hidden_states_a_drafter_asks_for(family):
    """Target.forward with a HiddenRequest returns the chosen decoder layers' outputs (then the
    final-normed state), each equal to running the layers by hand, from the same forward pass."""
    from mlx_engine.target_model.cache import make_cache
    from mlx_engine.drafters.base import HiddenRequest
    from mlx_engine.target_model.model import Target

    model = tiny_models.build(family, seed=1)[0]
    t = Target(model)
    n = len(t.layers)
    req = HiddenRequest(layers=(0, -1), final=True)
    logits, h = t.forward(mx.array(PROMPT), t.make_cache(), req)
    H = h.shape[-1] // 3
    assert h.shape == (len(PROMPT), 3 * H)
    plain, _ = t.forward(mx.array(PROMPT), t.make_cache())
    assert mx.array_equal(logits, plain).item()  # capturing changes nothing
    _, final = t.forward(mx.array(PROMPT), t.make_cache(), True)
    assert mx.array_equal(h[:, 2 * H :], final).item()
    _, every = t.forward(mx.array(PROMPT), make_cache(model), HiddenRequest(layers=tuple(range(n)), final=False))
    assert mx.array_equal(h[:, :H], every[:, :H]).item() and mx.array_equal(h[:, H : 2 * H], every[:, -H:]).item()
    if family in ("llama", "qwen3"):  # the first layer by hand (these layers take (x, mask, cache))
        x = t.embed_tokens(mx.array(PROMPT)[None])
        by_hand = t.layers[0](x, "causal", None)[0]
        assert mx.allclose(h[:, :H], by_hand, atol=1e-5).item()
    with pytest.raises(ValueError):
        t.forward(mx.array(PROMPT), t.make_cache(), HiddenRequest(layers=(n,)))
