"""Every emitted position of a cycle follows the target's sampling distribution, against first principles.

The reference is tests/sampling_reference.py (numpy from the definitions of penalty, temperature, top-k,
top-p, min-p), never mlx_engine.sampling. Three levels:
- the sampler chain itself (`probabilities(process_logits(...))`) equals the definitions, row by row, with
  each row's own penalty history;
- core/verify.py `accept_sampled` on a Markov chain target p(x | previous token) and a different draft
  chain q: k = 1..4, with draft probabilities and deterministic drafts; at every position j = 1..k+1 of the
  cycle (the accepted drafts, the residual resample at the first rejection, the bonus token after a full
  accept) the emitted token given the previous one follows p (Pearson chi-square per previous token);
- the Engine with drafters whose probabilities differ from the target's (another model, a noisy copy, prompt
  lookup): every generated token given everything before it follows the reference computed from the
  target's logits, tested per (k of its cycle, position in the cycle), grouped by the previous token.

Seeds are fixed, so every test is deterministic; each position class must have p > ALPHA.
"""

import functools
import zlib

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

import tiny_models
from mlx_engine import DraftModelDrafter, Engine, GenerationConfig, NgramDrafter, SamplingConfig
from mlx_engine.core.verify import accept_sampled
from mlx_engine.sampling import probabilities, process_logits
from sampling_reference import distribution, distribution_of, grouped_p_value

F32 = np.float32
ALPHA = 1e-5  # smallest p-value a position class may have (~40 classes: a correct engine fails 1 seeding in 2500)


# ------------------------------------------------------------------------------------------ the sampler chain


def test_the_reference_is_the_definitions():
    """Hand-computed cases, so the reference itself is right."""
    e = np.exp
    np.testing.assert_allclose(distribution([3.0, 2.0, 1.0, 0.0], top_k=2), [e(1) / (e(1) + 1), 1 / (e(1) + 1), 0, 0])
    logits = np.log([0.5, 0.3, 0.2])
    np.testing.assert_allclose(distribution(logits, top_p=0.8), [0.625, 0.375, 0.0])  # 0.5 + 0.3 reaches 0.8
    np.testing.assert_allclose(distribution(logits, top_p=0.81), [0.5, 0.3, 0.2])
    np.testing.assert_allclose(distribution(logits, min_p=0.5), [0.625, 0.375, 0.0])  # 0.2 < 0.5 * 0.5
    np.testing.assert_allclose(distribution(logits, temperature=0.5), np.array([0.25, 0.09, 0.04]) / 0.38)
    # penalty 2: seen positive logit halved, seen negative doubled, unseen untouched; only the last 2 count
    got = distribution([2.0, -1.0, 1.0], history=[2, 0, 1], repetition_penalty=2.0, repetition_context=2)
    np.testing.assert_allclose(got, np.array([e(1), e(-2), e(1)]) / (2 * e(1) + e(-2)))


CHAIN_CONFIGS = [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.7, top_k=3),
    SamplingConfig(temperature=1.3, top_k=1),
    SamplingConfig(temperature=1.0, top_p=0.8),
    SamplingConfig(temperature=0.5, top_p=0.3),
    SamplingConfig(temperature=1.0, min_p=0.1),
    SamplingConfig(temperature=0.9, top_k=5, top_p=0.9, min_p=0.05),
    SamplingConfig(temperature=1.0, repetition_penalty=1.5, repetition_context=4),
    SamplingConfig(temperature=0.8, top_k=4, min_p=0.1, repetition_penalty=0.7, repetition_context=20),
]


@pytest.mark.parametrize("cfg", CHAIN_CONFIGS, ids=repr)
def test_sampler_chain_equals_the_definitions(cfg):
    """Rows of a verify pass: row i's penalty history is the context up to the i-th draft."""
    rng = np.random.default_rng(zlib.crc32(repr(cfg).encode()))
    for _ in range(15):
        V, n, C = int(rng.integers(5, 40)), int(rng.integers(1, 6)), int(rng.integers(1, 25))
        logits = (rng.standard_normal((n, V)) * 3).astype(F32)
        context = rng.integers(0, V, C + n - 1)
        got = np.array(probabilities(process_logits(mx.array(logits), mx.array(context), cfg), cfg))
        for i in range(n):
            want = distribution_of(cfg, logits[i], context[: C + i])
            kept, wanted = np.flatnonzero(got[i]), np.flatnonzero(want)
            assert np.array_equal(kept, wanted), f"row {i}: kept {kept}, want {wanted}"
            np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-6, err_msg=f"row {i}")


# ------------------------------------------------------------------------------------ accept_sampled, Markov


