"""The suffix drafter (drafters/suffix.py) and its suffix trie (drafters/suffix_cache.py): the match, every
proposed continuation and its count against a brute-force count over the cached texts (random texts over a
small alphabet, evictions included), the node count equal to the number of distinct substrings, eviction
by memory, and in the engine: greedy == plain for `suffix` and `suffix+mtp`, earlier requests drafted
from."""

import json
import random

import pytest

from hf_writer import write_checkpoint
from mlx_engine import Engine, GenerationConfig
from mlx_engine.__main__ import main
from mlx_engine.drafters.base import Verdict
from mlx_engine.drafters.chain import ChainDrafter
from mlx_engine.drafters.mtp import load_mtp_drafter
from mlx_engine.drafters.registry import KINDS
from mlx_engine.drafters.suffix import SuffixDrafter
from mlx_engine.drafters.suffix_cache import SuffixCache
from mlx_engine.sampling import SamplingConfig
from reference import mlx_lm_greedy
from test_greedy_equality import target
from test_mtp_helpers import load_hf

# ------------------------------------------------------------------------------------ brute force


def corpus(cache: SuffixCache) -> list[tuple[int, list[int]]]:
    """(order, tokens) of every text the cache holds."""
    return [(t.order, list(t.tokens)) for t in cache.texts.values()]


def occurrences(texts, s: list[int]) -> list[tuple[int, int]]:
    """(text order, end index) of every occurrence of s."""
    n = len(s)
    return [(o, p + n - 1) for o, toks in texts for p in range(len(toks) - n + 1) if toks[p : p + n] == s]


def count(texts, s) -> int:
    return len(occurrences(texts, s))


def followers(texts, s) -> dict[int, int]:
    """{token c: count(s + c)} over the tokens that follow an occurrence of s."""
    out = {}
    for o, toks in texts:
        for p in range(len(toks) - len(s)):
            if toks[p : p + len(s)] == s:
                c = toks[p + len(s)]
                out[c] = out.get(c, 0) + 1
    return out


def reference_match(texts, context, lo, hi, depth):
    for m in range(min(hi, len(context), depth - 1), lo - 1, -1):
        if followers(texts, context[-m:]):
            return m
    return None


def reference_path(texts, context, m, k, depth):
    """The most frequent continuation (the more recent occurrence on a tie) while the string fits the trie,
    then the text after the deepest string's most recent occurrence (the context extended by the path)."""
    s, toks, counts = list(context[-m:]), [], []
    while len(toks) < k and len(s) < depth:
        f = followers(texts, s)
        if not f:
            break
        c = max(f, key=lambda c: (f[c], max(occurrences(texts, s + [c]))))
        s.append(c)
        toks.append(c)
        counts.append(f[c])
    if len(toks) < k and toks:
        order, end = max(occurrences(texts, s))
        src = dict(texts)[order]
        ext = list(context) + toks if src == list(context) else None
        pos = end + 1
        while len(toks) < k:
            seq = ext if ext is not None else src
            if pos >= len(seq):
                break
            toks.append(seq[pos])
            counts.append(0)
            if ext is not None:
                ext.append(seq[pos])
            pos += 1
    return toks, counts


def distinct_substrings(texts, depth) -> int:
    return len({tuple(toks[p : p + n]) for _, toks in texts for p in range(len(toks))
                for n in range(1, depth + 1) if p + n <= len(toks)})


def substring_counts(texts, depth) -> dict[tuple, int]:
    """{s: occurrences} of every substring of at most `depth` tokens."""
    out = {}
    for _, toks in texts:
        for p in range(len(toks)):
            for n in range(1, min(depth, len(toks) - p) + 1):
                out[tuple(toks[p : p + n])] = out.get(tuple(toks[p : p + n]), 0) + 1
    return out


def trie_counts(root) -> dict[tuple, int]:
    """{s: the count of s's node} over every node of the trie."""
    out, stack = {}, [((), root)]
    while stack:
        s, node = stack.pop()
        for t, c in node.children():
            out[s + (t,)] = c.count
            stack.append((s + (t,), c))
    return out


