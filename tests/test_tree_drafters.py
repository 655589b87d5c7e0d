"""Trees from drafters: the suffix drafter's frequency-scored trees (drafters/suffix.py), MTP top-k trees
(drafters/mtp_tree.py) and the suffix+mtp chain drafting trees; greedy output == plain for each; the MTP
tree equal to a reference built from the head's own distributions; and the policy's tree mode (the size
from each rank's measured acceptance and the measured cost per size)."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

import tiny_models
from hf_writer import write_checkpoint
from mlx_engine import Engine, GenerationConfig
from mlx_engine.core.policy import AdaptivePolicy, add_ranks, tree_expected_tokens
from mlx_engine.drafters.chain import ChainDrafter
from mlx_engine.drafters.mtp import load_mtp_drafter
from mlx_engine.drafters.mtp_tree import MTPTreeDrafter
from mlx_engine.drafters.suffix import SuffixDrafter
from mlx_engine.drafters.suffix_cache import SuffixCache
from mlx_engine.drafters.tree_draft import host_ancestors, host_depths
from mlx_engine.sampling import SamplingConfig
from mlx_engine.target_model import cache as cache_ops
from mlx_engine.target_model.model import Target
from reference import mlx_lm_greedy
from test_greedy_equality import target
from test_mtp_helpers import load_hf
from test_suffix import PROMPT


# "3 17 42" goes on as 9 and as 11: the first suffix trees branch
BRANCHY = [3, 17, 42, 9, 200, 3, 17, 42, 11, 5, 77, 3, 17, 42]


def run(model, drafter, k, n=64, temp=0.0, prompt=PROMPT):
    engine = Engine(model, drafter)
    cfg = GenerationConfig(max_tokens=n, num_draft=k, sampling=SamplingConfig(temperature=temp))
    trees = []
    out = []
    for step in engine.generate(prompt, cfg):
        out += step.tokens
        if step.draft:
            trees.append(list(engine.trees.last_path))
    return out, engine, trees


class Recorder:
    """Wraps a tree drafter: keeps every tree it proposed (host trees)."""

    def __init__(self, inner):
        self.inner, self.trees = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose_tree(self, *a):
        tree = self.inner.propose_tree(*a)
        self.trees.append(tree)
        return tree


def test_suffix_trees_greedy_equals_plain():
    branched = False
    for family in ("llama", "qwen3"):
        model = target(family)
        ref = mlx_lm_greedy(model, BRANCHY, 64)
        for k in (2, 4, 8, "auto"):
            d = Recorder(SuffixDrafter(SuffixCache(), min_match=1, min_prob=0.0))
            out, engine, _ = run(model, d, k, prompt=BRANCHY)
            assert out == ref, f"{family} k={k}"
            assert engine.trees.off is None and engine.stats.accepted > 0
            branched |= any(len(set(t.parents)) < t.size for t in d.trees)  # a node with two children
    assert branched, "the suffix drafter never drafted a branching tree"  # (the tiny qwen3 repeats one token)


def test_a_suffix_tree_without_a_branch_goes_on_past_the_trie():
    cache = SuffixCache(depth=4)
    d = SuffixDrafter(cache, min_match=2, min_prob=0.0)
    d.begin([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2])
    tree = d.propose_tree(6, SamplingConfig(), mx.random.key(0))
    assert tree.host_tokens == [3, 4, 5, 6, 7, 8] and tree.parents == list(range(-1, 5))
    d.begin([1, 2, 3, 1, 2, 4, 1, 2])  # "1 2" -> 3 or 4: a branch (and "1 2 3" from the text before)
    tree = d.propose_tree(6, SamplingConfig(), mx.random.key(0))
    assert tree.host_tokens[:2] == [3, 4] and tree.parents[:2] == [-1, -1] and tree.counts[:2] == [2, 1]


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    folder = write_checkpoint(tmp_path_factory.mktemp("hf") / "qwen3_5", "qwen3_5", seed=3)
    model, config = load_hf(folder)
    return model, config, folder


def test_suffix_mtp_chain_drafts_trees_and_equals_plain(qwen35):
    model, config, folder = qwen35
    ref = mlx_lm_greedy(model, PROMPT, 64)
    for k in (2, 4, 8):
        chain = ChainDrafter(load_mtp_drafter(model, folder, config), SuffixDrafter(SuffixCache(), min_match=1))
        out, engine, _ = run(model, chain, k)
        assert out == ref, f"k={k}"
        assert chain.cycles["suffix"] > 0 and chain.cycles["mtp"] > 0, chain.cycles
        # (qwen3_5 is hybrid: its GatedDeltaNet layers cannot compact, so the suffix member drafts its best
        # chain there; trees on a KV model are in the tests above)
        assert engine.trees.off is not None


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """A family with an MTP head whose cache is all KV (MLA attention), so its trees compact."""
    folder = write_checkpoint(tmp_path_factory.mktemp("hf") / "deepseek_v3", "deepseek_v3", seed=4)
    model, config = load_hf(folder)
    return model, config, folder


def test_the_mtp_chain_s_greedy_draft_on_a_subset_is_the_scattered_logits_choice(deepseek, monkeypatch):
    """With a reduced draft vocabulary a greedy draft step reads the subset's scores alone (no full-vocabulary
    logits): the same tokens and confidences as the scattered logits with -inf off the subset, a grammar's
    first-position mask included; and the engine's output is still plain greedy decoding."""
    from mlx_engine.drafters.mtp.drafter import MTPDrafter

    model, config, folder = deepseek
    ids = np.random.default_rng(5).permutation(np.arange(0, model.args.vocab_size, 2))
    t = Target(model)
    _, hidden = t.forward(mx.array(PROMPT), t.make_cache(), True)
    allowed = mx.array(np.random.default_rng(6).random(model.args.vocab_size) < 0.3)

    def drafts(fast: bool, first_allowed):
        mtp = load_with_subset(model, folder, config, ids)
        if not fast:
            monkeypatch.setattr(MTPDrafter, "_greedy_on_subset", lambda *a: False)
        mtp.begin(PROMPT + [5], hidden)
        d = mtp.propose(3, SamplingConfig(), mx.random.key(0), first_allowed=first_allowed)
        monkeypatch.undo()
        return np.array(d.tokens).tolist(), np.array(d.confidence)

    for first_allowed in (None, allowed):
        (fast, sure), (slow, slow_sure) = drafts(True, first_allowed), drafts(False, first_allowed)
        assert fast == slow and set(fast) <= set(ids.tolist())
        assert np.allclose(sure, slow_sure, atol=1e-6)
        if first_allowed is not None:
            assert bool(np.array(allowed)[fast[0]])
    assert run(model, load_with_subset(model, folder, config, ids), 2, n=48)[0] == mlx_lm_greedy(model, PROMPT, 48)


