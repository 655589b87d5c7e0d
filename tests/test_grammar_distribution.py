"""At temperature > 0 under a grammar, every emitted position of a cycle follows the target's distribution
restricted to the grammar: p masked (disallowed tokens at probability 0), then the sampler chain. The
reference is built from the definitions (tests/sampling_reference.py) over masks from llguidance's own
matcher walked over each run's tokens, never from the engine's grammar code. Drafters: a noisy copy with
probabilities (its drafts often illegal: cut, the residual against the cut token's q), a legal-token
guesser (deterministic drafts), and the grammar's forced drafts (here: 'c' after 'a' or 'b')."""

from __future__ import annotations

import functools

import llguidance
import llguidance.numpy as llg_numpy
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import grammar_util as gu
import tiny_models
from mlx_engine import DraftModelDrafter, Engine, SamplingConfig
from mlx_engine.grammar import grammar_tokenizer, regex
from sampling_reference import distribution_of, grouped_p_value
from test_distribution_positions import ALPHA

V = 6  # "<eos>", then a..e
PROMPT = [1, 3, 4, 2, 3, 5]
# [ab] then a forced c, then [de]; never complete (z is no token), so never the end token: forbids part of
# the vocabulary at every position, and forces one token in three
PATTERN = "([ab]c[de])*z"


@functools.cache
def tokenizer():
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(["<eos>", "a", "b", "c", "d", "e"])}, merges=[]))
    tok.add_special_tokens(["<eos>"])
    tok.decoder = decoders.ByteLevel()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tok


def grammar():
    return regex(PATTERN, grammar_tokenizer(tokenizer(), V, [0]))


@functools.cache
def target():
    return tiny_models.build("llama", seed=1, vocab=V, num_hidden_layers=1)[0]


@functools.cache
def noisy_copy():
    model = tiny_models.build("llama", seed=1, vocab=V, num_hidden_layers=1)[0]
    mx.random.seed(5)
    model.update(tree_map(lambda w: w + 0.3 * mx.random.normal(w.shape), model.parameters()))
    mx.eval(model.parameters())
    return model


class MixedDrafter:
    """Samples its drafts from q = 3/4 (the noisy copy restricted to the grammar) + 1/4 (the noisy copy): most
    drafts legal, so cycles accept several tokens, some not, so drafts are cut at an illegal token whose q
    the residual must be taken against. Host-side, from the full context each step (a test drafter)."""

    name = "mixed"
    needs_hidden = False

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)

    def begin(self, tokens, hidden=None):
        self.tokens, self.start = list(tokens), len(tokens) - 1  # the answer starts with the first sampled token

    def propose(self, k, sampling, key):
        from mlx_engine.drafters.base import Draft
        from mlx_engine.grammar import GrammarViolation

        m = grammar().matcher()
        m.consume(self.tokens[self.start :])
        out, qs, legal = [], [], True
        for _ in range(k):
            logits = np.array(noisy_copy()(mx.array([self.tokens + out]))[0, -1].astype(mx.float32), np.float64)
            p = np.exp(logits - logits.max())
            p /= p.sum()
            q = p
            if legal:
                allowed = np.unpackbits(m.mask()[0].view(np.uint8), bitorder="little")[:V].astype(bool)
                restricted = np.where(allowed, p, 0.0)
                q = 0.75 * restricted / restricted.sum() + 0.25 * p
            t = int(self.rng.choice(V, p=q / q.sum()))
            out.append(t)
            qs.append(q.astype(np.float32))
            if legal:
                try:
                    m.consume([t])
                except GrammarViolation:
                    legal = False
        return Draft(mx.array(out, dtype=mx.int32), mx.array(np.stack(qs)) if qs else None, host_tokens=out)

    def commit(self, verdict, hidden=None):
        self.tokens += verdict.tokens

    def max_draft(self):
        return None


class UnsureMixedDrafter(MixedDrafter):
    """MixedDrafter's drafts with their confidence (the largest probability of each q): the engine verifies
    them only up to the first position below its threshold (core/confidence.py), a decision made on q alone,
    so every emitted token must still follow the masked target."""

    name = "mixed-unsure"

    def propose(self, k, sampling, key):
        d = super().propose(k, sampling, key)
        from mlx_engine.drafters.base import Draft

        confidence = mx.max(d.probs, axis=-1) if d.probs is not None else None
        return Draft(d.tokens, d.probs, d.host_tokens, confidence=confidence)


UNSURE = 0.6  # the engine's threshold in the unsure case: about half of MixedDrafter's positions fall below


