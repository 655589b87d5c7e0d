"""The grammar package's own pieces against llguidance used directly: a matcher's masks along a draft and
its rollback after a partial accept leave exactly the state of a fresh matcher fed the kept tokens; forced
tokens are a prefix of the forced text and stop one token short of its end; masks on the device allow
exactly the bitmask's tokens; bad grammars are refused naming what; the tree walk."""

from __future__ import annotations

import json

import llguidance
import mlx.core as mx
import numpy as np
import pytest

import grammar_util as gu
from mlx_engine.grammar import GrammarError, GrammarViolation, apply_bitmask, json_schema, lark, regex
from mlx_engine.grammar.trees import kept, legal_nodes, tree_masks

V = gu.VOCAB


def allowed(bits: np.ndarray) -> np.ndarray:
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:V].astype(bool)


def fresh_mask(grammar, tokens) -> np.ndarray:
    m = grammar.matcher()
    m.consume(tokens)
    return m.mask()[0]


def a_valid_answer(grammar, seed: int) -> list[int]:
    """A random legal token sequence to the grammar's end (a random walk over its masks)."""
    rng = np.random.default_rng(seed)
    m, out = grammar.matcher(), []
    while not m.complete and len(out) < 200:
        choices = [t for t in np.flatnonzero(allowed(m.mask()[0])) if t not in m.eos]
        out.append(int(rng.choice(choices)))
        m.consume(out[-1:])
    return out


@pytest.mark.parametrize("seed", range(6))
def test_masks_along_a_draft_and_settle_leave_the_state_of_the_kept_tokens(seed):
    g = gu.schema_grammar()
    answer = a_valid_answer(g, seed)
    rng = np.random.default_rng(seed)
    m = g.matcher()
    m.consume(answer[:1])
    at = 0  # answer[: at + 1] is committed
    while at < len(answer) - 1:
        k = int(rng.integers(1, 6))
        draft = answer[at + 1 : at + 1 + k]
        rows = m.masks(draft)
        for i in range(len(draft) + 1):  # row i: the mask after the committed tokens and draft[:i]
            np.testing.assert_array_equal(rows[i], fresh_mask(g, answer[: at + 1] + draft[:i]))
        kept_n = int(rng.integers(0, len(draft) + 1))
        following = answer[at + 1 + kept_n] if at + 1 + kept_n < len(answer) else None
        if following is None:
            break
        m.settle(len(draft), kept_n, following)
        at = at + 1 + kept_n
        assert m.tokens == answer[: at + 1]
        np.testing.assert_array_equal(m.mask()[0], fresh_mask(g, answer[: at + 1]))


@pytest.mark.parametrize("seed", range(3))
def test_the_mask_kept_for_a_state_is_the_state_s_and_forgotten_when_the_matcher_moves(seed):
    """`mask` keeps the mask of the state the matcher stands in (a cycle asks twice): `legal` walks away and
    back, so it still holds, and it is `masks`' first row; any consume or rollback forgets it."""
    g = gu.schema_grammar()
    answer = a_valid_answer(g, seed)
    m = g.matcher()
    for at in range(1, min(len(answer) - 3, 12)):
        m.consume(answer[at - 1 : at])
        kept = m.mask()
        assert (kept[0] == fresh_mask(g, answer[:at])).all()
        assert m.legal(answer[at : at + 3]) == 3 and m.mask() is kept
        assert (m.masks(answer[at : at + 2])[0] == kept[0]).all()
        m.rollback(2)
        assert (m.mask()[0] == kept[0]).all()
    m.consume(answer[at : at + 1])  # moved: the mask is the new state's
    assert (m.mask()[0] == fresh_mask(g, answer[: at + 1])).all()
    m.rollback(1)
    assert (m.mask()[0] == fresh_mask(g, answer[:at])).all()


def test_legal_cuts_at_the_first_forbidden_token_and_leaves_the_state():
    g = gu.schema_grammar()
    answer = a_valid_answer(g, 1)
    m = g.matcher()
    m.consume(answer[:5])
    before = m.mask()[0].copy()
    bad = next(t for t in range(V) if not allowed(before)[t] and t != gu.eos())
    assert m.legal(answer[5:9] + [bad] + answer[9:12]) == 4
    assert m.legal([bad]) == 0
    np.testing.assert_array_equal(m.mask()[0], before)
    assert m.tokens == answer[:5]
    with pytest.raises(GrammarViolation):
        m.consume([bad])


def test_an_end_token_is_legal_only_where_the_answer_is_complete_and_ends_the_run():
    g = gu.schema_grammar()
    answer = a_valid_answer(g, 2)
    m = g.matcher()
    assert m.legal(answer[:3] + [gu.eos(), 5]) == 3  # not complete there
    assert m.legal(answer + [gu.eos(), 5, 6]) == len(answer) + 1  # complete: the end counts, nothing after
    rows = m.masks(answer + [gu.eos()])
    assert allowed(rows[-2]).tolist() == [t == gu.eos() for t in range(V)]  # complete: only the end
    assert allowed(rows[-1]).tolist() == [t == gu.eos() for t in range(V)]  # after the end: only the end