def markov_chains(V: int, seed: int):
    """A target chain P (rows far apart) and a draft chain Q that agrees with it about 3/4 of the time."""
    rng = np.random.default_rng(seed)
    P = rng.dirichlet(np.full(V, 0.4), size=V)
    Q = 0.5 * P + 0.5 * rng.dirichlet(np.full(V, 0.4), size=V)
    return P, Q


def run_accept(P, Q, k: int, n: int, with_q: bool, seed: int, bonus_row_shift: int = 0):
    """n cycles of accept_sampled: x0 uniform, drafts d from the Q chain from x0 (sampled with q given, its
    most likely token for a deterministic draft), target rows P[x0], P[d1]..P[dk].
    -> (previous tokens [n, k+1], emitted tokens [n, k+1], n_accepted [n]); emitted[i, :n_acc + 1] are real.
    bonus_row_shift = 1 simulates a bonus drawn from the row before (for the power check only)."""
    rng = np.random.default_rng(seed)
    V = P.shape[0]
    prev = np.zeros((n, k + 1), np.int64)
    prev[:, 0] = rng.integers(0, V, n)
    for i in range(k):
        cdf = np.cumsum(Q[prev[:, i]], axis=1)
        sampled = np.minimum((cdf < rng.uniform(size=(n, 1))).sum(axis=1), V - 1)
        prev[:, i + 1] = sampled if with_q else np.argmax(Q[prev[:, i]], axis=1)
    drafts = prev[:, 1:]
    rows = prev.copy()
    rows[:, k] = prev[:, k - bonus_row_shift]
    p = mx.array(P[rows].astype(F32))
    d = mx.array(drafts.astype(np.int32))
    keys = mx.random.split(mx.random.key(seed), n)
    if with_q:
        q = mx.array(Q[prev[:, :k]].astype(F32))
        out = mx.vmap(accept_sampled)(p, d, q, keys)
        direct = [accept_sampled(p[i], d[i], q[i], keys[i]) for i in range(5)]
    else:
        out = mx.vmap(lambda p_, d_, key: accept_sampled(p_, d_, None, key))(p, d, keys)
        direct = [accept_sampled(p[i], d[i], None, keys[i]) for i in range(5)]
    out = np.array(out)
    for i, x in enumerate(direct):  # the vectorised call is the function itself
        assert out[i].tolist() == x.tolist()
    return prev, out[:, 1:], out[:, 0]


def position_p_values(P, prev, emitted, n_acc):
    """{position j: (p-value, samples)}: emitted token j given the one before it follows P[that token]."""
    k = emitted.shape[1] - 1
    before = np.concatenate([prev[:, :1], emitted[:, :k]], axis=1)  # the token each position follows
    out = {}
    for j in range(k + 1):
        sel = n_acc >= j  # position j + 1 was reached (j drafts accepted): decided before it is drawn
        probs = P[before[sel, j]]
        out[j + 1] = (grouped_p_value(probs, emitted[sel, j], before[sel, j])[0], int(sel.sum()))
    return out