def check_against_reference(cache: SuffixCache, d: SuffixDrafter, rng, depth: int):
    found = d.match()  # (re-inserts the drafter's text if it was evicted)
    texts, context = corpus(cache), list(d.tokens)
    assert cache.nodes == distinct_substrings(texts, depth)
    assert trie_counts(cache.root) == substring_counts(texts, depth)
    m = reference_match(texts, context, d.min_match, d.max_match, depth)
    assert (found[0] if found else None) == m, (texts, context)
    if m is None:
        assert d.next_member() is None and d.lookup(4) == []
        return
    assert d.next_member() == ("suffix:long" if m >= d.long_match else "suffix")
    k = rng.randrange(1, 12)
    toks, counts = cache.best_path(found[1], k, d.tokens, m)
    assert (toks, counts) == reference_path(texts, context, m, k, depth), (texts, context, m, k)
    assert d.lookup(k) == toks
    # the tree: every node's count is its string's occurrences, scores are the path's empirical probability,
    # best first, and nothing left out scores higher than what was kept
    budget, min_prob = rng.randrange(1, 10), rng.choice([0.0, 0.2])
    tokens, parents, counts, scores = cache.tree(found[1], budget, min_prob)
    strings = []
    for t, p, c, sc in zip(tokens, parents, counts, scores):
        s = (strings[p] if p >= 0 else context[-m:]) + [t]
        strings.append(s)
        assert c == count(texts, s), s
        parent = strings[p] if p >= 0 else context[-m:]
        f = followers(texts, parent)
        assert sc == pytest.approx((scores[p] if p >= 0 else 1.0) * f[t] / sum(f.values()))
    assert all(a >= b for a, b in zip(scores, scores[1:])) and all(p < i for i, p in enumerate(parents))
    assert len(set(map(tuple, strings))) == len(strings)
    kept = min(scores) if scores else 1.0
    every = {}  # every continuation in the trie and its score, by brute force

    def expand(s, score):
        if len(s) >= depth:
            return
        f = followers(texts, s)
        for c, n in f.items():
            sc = score * n / sum(f.values())
            if sc >= min_prob:
                every[tuple(s + [c])] = sc
                expand(s + [c], sc)

    expand(context[-m:], 1.0)
    left = [sc for s, sc in every.items() if list(s) not in strings]
    assert len(strings) == min(budget, len(every))
    assert not left or max(left) <= kept + 1e-12


@pytest.mark.parametrize("seed", range(6))
def test_the_trie_equals_brute_force_counts_over_random_texts(seed):
    """Several requests over a 3-4 token alphabet share one cache: after every write (commits, new requests
    that supersede a cached prefix, evictions under a small byte budget, a live text written back after its
    eviction) the match, the best path and the tree equal the brute-force counts over the cached texts."""
    rng = random.Random(seed)
    depth = rng.choice([4, 6, 9])
    alphabet = rng.choice([3, 4])
    cache = SuffixCache(max_bytes=10**9, depth=depth)
    drafters = []
    for step in range(60):
        r = rng.random()
        if not drafters or r < 0.15:
            min_m = rng.choice([1, 2])
            d = SuffixDrafter(cache, min_match=min_m, max_match=rng.randrange(min_m, depth), long_match=min_m + 1)
            prompt = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 15))]
            if drafters and rng.random() < 0.3:  # a later request that resends an earlier one whole
                prompt = list(rng.choice(drafters).tokens) + prompt
            d.begin(prompt)
            drafters.append(d)
        elif r < 0.25:
            cache.max_bytes = cache.nbytes // 2  # squeeze: the least recently written texts go
            d = rng.choice(drafters)
            cache.append(d.text, [rng.randrange(alphabet)])
            assert cache.nbytes <= cache.max_bytes or list(cache.texts.values()) == [d.text]
            cache.max_bytes = 10**9
        else:
            d = rng.choice(drafters)
            new = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 4))]
            d.commit(Verdict(len(new) - 1, len(new) - 1, new))
        check_against_reference(cache, rng.choice(drafters), rng, depth)


def test_a_superseded_request_is_dropped_and_counts_follow():
    cache = SuffixCache(depth=5)
    a = SuffixDrafter(cache, min_match=1)
    a.begin([1, 2, 3, 4])
    b = SuffixDrafter(cache, min_match=1)
    b.begin([1, 2, 3, 4, 9, 1, 2])  # resends a's text: a's occurrences would count twice
    assert list(cache.texts.values()) == [b.text]
    assert b.lookup(3) == [3, 4, 9]
    assert cache.nodes == distinct_substrings(corpus(cache), 5)


def test_eviction_keeps_the_byte_budget_least_recently_written_first():
    cache = SuffixCache(depth=8)
    ds = []
    for i in range(5):
        d = SuffixDrafter(cache)
        d.begin([100 * i + j for j in range(30)])  # texts sharing no substring
        ds.append(d)
    per_text = cache.nbytes / 5
    ds[1].commit(Verdict(0, 0, [999]))  # written after the five begins: text 1, then text 3
    ds[3].commit(Verdict(0, 0, [998]))
    cache.max_bytes = int(2.5 * per_text)
    ds[4].commit(Verdict(0, 0, [997]))  # the write that finds the cache over budget
    assert sorted(t.order for t in cache.texts.values()) == sorted([ds[3].text.order, ds[4].text.order])
    assert cache.nbytes <= cache.max_bytes
    assert cache.nodes == distinct_substrings(corpus(cache), 8)
    # an evicted request still drafts from its own text: written back whole at its next read
    cache.max_bytes = 10**9
    assert ds[0].text.evicted and ds[0].match() is None  # (its text repeats nothing)
    assert ds[0].text.order in cache.texts and cache.nodes == distinct_substrings(corpus(cache), 8)