def load_with_subset(model, folder, config, ids):
    """The MTP drafter with the head's reduced draft vocabulary set (as a head file's `vocab_subset` does)."""
    from mlx_engine.drafters.mtp.drafter import MTPDrafter

    mtp = load_mtp_drafter(model, folder, config)
    mtp.head.set_vocab_subset(mx.array(ids, dtype=mx.int32))
    return MTPDrafter(mtp.head, mtp.target)


class SecondBestOracle(MTPTreeDrafter):
    """A head whose second-best guess is always the target's greedy token (the target's top two logits
    swapped): its chain is always wrong, its best sibling at depth 1 always right."""

    def _logits(self, i, h, drafted):
        ctx = mx.concatenate([mx.array(self.history, dtype=mx.int32), *drafted])
        logits = self.target.model(ctx[None])[0, -1:] + 0 * h.sum()
        a, b = mx.argsort(-logits[0])[:2].tolist()
        swapped = np.array(logits)
        swapped[0, [a, b]] = swapped[0, [b, a]]
        return mx.array(swapped)


def test_mtp_tree_greedy_equals_plain(deepseek):
    model, config, folder = deepseek
    ref = mlx_lm_greedy(model, PROMPT, 48)
    for k in (1, 2, 4, 8, "auto"):
        d = MTPTreeDrafter.of(load_mtp_drafter(model, folder, config))
        out, engine, _ = run(model, d, k, n=48)
        assert out == ref, f"k={k}"
        assert engine.trees.off is None and engine.stats.drafted > 0


def test_a_weak_head_s_second_guess_counts(deepseek):
    """With the head's second-best token always right, every tree cycle keeps exactly that sibling (a chain
    of the head's best guesses would keep nothing), and the output is still the plain greedy output."""
    model, config, folder = deepseek
    ref = mlx_lm_greedy(model, PROMPT, 48)
    base = load_mtp_drafter(model, folder, config)
    for k in (2, 4, 8):
        d = SecondBestOracle(base.head, base.target)
        out, engine, paths = run(model, d, k, n=48)
        assert out == ref, f"k={k}"
        assert paths and all(p == [1] for p in paths), paths  # node 1: the second best at depth 1
        assert engine.stats.accepted == len(paths)


def reference_tree(d: MTPTreeDrafter, budget: int):
    """The tree from the head's distributions, by numpy: the chain's distributions computed step by step (the
    head's cache restored after), every candidate (d, r) scored, the n best."""
    d.flush()
    offsets = [c.offset for c in d.cache]
    K, D = min(d.width, budget), min(d.depth, budget)
    h, dists = d._out, []
    for s in range(D):
        lp = np.array(d._logits(s % d.num_layers, h, []).astype(mx.float32))[0].astype(np.float64)
        lp = lp - np.log(np.exp(lp - lp.max()).sum()) - lp.max()
        dists.append(lp)
        if s + 1 < D:
            h = d._run((s + 1) % d.num_layers, mx.array([int(np.argmax(lp))], dtype=mx.int32), h)
    for c, o in zip(d.cache, offsets):
        c.trim(c.offset - o)
    cands, before = [], 0.0
    for s, lp in enumerate(dists):
        order = np.argsort(-lp, kind="stable")[:K]
        cands += [(before + lp[t], s, r, int(t)) for r, t in enumerate(order)]
        before += lp[order[0]]
    cands.sort(key=lambda c: (-c[0], c[1], c[2]))
    return [(s, r, t) for _, s, r, t in cands[: min(budget, D * K)]]