def reference_probs(tokens: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """[runs, T, V]: the target's distribution of each token given the prompt and the tokens before it, the
    tokens the grammar forbids there at -inf before the sampler chain."""
    g = grammar()
    seqs = np.concatenate([np.tile(PROMPT, (len(tokens), 1)), tokens[:, :-1]], axis=1)
    logits = np.array(target()(mx.array(seqs)).astype(mx.float32))[:, len(PROMPT) - 1 :]
    out = np.zeros(logits.shape, np.float64)
    bits = llg_numpy.allocate_token_bitmask(1, V)
    for r in range(len(tokens)):
        m = llguidance.LLMatcher(g.tokenizer, g.source, log_level=0)
        for i in range(tokens.shape[1]):
            llg_numpy.fill_next_token_bitmask(m, bits, 0)
            allowed = np.unpackbits(bits[0].view(np.uint8), bitorder="little")[:V].astype(bool)
            row = np.where(allowed, logits[r, i], -np.inf)
            out[r, i] = distribution_of(cfg, row, list(seqs[r, : len(PROMPT) + i]))
            assert m.consume_token(int(tokens[r, i])), m.get_error()
    return out


def assert_positions_follow_the_masked_target(engine, cfg, k, runs=400, max_tokens=12):
    tokens, where = _generate(engine, cfg, k, runs, max_tokens)
    probs = reference_probs(tokens, cfg)
    picked = np.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]
    assert (picked > 0).all(), f"emitted a token of probability 0 at (k, j) = {where[picked == 0][:5].tolist()}"
    previous = np.concatenate([np.full((len(tokens), 1), PROMPT[-1]), tokens[:, :-1]], axis=1)
    flat = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731
    probs, toks, prev, where = flat(probs), flat(tokens), flat(previous), flat(where)
    classes = {}
    for kc, j in sorted(set(map(tuple, where))):
        sel = (where[:, 0] == kc) & (where[:, 1] == j)
        if sel.sum() >= 30:
            classes[(kc, j)] = (grouped_p_value(probs[sel], toks[sel], prev[sel])[0], int(sel.sum()))
    bad = {c: v for c, v in classes.items() if v[0] <= ALPHA}
    assert not bad, f"(k, position): (p-value, samples) below {ALPHA}: {bad}; all: {classes}"
    return classes


def _generate(engine, cfg, k, runs, max_tokens):
    from mlx_engine import GenerationConfig

    tokens, where = [], []
    engine.totals = {"drafted": 0, "accepted": 0, "forced": 0, "cut": 0, "unsure": 0}
    g = grammar()
    for seed in range(runs):
        gen = GenerationConfig(max_tokens=max_tokens, num_draft=k, sampling=cfg, seed=seed, grammar=g)
        out, pos = [], []
        for step in engine.generate(PROMPT, gen):
            out += step.tokens
            pos += [(len(step.draft), j + 1) for j in range(len(step.tokens))]
        tokens.append(out)
        where.append(pos)
        engine.totals = {n: v + getattr(engine.stats, n) for n, v in engine.totals.items()}
    return np.array(tokens), np.array(where)