def test_no_draft_without_a_match():
    d = SuffixDrafter(SuffixCache(), min_match=2)
    d.begin([5, 6, 7, 8, 5])  # "8 5" never occurred before
    assert d.next_member() is None and d.lookup(4) == []
    d.commit(Verdict(0, 0, [6]))  # "5 6" occurred, followed by 7
    assert d.next_member() == "suffix" and d.lookup(3) == [7, 8, 5]


# -------------------------------------------------------------------------------------- the engine

PROMPT = [3, 17, 42, 9, 200, 11, 5, 77, 3, 17, 42, 9, 128, 64, 31, 2, 3, 17, 42]


def _run(model, drafter, k, n=64, prompt=PROMPT, temp=0.0, seed=0):
    engine = Engine(model, drafter)
    cfg = GenerationConfig(max_tokens=n, num_draft=k, sampling=SamplingConfig(temperature=temp), seed=seed)
    return [t for step in engine.generate(prompt, cfg) for t in step.tokens], engine


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_suffix_greedy_equals_plain_for_every_k(family):
    ref = mlx_lm_greedy(target(family), PROMPT, 64)
    for k in (1, 2, 4, 8, 16, "auto"):
        out, engine = _run(target(family), SuffixDrafter(SuffixCache(), min_match=1), k)
        assert out == ref, f"k={k}"
        assert engine.stats.drafted > 0 and engine.stats.accepted > 0


def test_earlier_requests_are_drafted_from():
    """A second request with the same prompt, in a new engine and drafter over the same cache, drafts the
    first request's answer: most of it accepted, in far fewer cycles."""
    model = target("llama")
    cache = SuffixCache()
    first, e1 = _run(model, SuffixDrafter(cache), 8, n=48)
    second, e2 = _run(model, SuffixDrafter(cache), 8, n=48)
    assert first == second == mlx_lm_greedy(model, PROMPT, 48)
    assert e2.stats.accepted > 1.5 * e1.stats.accepted and e2.stats.cycles < e1.stats.cycles / 2, (e1.stats, e2.stats)


def test_suffix_mtp_greedy_equals_plain(tmp_path_factory):
    folder = write_checkpoint(tmp_path_factory.mktemp("hf") / "qwen3_5", "qwen3_5", seed=3)
    model, config = load_hf(folder)
    ref = mlx_lm_greedy(model, PROMPT, 64)
    for k in (1, 2, 4, 8):
        chain = ChainDrafter(load_mtp_drafter(model, folder, config), SuffixDrafter(SuffixCache(), min_match=1))
        out, _ = _run(model, chain, k)
        assert out == ref, f"k={k}"
        assert chain.name == "suffix+mtp"
        assert chain.cycles["suffix"] > 0 and chain.cycles["mtp"] > 0, chain.cycles


def test_sampled_generation_drafts():
    """At temperature > 0 a suffix draft is a point mass (no probabilities), verified by the rejection rule
    as prompt lookup's (the distribution over every position: tests/test_tree_distribution.py)."""
    out, engine = _run(target("llama"), SuffixDrafter(SuffixCache(), min_match=1), 4, temp=0.7)
    assert len(out) == 64 and engine.stats.drafted > 0


def test_cli_suffix_kinds(tmp_path_factory, capsys):
    assert {"suffix", "suffix+mtp"} <= set(KINDS)
    folder = write_checkpoint(tmp_path_factory.mktemp("hf") / "qwen3_5", "qwen3_5", seed=3)
    args = ["generate", "--model", str(folder), "--prompt-tokens", ",".join(map(str, PROMPT)), "--max-tokens", "40",
            "--ignore-eos", "--temp", "0", "--json"]

    def run(*extra):
        assert main([*args, *extra]) == 0, capsys.readouterr().err
        return json.loads(capsys.readouterr().out)

    plain = run("--drafter", "none")
    for kind in ("suffix", "suffix+mtp", "suffix"):  # the second suffix run drafts from the first's answer
        spec = run("--drafter", kind, "--num-draft", "3")
        assert spec["tokens"] == plain["tokens"], kind
    assert spec["stats"]["accepted"] > 10  # (the process's shared suffix cache: CLI runs in one process)


def test_the_batch_engine_s_requests_share_one_suffix_cache():
    """The server's engine copies the drafter per request: every copy writes to the one cache, each row's
    output equals the request served alone, and a request that comes later drafts from an earlier one's
    answer (the same prompt again: most of its tokens accepted)."""
    from mlx_engine.core.batch_engine import BatchEngine
    from test_batch_engine import PROMPTS, alone, run

    model = target("llama")
    cache = SuffixCache()
    engine = BatchEngine(model, SuffixDrafter(cache, min_match=1), num_draft=4, max_batch=3)
    reqs = {i: (p, 24, {}) for i, p in enumerate(PROMPTS[:3])}
    reqs[3] = (PROMPTS[0], 24, {})  # joins once request 0 is done
    got, done = run(engine, reqs, joins={30: [3]})
    for i, (p, n, _) in reqs.items():
        assert got[i] == alone(model, p, n), i
    assert len(cache.texts) == 4
    assert done[3][1]["accepted"] > done[0][1]["accepted"] and done[3][1]["accepted"] >= 12, done