@pytest.mark.parametrize("subset", [False, True], ids=["full-vocabulary", "vocab-subset"])
def test_the_mtp_tree_is_the_best_candidates_of_the_head_s_distributions(deepseek, subset):
    """With a reduced draft vocabulary the tree ranks the subset's scores alone: the same candidates as the
    full logits with -inf off the subset (what the reference reads)."""
    model, config, folder = deepseek
    mtp = load_mtp_drafter(model, folder, config)
    if subset:  # every third token id, in shuffled order: a subset position is not its token id
        ids = np.random.default_rng(3).permutation(np.arange(1, model.args.vocab_size, 3))
        mtp.head.set_vocab_subset(mx.array(ids, dtype=mx.int32))
    d = MTPTreeDrafter.of(mtp, depth=3, width=3)
    assert (d._subset is not None) == subset
    t = Target(model)
    cache = t.make_cache()
    _, hidden = t.forward(mx.array(PROMPT), cache, True)
    d.begin(PROMPT + [5], hidden)
    for budget in (1, 3, 5, 9):
        want = reference_tree(d, budget)
        tree = d.propose_tree(budget, SamplingConfig(), mx.random.key(0))
        tokens = np.array(tree.tokens).tolist()
        parents = np.array(tree.parents).tolist()
        assert tokens == [t for _, _, t in want], budget
        # each node hangs under the chain's node one level up; the ancestor matrix and depths follow the parents
        chain_row = {s: i for i, (s, r, _) in enumerate(want) if r == 0}
        assert parents == [-1 if s == 0 else chain_row[s - 1] for s, _, _ in want]
        if tree.on_host:  # one guess per depth (budget 1): a chain whose shape the host knows
            assert budget == 1 and tree.is_chain and tree.ancestors is None
        else:
            assert np.array_equal(np.array(tree.ancestors), host_ancestors(parents))
            assert np.array(tree.depths).tolist() == host_depths(parents)
        for c, ck in zip(d.cache, d._ckpt):  # drop the chain's draft-time entries, as a commit does
            cache_ops.rollback([c], ck, 0)
        d._ckpt = None


# --------------------------------------------------------------------------------- the policy's tree mode


def test_tree_expected_tokens_sum_the_ranks_and_extrapolate_geometrically():
    assert tree_expected_tokens([0.6, 0.3], 2, 0.5) == pytest.approx(1.9)
    assert tree_expected_tokens([0.6, 0.3], 4, 0.5) == pytest.approx(1.9 + 0.15 + 0.075)
    hits, tries = [], []
    add_ranks(hits, tries, 3, [0, 2], 0.5)
    add_ranks(hits, tries, 2, [1], 0.5)
    assert hits == [0.5, 1.0, 1.0] and tries == [1.5, 1.5, 1.0]


def test_a_chain_counts_as_a_tree_whose_first_ranks_are_accepted():
    a, b = AdaptivePolicy(max_k=6, tree=True), AdaptivePolicy(max_k=6, tree=True)
    for n in (3, 1, 0, 2):
        a.observe(4, n, 1.0)
        b.observe_tree(4, list(range(n)))
        b.observe(4, n, 1.0)
    assert a.acceptance == b.acceptance and a.hits == b.hits and a.tries == b.tries


def test_a_tree_counts_the_ranks_it_kept():
    """A tree that always keeps its third node (a later branch): that rank's acceptance rises, the first's
    falls (a chain's counting would credit the first instead)."""
    p = AdaptivePolicy(max_k=6, tree=True)
    for _ in range(30):
        p.observe_tree(4, [2])
        p.observe(4, 1, 1.0)
    assert p.acceptance[2] > 0.8 and p.acceptance[0] < 0.2 and p.acceptance[1] < 0.2


def test_the_tree_policy_settles_on_the_size_that_maximises_tokens_per_second():
    """Modelled: the i-th best node is accepted with probability m_i (ranks drawn independently), a cycle of
    n nodes costs 1.2 + 0.1 n plain tokens. The policy ends at the n with the best (1 + sum m) / cost."""
    m = [0.7, 0.35, 0.2, 0.12, 0.06, 0.03, 0.02, 0.01]
    cost = lambda n: 1.0 if n == 0 else 1.2 + 0.1 * n  # noqa: E731
    best = max(range(9), key=lambda n: (1 + sum(m[:n])) / cost(n))
    rng = random.Random(0)
    p = AdaptivePolicy(max_k=8, tree=True)
    chosen = []
    for _ in range(600):
        n = p.next_k()
        if n == 0:
            run_ = p.plain_run()
            p.observe(0, 0, float(run_), tokens=run_)
            continue
        ranks = [i for i in range(n) if rng.random() < m[i]]
        p.observe_tree(n, ranks)
        p.observe(n, len(ranks), cost(n))
        chosen.append(n)
    assert abs(p.choose() - best) <= 1, (p.choose(), best, p.acceptance)
    assert sum(abs(n - best) <= 1 for n in chosen[-100:]) >= 80, chosen[-100:]