@pytest.mark.parametrize("seed", range(4))
def test_forced_tokens_write_the_whole_forced_text_and_nothing_past_it(seed):
    """Along a valid answer: the forced tokens decode to exactly llguidance's forced bytes (never past them,
    never short of them), they start with llguidance's fast-forward tokens, and where those hold the last
    token back (it could merge with the free text after it) the forced run drafts it as a guess."""
    g = gu.schema_grammar()
    answer = a_valid_answer(g, seed)
    m = g.matcher()
    direct = llguidance.LLMatcher(g.tokenizer, g.source, log_level=0)
    guessed = 0
    for t in answer:
        forced, text, sure = m.forced(), direct.compute_ff_bytes(), direct.compute_ff_tokens()
        assert g.tokenizer.decode_bytes(forced) == text
        assert forced[: len(sure)] == sure
        guessed += len(forced) > len(sure)
        m.consume([t])
        assert direct.consume_token(t)
    assert guessed > 0, "llguidance held back no token along the answer: the test proves nothing"


def test_forced_runs_are_the_tokenizer_s_own_tokenization():
    """At the start of the schema the forced text is '{"kind": "'; the forced tokens are how the tokenizer
    itself writes it (not a greedy longest match)."""
    g = gu.schema_grammar()
    m = g.matcher()
    forced = m.forced()
    assert gu.decode(forced) == '{"kind": "'
    assert forced == gu.encode('{"kind": "')


def test_the_device_mask_allows_exactly_the_bitmask_s_tokens():
    rng = np.random.default_rng(0)
    for n, vocab in ((1, 49152), (5, 320), (3, 33)):
        words = (vocab + 31) // 32
        bits = rng.integers(-2**31, 2**31, size=(n, words), dtype=np.int64).astype(np.int32)
        logits = mx.array(rng.standard_normal((n, vocab)).astype(np.float32))
        out = np.array(apply_bitmask(logits, bits))
        want = np.unpackbits(bits.view(np.uint8), bitorder="little").reshape(n, -1)[:, :vocab].astype(bool)
        np.testing.assert_array_equal(np.isfinite(out), want)
        np.testing.assert_array_equal(out[want], np.array(logits)[want])


def test_bad_grammars_are_refused_naming_what():
    tok = gu.llg_tokenizer()
    with pytest.raises(GrammarError, match="json_schema 'person'.*strin"):
        json_schema({"type": "object", "properties": {"a": {"type": "strin"}}}, tok, "person")
    with pytest.raises(GrammarError, match="not valid JSON"):
        json_schema("{not json", tok)
    with pytest.raises(GrammarError, match="regex"):
        regex("a(b", tok)
    with pytest.raises(GrammarError, match="lark"):
        lark("start: undefined_rule", tok)
    assert json.loads(json.dumps(json_schema({"type": "object"}, tok).source))  # a good one compiles


def test_a_tree_s_legal_nodes_and_masks_against_fresh_matchers():
    g = gu.schema_grammar()
    answer = a_valid_answer(g, 3)
    m = g.matcher()
    m.consume(answer[:4])
    rng = np.random.default_rng(0)
    # a tree along the answer with wrong siblings, and a child under a wrong node
    a = answer[4:8]
    tokens = [a[0], int(rng.integers(0, V)), a[1], a[2], int(rng.integers(0, V)), a[3], 7]
    parents = [-1, -1, 0, 2, 2, 3, 1]
    ok = legal_nodes(m, parents, tokens)
    paths = []
    for p, t in zip(parents, tokens):
        paths.append((paths[p] if p >= 0 else []) + [t])
    for i, path in enumerate(paths):
        fresh = g.matcher()
        fresh.consume(answer[:4])
        assert ok[i] == (fresh.legal(path) == len(path)), i
    keep, new_parents = kept(parents, ok)
    kt = [tokens[i] for i in keep]
    rows = tree_masks(m, new_parents, kt)
    np.testing.assert_array_equal(rows[0], fresh_mask(g, answer[:4]))
    for r, i in enumerate(keep):
        np.testing.assert_array_equal(rows[r + 1], fresh_mask(g, answer[:4] + paths[i]))
    assert m.tokens == answer[:4]  # the walk leaves the matcher where it was


def test_the_reasoning_gate_rolls_back_across_the_marker():
    marker = gu.think_end()
    g = gu.schema_grammar().after_reasoning([marker])
    m = g.matcher(reasoning=True)
    assert m.reasoning and allowed(m.mask()[0]).all()
    m.consume([5, 9, marker])
    assert not m.reasoning
    np.testing.assert_array_equal(m.mask()[0], fresh_mask(g, []))
    answer = a_valid_answer(g, 4)
    m.consume(answer[:3])
    m.rollback(4)  # back across the marker: reasoning again, the grammar at its start
    assert m.reasoning and m.tokens == [5, 9]
    m.consume([marker] + answer[:2])
    np.testing.assert_array_equal(m.mask()[0], fresh_mask(g, answer[:2]))