@pytest.mark.parametrize("with_q", [True, False], ids=["draft-probs", "deterministic-draft"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_accept_sampled_every_position_follows_the_target(k, with_q):
    P, Q = markov_chains(6, seed=k)
    prev, emitted, n_acc = run_accept(P, Q, k, 40000, with_q, seed=10 + k)
    assert 0 < (n_acc == 0).sum() and (n_acc == k).sum() > 150, "rejections and full accepts both occur"
    pv = position_p_values(P, prev, emitted, n_acc)
    bad = {j: v for j, v in pv.items() if v[0] <= ALPHA}
    assert not bad, f"position: (p-value, samples) below {ALPHA}: {bad}; all: {pv}"


def test_the_position_test_has_power():
    """A bonus token drawn from the row before (p[k-1] instead of p[k]) is rejected at position k+1 only."""
    P, Q = markov_chains(6, seed=4)
    pv = position_p_values(P, *run_accept(P, Q, 4, 20000, True, seed=14, bonus_row_shift=1))
    assert pv[5][0] < 1e-9 and all(p > ALPHA for j, (p, _) in pv.items() if j < 5), pv


# ------------------------------------------------------------------------------------------------ the engine

VOCAB = 6
PROMPT = [1, 4, 2, 5, 3]


@functools.cache
def small_target():
    return tiny_models.build("llama", seed=1, vocab=VOCAB, num_hidden_layers=1)[0]


@functools.cache
def small_draft(kind: str):
    if kind == "other":  # another model: q far from p
        return tiny_models.build("llama", seed=2, vocab=VOCAB, num_hidden_layers=1)[0]
    model = tiny_models.build("llama", seed=1, vocab=VOCAB, num_hidden_layers=1)[0]  # a noisy copy: q near p
    mx.random.seed(5)
    model.update(tree_map(lambda w: w + 0.03 * mx.random.normal(w.shape), model.parameters()))
    mx.eval(model.parameters())
    return model


def make_drafter(kind: str):
    return NgramDrafter(min_ngram=1) if kind == "ngram" else DraftModelDrafter(small_draft(kind), VOCAB)


def generate_many(engine, prompt, cfg: SamplingConfig, k: int, runs: int, max_tokens: int):
    """-> tokens [runs, max_tokens], and per token (k of its cycle, its position in the cycle from 1)."""
    tokens, where = [], []
    engine.totals = {"drafted": 0, "accepted": 0}
    for seed in range(runs):
        gen = GenerationConfig(max_tokens=max_tokens, num_draft=k, sampling=cfg, seed=seed)
        out, pos = [], []
        for step in engine.generate(prompt, gen):
            out += step.tokens
            pos += [(len(step.draft), j + 1) for j in range(len(step.tokens))]
        tokens.append(out)
        where.append(pos)
        engine.totals = {n: v + getattr(engine.stats, n) for n, v in engine.totals.items()}
    return np.array(tokens), np.array(where)


def reference_probs(model, prompt, tokens: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """[runs, T, V]: the target distribution of each generated token given prompt + the tokens before it (the
    presence and frequency penalties count the generated ones alone)."""
    seqs = np.concatenate([np.tile(prompt, (len(tokens), 1)), tokens[:, :-1]], axis=1)
    logits = np.array(model(mx.array(seqs)).astype(mx.float32))[:, len(prompt) - 1 :]
    out = np.zeros(logits.shape, np.float64)
    for r in range(len(tokens)):
        for i in range(tokens.shape[1]):
            out[r, i] = distribution_of(cfg, logits[r, i], list(seqs[r, : len(prompt) + i]), list(tokens[r, :i]))
    return out


def assert_every_position_follows_target(engine, model, cfg, k=4, runs=400, max_tokens=12, prompt=PROMPT,
                                         min_bonus=100):
    """The engine's tokens over `runs` seeds, per (k of the cycle, position j) class: the token given all
    before it follows the reference (grouped by the previous token); never a probability-0 token; the
    bonus position k+1 of full k-cycles has at least `min_bonus` samples. Returns the classes' p-values."""
    tokens, where = generate_many(engine, prompt, cfg, k, runs, max_tokens)
    probs = reference_probs(model, prompt, tokens, cfg)
    picked = np.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]
    assert (picked > 0).all(), f"sampled a probability-0 token at (k, j) = {where[picked == 0][:5].tolist()}"
    previous = np.concatenate([np.full((len(tokens), 1), prompt[-1]), tokens[:, :-1]], axis=1)
    flat = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731
    probs, toks, prev, where = flat(probs), flat(tokens), flat(previous), flat(where)
    classes = {}
    for kc, j in sorted(set(map(tuple, where))):
        sel = (where[:, 0] == kc) & (where[:, 1] == j)
        if sel.sum() >= 30:
            classes[(kc, j)] = (grouped_p_value(probs[sel], toks[sel], prev[sel])[0], int(sel.sum()))
    assert classes.get((k, k + 1), (0, 0))[1] >= min_bonus, f"too few bonus tokens: {classes}"
    bad = {c: v for c, v in classes.items() if v[0] <= ALPHA}
    assert not bad, f"(k, position): (p-value, samples) below {ALPHA}: {bad}; all: {classes}"
    return classes


ENGINE_CASES = {  # name: (drafter kind, sampling, k)
    "other model, temperature 0.6": ("other", SamplingConfig(temperature=0.6), 4),
    "noisy copy, top-k 3, temperature 0.7": ("noisy", SamplingConfig(temperature=0.7, top_k=3), 4),
    "noisy copy, min-p + repetition penalty":
        ("noisy", SamplingConfig(temperature=1.0, min_p=0.1, repetition_penalty=1.5), 4),
    "ngram, top-p 0.8": ("ngram", SamplingConfig(temperature=1.0, top_p=0.8), 2),
}


@pytest.mark.parametrize("name", list(ENGINE_CASES))
def test_engine_every_position_follows_target(name):
    kind, cfg, k = ENGINE_CASES[name]
    engine = Engine(small_target(), make_drafter(kind))
    classes = assert_every_position_follows_target(engine, small_target(), cfg, k=k)
    assert 0 < engine.totals["accepted"] < engine.totals["drafted"]
    assert {j for (kc, j) in classes if kc == k} == set(range(1, k + 2)), classes  # every position was tested