CASES = {
    "mixed q, temperature 1": ("mixed", SamplingConfig(temperature=1.0), 3),
    "noisy copy with probabilities, temperature 1": ("noisy", SamplingConfig(temperature=1.0), 3),
    "noisy copy, temperature 0.7, top-k 3": ("noisy", SamplingConfig(temperature=0.7, top_k=3), 3),
    "legal guesses, temperature 1": ("guess", SamplingConfig(temperature=1.0), 2),
    "mixed q, unsure positions dropped, temperature 1": ("unsure", SamplingConfig(temperature=1.0), 3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_position_follows_the_target_restricted_to_the_grammar(name):
    kind, cfg, k = CASES[name]
    drafter = {"noisy": lambda: DraftModelDrafter(noisy_copy(), V), "mixed": MixedDrafter, "unsure": UnsureMixedDrafter,
               "guess": lambda: gu.LegalGuesser(grammar(), vocab=V)}[kind]()
    engine = Engine(target(), drafter)
    engine.confident = UNSURE if kind == "unsure" else 0.0
    classes = assert_positions_follow_the_masked_target(engine, cfg, k)
    t = engine.totals
    assert t["forced"] > 0 and 0 < t["accepted"] < t["drafted"], t  # grammar drafts, partial accepts
    if kind in ("noisy", "mixed", "unsure"):
        assert t["cut"] > 0, t  # drafts left the grammar and were cut
    if kind == "unsure":
        assert t["unsure"] > 0, t  # positions dropped for the drafter's low confidence
    if kind != "noisy":  # (the noisy copy's drafts are nearly all cut early)
        assert any(j >= 3 for (_, j) in classes), classes  # positions after accepted drafts were tested


# ---------------------------------------------------------------- the acceptance rule with a cut draft, Markov


def masked_chains(V: int, seed: int):
    """A target chain P restricted by a mask that forbids some tokens after each token (P_m), and a draft
    chain Q that knows nothing of the mask (so drafts are cut often)."""
    from test_distribution_positions import markov_chains

    P, Q = markov_chains(V, seed)
    rng = np.random.default_rng(seed + 100)
    allowed = rng.random((V, V)) < 0.6
    allowed[np.arange(V), rng.integers(0, V, V)] = True  # at least one token after each
    Pm = np.where(allowed, P, 0.0)
    return Pm / Pm.sum(axis=1, keepdims=True), Q, allowed


def run_cut_accept(Pm, Q, allowed, k: int, n: int, seed: int, with_cut_probs: bool = True):
    """n cycles of the engine's rule under a grammar: drafts sampled from Q from x0, cut before their first
    token the mask forbids, accept_sampled on the masked target rows with the cut token's q (cut_probs).
    -> (previous tokens [n, k+1], emitted [n, k+1], n_accepted [n]) as run_accept's."""
    from mlx_engine.core.verify import accept_sampled

    rng = np.random.default_rng(seed)
    V = Pm.shape[0]
    prev = np.zeros((n, k + 1), np.int64)
    prev[:, 0] = rng.integers(0, V, n)
    for i in range(k):
        cdf = np.cumsum(Q[prev[:, i]], axis=1)
        prev[:, i + 1] = np.minimum((cdf < rng.uniform(size=(n, 1))).sum(axis=1), V - 1)
    legal = allowed[prev[:, :k], prev[:, 1:]]  # draft i+1 allowed after token i
    cut = np.where(legal.all(axis=1), k, np.argmin(legal, axis=1))  # drafts kept per cycle
    emitted, n_acc = np.zeros((n, k + 1), np.int64), np.zeros(n, np.int64)
    keys = mx.random.split(mx.random.key(seed), n)
    for j in range(k + 1):
        sel = np.flatnonzero(cut == j)
        if not len(sel):
            continue
        p = mx.array(Pm[prev[sel, : j + 1]].astype(np.float32))
        d = mx.array(prev[sel, 1 : j + 1].astype(np.int32))
        q = mx.array(Q[prev[sel, :j]].astype(np.float32))
        if j < k and with_cut_probs:
            qc = mx.array(Q[prev[sel, j]][:, None].astype(np.float32))
            out = mx.vmap(lambda p_, d_, q_, c_, key: accept_sampled(p_, d_, q_, key, c_))(p, d, q, qc, keys[mx.array(sel)])
        else:
            out = mx.vmap(lambda p_, d_, q_, key: accept_sampled(p_, d_, q_, key))(p, d, q, keys[mx.array(sel)])
        out = np.array(out)
        n_acc[sel] = out[:, 0]
        emitted[sel, : j + 1] = out[:, 1:]
    return prev, emitted, n_acc, cut


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_cut_draft_s_next_token_follows_the_masked_target(k):
    """Every position of a cycle whose draft a grammar cut, the token after the kept drafts included (drawn
    from the residual against the cut token's q), follows the masked target."""
    from test_distribution_positions import position_p_values

    Pm, Q, allowed = masked_chains(6, seed=k)
    prev, emitted, n_acc, cut = run_cut_accept(Pm, Q, allowed, k, 40000, seed=20 + k)
    assert (cut < k).mean() > 0.3 and (n_acc == cut).sum() > 1000, "cuts, and cut cycles accepted whole, occur"
    pv = position_p_values(Pm, prev, emitted, n_acc)
    bad = {j: v for j, v in pv.items() if v[0] <= ALPHA}
    assert not bad, f"position: (p-value, samples) below {ALPHA}: {bad}; all: {pv}"


def test_the_cut_test_has_power():
    """The next token after a cut draft drawn from p instead of the residual against the cut token's q is
    seen (the rule the engine had before cut_probs)."""
    from test_distribution_positions import position_p_values

    Pm, Q, allowed = masked_chains(6, seed=2)
    prev, emitted, n_acc, _ = run_cut_accept(Pm, Q, allowed, 2, 40000, seed=22, with_cut_probs=False)
    pv = position_p_values(Pm, prev, emitted, n_acc)
    assert min(p for p, _ in pv.values()) < 1e-9, pv
