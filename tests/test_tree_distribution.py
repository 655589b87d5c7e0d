"""Tree acceptance at temperature > 0 (core/tree_verify.py: the target picks at every row, the path follows
the matching child) emits every position of a cycle from the target's distribution, against numpy
definitions (tests/sampling_reference.py), never mlx_engine.sampling:
- the rule alone (`pick` + `walk`) on a Markov chain target P(x | previous token), random trees whose
  tokens come from another chain Q, several sampler configurations: at each position j of the cycle the
  emitted token given the one before it follows the reference (Pearson chi-square per previous token);
  a rule that draws the last token from the wrong row is rejected (power);
- the Engine with random trees on a tiny model: every generated token given everything before it follows
  the reference computed from the target's logits, per position in its cycle.
"""

from __future__ import annotations

import functools
import random

import mlx.core as mx
import numpy as np
import pytest

import tiny_models
from mlx_engine import Engine, GenerationConfig, SamplingConfig
from mlx_engine.core.tree_verify import pick
from mlx_engine.drafters.tree_draft import walk
from sampling_reference import distribution_of, grouped_p_value
from test_distribution_positions import ALPHA, reference_probs
from tree_util import RandomTreeDrafter

V = 6


def markov(seed: int):
    rng = np.random.default_rng(seed)
    P = rng.dirichlet(np.full(V, 0.4), size=V)
    Q = 0.5 * P + 0.5 * rng.dirichlet(np.full(V, 0.4), size=V)
    return P, Q


def random_cycles(P, Q, n: int, seed: int, max_nodes: int = 6):
    """n cycles: the token before the root, and a random tree (shape uniform, node tokens from Q given the
    parent's token). -> list of (x0, parents, tokens)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        x0 = rng.randrange(V)
        k = rng.randrange(1, max_nodes + 1)
        parents, tokens = [], []
        for i in range(k):
            p = rng.randrange(-1, i)
            prev = x0 if p < 0 else tokens[p]
            parents.append(p)
            tokens.append(int(np.searchsorted(np.cumsum(Q[prev]), rng.random() * 0.999999)))
        out.append((x0, parents, tokens))
    return out


def run_rule(P, cycles, cfg: SamplingConfig, seed: int, wrong_row: bool = False):
    """Every row of every cycle picked by `pick` in one call (one uniform per row, as in a pass), then
    `walk`. -> (previous token, emitted token, position in the cycle) per emitted token."""
    rows = []
    for x0, parents, tokens in cycles:
        rows += [x0] + tokens  # a row's distribution depends on its own token only (a Markov target)
    logits = mx.array(np.log(P[rows]).astype(np.float32))
    picks = np.array(pick(logits, cfg, mx.random.key(seed))).tolist()
    out, at = [], 0
    for x0, parents, tokens in cycles:
        choices = picks[at : at + len(tokens) + 1]
        at += len(tokens) + 1
        path = walk(parents, tokens, choices)
        last = path[-1] if path else 0
        if wrong_row and path:  # the power check: the last token from the parent's row instead
            last = parents[last - 1] + 1
        emitted = [tokens[r - 1] for r in path] + [choices[last]]
        prev = [x0] + emitted[:-1]
        out += [(p, e, j + 1) for j, (p, e) in enumerate(zip(prev, emitted))]
    return np.array(out)


def position_p_values(P, cfg, samples) -> dict:
    ref = np.stack([distribution_of(cfg, np.log(P[x]), []) for x in range(V)])
    out = {}
    for j in sorted(set(samples[:, 2])):
        sel = samples[:, 2] == j
        if sel.sum() >= 50:
            prev, tok = samples[sel, 0], samples[sel, 1]
            assert (ref[prev, tok] > 0).all(), f"position {j}: a token of probability 0"
            out[int(j)] = (grouped_p_value(ref[prev], tok, prev)[0], int(sel.sum()))
    return out


CONFIGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=3),
           SamplingConfig(temperature=1.0, top_p=0.8), SamplingConfig(temperature=1.2, min_p=0.1)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=repr)
def test_the_tree_rule_emits_every_position_from_the_target(cfg):
    P, Q = markov(1)
    samples = run_rule(P, random_cycles(P, Q, 20000, seed=2), cfg, seed=3)
    pv = position_p_values(P, cfg, samples)
    assert {1, 2, 3, 4} <= set(pv), pv  # deep positions are reached (accepted paths of 3+ nodes)
    bad = {j: v for j, v in pv.items() if v[0] <= ALPHA}
    assert not bad, f"position: (p-value, samples) below {ALPHA}: {bad}; all: {pv}"


def test_the_position_test_has_power():
    cfg = SamplingConfig(temperature=1.0)
    P, Q = markov(1)
    pv = position_p_values(P, cfg, run_rule(P, random_cycles(P, Q, 20000, seed=2), cfg, seed=3, wrong_row=True))
    assert pv[2][0] < 1e-9, pv


@functools.cache
def small_target():
    return tiny_models.build("llama", seed=1, vocab=V, num_hidden_layers=1)[0]


PROMPT = [1, 4, 2, 5, 3]


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_p=0.9)],
                         ids=repr)
def test_engine_tree_cycles_follow_the_target_at_every_position(cfg):
    model = small_target()
    engine = Engine(model, RandomTreeDrafter(model, V, seed=5, follow=0.6))
    tokens, where = [], []
    for seed in range(300):
        gen = GenerationConfig(max_tokens=12, num_draft=5, sampling=cfg, seed=seed)
        out, pos = [], []
        for step in engine.generate(PROMPT, gen):
            out += step.tokens
            pos += [j + 1 for j in range(len(step.tokens))]
        tokens.append(out)
        where.append(pos)
    tokens, where = np.array(tokens), np.array(where).reshape(-1)
    probs = reference_probs(model, PROMPT, tokens, cfg)
    picked = np.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]
    assert (picked > 0).all()
    previous = np.concatenate([np.full((len(tokens), 1), PROMPT[-1]), tokens[:, :-1]], axis=1).reshape(-1)
    probs, toks = probs.reshape(-1, V), tokens.reshape(-1)
    classes = {}
    for j in sorted(set(where)):
        sel = where == j
        if sel.sum() >= 30:
            classes[int(j)] = (grouped_p_value(probs[sel], toks[sel], previous[sel])[0], int(sel.sum()))
    assert {1, 2, 3} <= set(classes), classes
    bad = {c: v for c, v in classes.items() if v[0] <= ALPHA}
    assert not bad, f"position: (p-value, samples) below {ALPHA}: {bad}; all: {classes}"
    assert engine.trees.off is None and 0 < engine.stats.accepted < engine.stats.drafted
