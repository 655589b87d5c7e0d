"""Rejection sampling reproduces the target's sampling distribution exactly.

With a 6-token vocabulary, the empirical joint distribution of the first two generated tokens over many
seeds (the second one always comes out of a speculative cycle with k = 2 drafts from an unrelated draft
model) is compared with the exact target distribution by a chi-square test. Seeds are fixed, so the
test is deterministic.
"""

import itertools
import math

import mlx.core as mx
import numpy as np
import pytest

import tiny_models
from mlx_engine import DraftModelDrafter, Engine, GenerationConfig, SamplingConfig
from mlx_engine.sampling import probabilities, process_logits

VOCAB = 6
PROMPT = [1, 4, 2, 5, 3]
N_SAMPLES = 1500


def chi_square_p_value(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson chi-square with cells of expected count < 5 pooled; Wilson-Hilferty for the tail."""
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def exact_joint(model, cfg: SamplingConfig, prompt: list[int] = PROMPT) -> np.ndarray:
    """P(t1, t2) from the target alone, through the same sampler chain definition."""

    def dist(tokens):
        logits = model(mx.array(tokens)[None])[0, -1:]
        return np.array(probabilities(process_logits(logits, mx.array(tokens), cfg), cfg))[0]

    p1 = dist(prompt)
    return np.stack([p1[a] * dist(prompt + [a]) for a in range(VOCAB)])


def assert_follows_target(engine, model, cfg: SamplingConfig, n_samples: int = N_SAMPLES, prompt=PROMPT,
                          speculative: bool = True) -> None:
    """The first two tokens the engine generates over n_samples seeds (the second from one k = 2 cycle)
    follow the target's exact joint distribution (chi-square), and never a probability-0 token."""
    vocab = exact_joint(model, cfg, prompt).shape[0]
    counts = np.zeros((vocab, vocab))
    accepted = 0
    for seed in range(n_samples):
        gen = GenerationConfig(max_tokens=4, num_draft=2, sampling=cfg, seed=seed)
        steps = itertools.islice(engine.generate(prompt, gen), 2)  # the first token, then one k=2 cycle
        tokens = [t for step in steps for t in step.tokens]
        counts[tokens[0], tokens[1]] += 1
        accepted += engine.stats.accepted_at[0] if engine.stats.accepted_at else 0
    expected = exact_joint(model, cfg, prompt) * n_samples
    if speculative:
        assert 0 < accepted < n_samples, "drafts must be accepted sometimes and rejected sometimes"
    assert np.all(counts[expected == 0] == 0), "sampled a token the target gives probability 0"
    assert chi_square_p_value(counts.ravel(), expected.ravel()) > 1e-3


CONFIGS = {
    "temperature 1": SamplingConfig(temperature=1.0),
    "top-p 0.8": SamplingConfig(temperature=1.0, top_p=0.8),
    "top-k 3, temperature 0.7": SamplingConfig(temperature=0.7, top_k=3),
    "min-p + repetition penalty": SamplingConfig(temperature=1.0, min_p=0.1, repetition_penalty=1.5),
}


@pytest.mark.parametrize(
    "name, speculative", [(name, True) for name in CONFIGS] + [("min-p + repetition penalty", False)]
)
def test_first_two_tokens_follow_target_distribution(name, speculative):
    cfg = CONFIGS[name]
    model = tiny_models.build("llama", seed=1, vocab=VOCAB, num_hidden_layers=1)[0]
    draft = tiny_models.build("llama", seed=2, vocab=VOCAB, num_hidden_layers=1)[0]
    engine = Engine(model, DraftModelDrafter(draft, VOCAB) if speculative else None)
    assert_follows_target(engine, model, cfg, speculative=speculative)


def test_chi_square_detects_a_wrong_distribution():
    """The statistic has power at this sample size: the draft's own distribution is rejected."""
    cfg = CONFIGS["temperature 1"]
    target = exact_joint(tiny_models.build("llama", seed=1, vocab=VOCAB, num_hidden_layers=1)[0], cfg)
    other = exact_joint(tiny_models.build("llama", seed=2, vocab=VOCAB, num_hidden_layers=1)[0], cfg)
    rng = np.random.default_rng(0)
    counts = rng.multinomial(N_SAMPLES, other.ravel())
    assert chi_square_p_value(counts, target.ravel() * N_SAMPLES) < 1e-6
