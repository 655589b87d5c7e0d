"""Prompt lookup (drafters/ngram.py): the match rule against a brute-force reference, the alignment it
keeps while a source is copied, no draft without a match, and in the engine: lossless, never a verify
pass for an empty draft, and the policy sees only matched drafts."""

import random

import mlx.core as mx

from mlx_engine import Engine, GenerationConfig, NgramDrafter
from mlx_engine.drafters.base import Verdict
from mlx_engine.sampling import SamplingConfig
from reference import mlx_lm_greedy
from test_greedy_equality import target
from test_policy import ModelledCosts


def reference_draft(tokens: list[int], k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """The rule by brute force: the earlier position whose backward match with the end is longest
    (capped at max_ngram), the most recent on a tie, at least min_ngram; its continuation, repeating
    with the match's period past the end of the context."""
    last, best, best_len = len(tokens) - 1, None, 0
    for end in range(last - 1, -1, -1):  # most recent first
        m = 0
        while m < max_ngram and end - m >= 0 and tokens[end - m] == tokens[last - m]:
            m += 1
        if m > best_len:
            best, best_len = end, m
    if best is None or best_len < min_ngram:
        return []
    extended = list(tokens)  # token i + period follows token i, period = last - best
    for j in range(k):
        extended.append(extended[best + 1 + j])
    return extended[len(tokens) :]


def member_of(tokens: list[int], min_ngram: int, max_ngram: int, long_match: int) -> str | None:
    """Who drafts, by brute force: None without a match, "ngram:long" from `long_match` matching tokens."""
    last = len(tokens) - 1
    best = 0
    for end in range(last):
        m = 0
        while m < max_ngram and end - m >= 0 and tokens[end - m] == tokens[last - m]:
            m += 1
        best = max(best, m)
    return None if best < min_ngram else "ngram:long" if best >= long_match else "ngram"


def propose(d: NgramDrafter, k: int) -> list[int]:
    return d.propose(k, SamplingConfig(), mx.random.key(0)).host_tokens


def test_drafts_the_continuation_of_the_longest_match_the_most_recent_on_a_tie():
    #              the source's "1 2 3 4" -> 5     a recent "3 4" -> 6, a later "3 4" -> 7   context ends "2 3 4"
    tokens = [9, 1, 2, 3, 4, 5, 8, 3, 4, 6, 8, 3, 4, 7, 8, 0, 2, 3, 4]
    d = NgramDrafter(min_ngram=2)
    d.begin(tokens)
    assert propose(d, 3) == [5, 8, 3]  # "2 3 4" (3 tokens) beats the two "3 4" (2 tokens), though older
    d.begin(tokens[:-3] + [9, 3, 4])  # now "3 4" is the longest at three places: the most recent wins
    assert propose(d, 2) == [7, 8]


def test_the_rule_equals_a_brute_force_reference_as_tokens_are_committed():
    rng = random.Random(0)
    for trial in range(40):
        min_n, max_n = rng.choice([(1, 3), (2, 64), (3, 5)])
        tokens = [rng.randrange(4) for _ in range(rng.randrange(2, 30))]
        d = NgramDrafter(min_ngram=min_n, max_ngram=max_n)
        d.begin(tokens)
        for _ in range(15):
            k = rng.randrange(1, 17)
            want = reference_draft(tokens, k, min_n, max_n)
            assert propose(d, k) == want, (trial, tokens, k)
            assert d.next_member() == member_of(tokens, min_n, max_n, d.long_match), (trial, tokens)
            new = [rng.randrange(4) for _ in range(rng.randrange(1, 4))]  # committed like a verdict
            d.commit(Verdict(len(new) - 1, len(new) - 1, new))
            tokens = tokens + new


def test_copying_a_source_stays_aligned_across_cycles():
    """While the output copies a source, each full accept leaves the context aligned with the source,
    and the next draft continues it, though its last tokens ("1 2 3") also occur elsewhere, more recently
    (in the copy itself), followed by other tokens: a most-recent-3-gram rule would draft those."""
    source = [20, 21, 1, 2, 3, 22, 23, 24, 1, 2, 3, 25, 26, 27, 28, 1, 2, 3, 29, 30, 31]
    d = NgramDrafter(min_ngram=2)
    d.begin(source + [40] + source[:3])
    pos = 3
    while pos + 2 < len(source):
        context = d.tokens
        assert propose(d, 2) == source[pos : pos + 2], pos
        if pos == 18:  # the context ends "... 28 1 2 3"; the copy's own "24 1 2 3" is more recent
            assert reference_draft(context, 2, 2, 3) == [25, 26]
        d.commit(Verdict(2, 2, source[pos : pos + 3]))  # both accepted, and the target's next token
        pos += 3
    assert pos == 21


def test_a_continuation_reaching_the_end_repeats_with_the_period_of_the_match():
    d = NgramDrafter(min_ngram=2)
    d.begin([9, 4, 5, 6, 4, 5, 6, 4, 5])  # "4 5 6" repeating: the longest match ends 3 tokens back
    assert propose(d, 7) == [6, 4, 5, 6, 4, 5, 6]


def test_no_draft_without_a_match_of_min_ngram_tokens():
    d = NgramDrafter(min_ngram=2)
    d.begin([5, 6, 7, 8, 5])  # "8 5" never occurred; "5" alone did
    assert d.next_member() is None and propose(d, 4) == []
    d1 = NgramDrafter(min_ngram=1)
    d1.begin([5, 6, 7, 8, 5])
    assert d1.next_member() == "ngram" and propose(d1, 4) == [6, 7, 8, 5]


class Recording(ModelledCosts):
    """ModelledCosts that records what the engine asked and told it."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.asked, self.told = [], []

    def next_k(self):
        k = super().next_k()
        self.asked.append(k)
        return k

    def observe(self, k, n_accepted, seconds, tokens=1):
        self.told.append((k, tokens))
        super().observe(k, n_accepted, seconds, tokens)


# repeats itself, so prompt lookup finds matches
PROMPT = [3, 17, 42, 9, 200, 11, 5, 77, 3, 17, 42, 9, 128, 64, 31, 2, 3, 17, 42]


def test_in_the_engine_lossless_and_no_verify_pass_for_an_empty_draft():
    for temp in (0.0, 0.7):
        engine = Engine(target("llama"), NgramDrafter(min_ngram=1))  # (random text repeats few 2-grams)
        assert (engine.policy.max_k, engine.policy.bootstrap_k) == (16, 16)
        engine.policy = policy = Recording(**NgramDrafter.policy_settings)
        cfg = GenerationConfig(max_tokens=64, num_draft="auto", sampling=SamplingConfig(temperature=temp))
        steps = list(engine.generate(PROMPT, cfg))
        if temp == 0.0:
            assert [t for s in steps for t in s.tokens] == mlx_lm_greedy(target("llama"), PROMPT, 64)
        assert engine.stats.drafted > 0
        assert all(len(s.draft) > 0 for s in steps if s.n_accepted > 0)
        # every k = 0 the policy was told of is a plain stretch it asked for: no empty draft is verified
        # (and counted as a plain token); every drafting cycle drafted at least one token
        assert sum(k == 0 for k, _ in policy.told) == sum(k == 0 for k in policy.asked)
        assert all(k >= 1 for k, _ in policy.told if k) and policy.asked[0] == 16
