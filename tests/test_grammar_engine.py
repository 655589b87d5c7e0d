"""Structured output under speculation, one sequence (core/engine.py + mlx_engine/grammar): for every drafter
kind, constrained greedy output equals plain constrained greedy decoding (mlx-lm's generate_step with
llguidance's own matcher as a logits processor, tests/grammar_util.py) token for token, every answer is
valid against its schema, the grammar drafts its forced tokens, drafts that leave the grammar are cut, and
a reasoning model's grammar starts after its end marker wherever it falls."""

from __future__ import annotations

import json

import jsonschema
import mlx.core as mx
import pytest
from mlx.utils import tree_map

import dflash_util
import gemma4_util
import grammar_util as gu
import tiny_models
from eagle3_writer import write_eagle3
from hf_writer import write_checkpoint
from mlx_engine import DraftModelDrafter, Engine, GenerationConfig, NgramDrafter, SamplingConfig
from mlx_engine.drafters.chain import ChainDrafter
from mlx_engine.drafters.dflash import DFlashDrafter, load_dflash
from mlx_engine.drafters.eagle3 import load_eagle3_drafter
from mlx_engine.drafters.gemma4_assistant import Gemma4AssistantDrafter, load_assistant
from mlx_engine.drafters.mtp import load_mtp_drafter
from mlx_engine.drafters.mtp_tree import MTPTreeDrafter
from mlx_engine.drafters.suffix import SuffixDrafter
from mlx_engine.drafters.suffix_cache import SuffixCache
from test_mtp_helpers import load_hf

N = 80
V = gu.VOCAB


def generate(engine, grammar, k, n=N, prompt=gu.PROMPT, **kw):
    cfg = GenerationConfig(max_tokens=n, num_draft=k, grammar=grammar, stop_tokens=frozenset([gu.eos()]), **kw)
    steps = list(engine.generate(prompt, cfg))
    return [t for s in steps for t in s.tokens], steps


def assert_valid(tokens, schema=gu.SCHEMA):
    assert tokens[-1] == gu.eos(), f"the answer did not finish: {gu.decode(tokens)!r}"
    jsonschema.validate(json.loads(gu.decode(tokens)), schema)


def noisy(model_family="llama", seed=1, scale=0.05):
    model = tiny_models.build(model_family, seed=seed, vocab=V)[0]
    mx.random.seed(7)
    model.update(tree_map(lambda w: w + scale * mx.random.normal(w.shape) if w.dtype == mx.float32 else w,
                          model.parameters()))
    mx.eval(model.parameters())
    return model


# -- targets with each kind of drafter, over the grammar tokenizer's vocabulary ---------------------------------

def _hf(tmp, family, seed):
    folder = write_checkpoint(tmp / family, family, seed=seed, vocab=V)
    model, config = load_hf(folder)
    return model, config, folder


def make(kind: str, tmp):
    """(target, drafter) for a drafter kind."""
    if kind in ("none", "guess", "draft-self", "draft-noisy", "ngram", "suffix"):
        model = gu.target()
        drafter = {"none": None, "guess": gu.LegalGuesser(gu.schema_grammar()), "draft-self": DraftModelDrafter(model, V), "draft-noisy": DraftModelDrafter(noisy(), V),
                   "ngram": NgramDrafter(min_ngram=1), "suffix": SuffixDrafter(SuffixCache(), min_match=1, min_prob=0.0)}
        return model, drafter[kind]
    if kind in ("mtp", "mtp-tree", "ngram+mtp", "suffix+mtp"):
        model, config, folder = _hf(tmp, "deepseek_v3", 4)  # MLA: all KV, so trees compact
        mtp = load_mtp_drafter(model, folder, config)
        if kind == "mtp-tree":
            return model, MTPTreeDrafter.of(mtp)
        if kind == "ngram+mtp":
            return model, ChainDrafter(mtp, NgramDrafter(min_ngram=1))
        if kind == "suffix+mtp":
            return model, ChainDrafter(mtp, SuffixDrafter(SuffixCache(), min_match=1, min_prob=0.0))
        return model, mtp
    if kind == "eagle3":
        model, cfg = tiny_models.build("llama", seed=1, vocab=V, num_hidden_layers=4)
        write_eagle3(tmp / "e3", cfg, seed=4, draft_vocab=200)
        return model, load_eagle3_drafter(tmp / "e3", model)
    if kind == "dflash":
        model = tiny_models.build("qwen3", seed=3, vocab=V)[0]
        dflash_util.write_dflash(tmp / "df", 48, V, seed=4, layer_ids=(0, 1), mask_token_id=V - 1)
        return model, DFlashDrafter(load_dflash(tmp / "df"), model)
    if kind == "gemma4-assistant":
        model = gemma4_util.build_target(V, seed=3)
        gemma4_util.write_assistant(tmp / "g4", V, seed=4)
        return model, Gemma4AssistantDrafter(load_assistant(tmp / "g4"), model)
    raise ValueError(kind)


KINDS = ["none", "guess", "draft-self", "draft-noisy", "ngram", "suffix", "mtp", "mtp-tree", "ngram+mtp", "suffix+mtp",
         "eagle3", "dflash", "gemma4-assistant"]


@pytest.mark.parametrize("kind", KINDS)
def test_constrained_greedy_equals_plain_constrained(kind, tmp_path):
    model, drafter = make(kind, tmp_path)
    grammar = gu.schema_grammar()
    ref = gu.reference(model, gu.PROMPT, grammar, N)
    assert_valid(ref)
    for k in (1, 3, "auto"):
        engine = Engine(model, drafter)
        out, steps = generate(engine, grammar, k)
        assert out == ref, f"k={k}: {gu.decode(out)!r} != {gu.decode(ref)!r}"
        assert engine.stats.forced > 0  # the grammar drafted its forced tokens
        if kind == "mtp-tree":
            assert engine.trees.off is None
    assert_valid(out)


@pytest.mark.parametrize("kind", ["none", "mtp", "suffix"])
def test_no_plain_step_spends_a_pass_on_a_forced_token(kind, tmp_path):
    """A plain stretch under a grammar ends on the token that opens a forced run (no step already in flight
    for the run's first token alone): every token a plain step emits, the first apart, comes where the
    grammar forces nothing, so each forced run is drafted whole by a grammar cycle."""
    model, drafter = make(kind, tmp_path)
    grammar = gu.schema_grammar()
    engine = Engine(model, drafter)
    out, steps = generate(engine, grammar, "auto")
    assert out == gu.reference(model, gu.PROMPT, grammar, N)
    matcher = grammar.matcher(False)
    opened = 0  # plain tokens after which the grammar forced a run: the case this test is about
    matcher.consume([t for t in steps[0].tokens if t != gu.eos()])
    for step in steps[1:]:
        if not step.draft:
            assert matcher.forced() == [], f"a plain step emitted a forced token at {gu.decode(matcher.tokens)!r}"
        matcher.consume([t for t in step.tokens if t != gu.eos()])
        opened += not step.draft and bool(matcher.forced())
    assert opened > 0, "no plain token opened a forced run: the test proves nothing"


def test_drafts_leaving_the_grammar_are_cut_before_the_verify_pass():
    """The target as its own unconstrained draft proposes tokens the grammar forbids: they are cut (never
    verified, never emitted), and the output is the plain constrained one."""
    model = gu.target()
    grammar = gu.schema_grammar()
    ref = gu.reference(model, gu.PROMPT, grammar, N)
    seen = []

    class Spy(DraftModelDrafter):
        def propose(self, k, sampling, key):
            d = super().propose(k, sampling, key)
            seen.append(d.tokens.tolist())
            return d

    engine = Engine(model, Spy(model, V))
    out, steps = generate(engine, grammar, 4)
    assert out == ref
    assert seen and engine.stats.cut > 0, "no draft left the grammar: the test proves nothing"
    assert engine.stats.drafted + engine.stats.cut == sum(len(d) for d in seen)


def test_a_hybrid_target_with_rejected_drafts():
    """Qwen3-Next's recurrent layers roll back by snapshot and replay; legal drafts are rejected in part;
    the grammar's masks follow the replayed rows. With the grammar drafting, its forced runs' guessed last
    tokens are the rejected ones; without, the guesser's random legal tokens."""
    model = tiny_models.build("qwen3_next", seed=1, vocab=V)[0]
    grammar = gu.schema_grammar()
    ref = gu.reference(model, gu.PROMPT, grammar, N)
    for k in (2, 4):
        for drafts in (True, False):
            engine = Engine(model, gu.LegalGuesser(grammar, seed=k))
            out, _ = generate(engine, grammar, k, grammar_drafts=drafts)
            assert out == ref, f"k={k} grammar drafts {drafts}"
            s = engine.stats
            if drafts:
                assert 0 < s.forced_accepted < s.forced
            else:
                assert s.forced == 0 and 0 < s.accepted < s.drafted


def _marker_position():
    """A token the target writes greedily, unconstrained, at position >= 3 and not before: the test's
    reasoning end marker, so the free text runs a few tokens and the marker lands inside a draft."""
    free = gu.reference(gu.target(), gu.PROMPT, gu.schema_grammar(), 12, reasoning=True)  # nothing constrained yet
    for i in range(3, len(free)):
        if free[i] not in free[:i]:
            return free[i], i
    raise AssertionError("no fresh token in the free text")


@pytest.mark.parametrize("k", [2, 4, 6])
def test_the_grammar_starts_after_the_reasoning_marker_inside_a_draft(k):
    model = gu.target()
    marker, at = _marker_position()
    grammar = gu.schema_grammar().after_reasoning([marker])

    ref = _reference_with_marker(model, grammar, marker)
    assert ref[at] == marker
    engine = Engine(model, DraftModelDrafter(model, V))  # the target drafts for itself: the marker comes in a draft
    out, steps = generate(engine, grammar, k, reasoning=True)
    assert out == ref
    answer = out[out.index(marker) + 1 :]
    assert_valid(answer)
    # the target drafts for itself, so the first cycle emits positions 1..k+1: the marker (position `at`)
    # comes inside its draft, and the same cycle emits a token after it from a masked row; or it is the bonus
    first = steps[1]
    if k >= at:
        assert marker in first.draft and first.tokens.index(marker) < len(first.tokens) - 1, steps[:3]
    else:
        assert marker not in first.draft and marker in first.tokens, steps[:3]


def _reference_with_marker(model, grammar, marker):
    import grammar_util

    original = grammar_util.think_end
    grammar_util.think_end = lambda: marker
    try:
        return gu.reference(model, gu.PROMPT, grammar, N + 12, reasoning=True)
    finally:
        grammar_util.think_end = original


def test_without_reasoning_the_marker_is_ordinary_text():
    """A grammar with a marker, used by an answer that does not open in reasoning: constrained from the first
    token (the same output as without the marker)."""
    model = gu.target()
    marker, _ = _marker_position()
    plain = generate(Engine(model, None), gu.schema_grammar(), 0)[0]
    marked = generate(Engine(model, None), gu.schema_grammar().after_reasoning([marker]), 0)[0]
    assert plain == marked
    assert_valid(marked)


def test_every_emitted_token_is_legal_at_temperature_one():
    """Sampled answers under the grammar with several drafters: every token allowed where it stands (the
    reference matcher accepts each), every finished answer valid."""
    model = gu.target()
    grammar = gu.schema_grammar()
    for drafter in (DraftModelDrafter(noisy(), V), NgramDrafter(min_ngram=1), None):
        engine = Engine(model, drafter)
        for seed in range(4):
            out, _ = generate(engine, grammar, 3, sampling=SamplingConfig(temperature=1.0), seed=seed)
            m = grammar.matcher()
            m.consume([t for t in out if t != gu.eos()])  # raises on a token the grammar forbids
            if out[-1] == gu.eos():
                assert_valid(out)


# -- a model drafter under a grammar: its first token among the legal ones, unsure positions not verified --------

@pytest.mark.parametrize("threshold", [0.0, 0.3, 1.01])
def test_unsure_draft_positions_are_not_verified(threshold, tmp_path):
    """The MTP head's drafts carry its confidence (the largest probability it drafted from): positions from the
    first below the engine's threshold are dropped before the verify pass (core/confidence.py). The output is
    plain constrained greedy at every threshold; 0 drops nothing, above 1 drops every model draft."""
    model, drafter = make("mtp", tmp_path)
    grammar = gu.schema_grammar()
    ref = gu.reference(model, gu.PROMPT, grammar, N)
    engine = Engine(model, drafter)
    engine.confident = threshold
    out, _ = generate(engine, grammar, 3)
    assert out == ref
    s = engine.stats
    if threshold == 0.0:
        assert s.unsure == 0 and s.drafted > 0
    elif threshold > 1:
        assert s.unsure > 0 and s.drafted == 0
    else:
        assert s.unsure > 0 and s.drafted > 0, "no position on either side of the threshold: the test proves nothing"


def test_the_mtp_head_drafts_its_first_token_among_the_legal_ones(tmp_path):
    """Under a grammar the head's first draft token is chosen among the tokens the grammar allows there, so
    no draft is cut at its first position (a random head's unmasked first drafts nearly all leave the grammar);
    the output is unchanged."""
    model, drafter = make("mtp", tmp_path)
    grammar = gu.schema_grammar()
    seen = []
    original = drafter.propose

    def spy(k, sampling, key, first_allowed=None):
        d = original(k, sampling, key, first_allowed=first_allowed)
        seen.append((d.tokens.tolist()[0], first_allowed))
        return d

    drafter.propose = spy
    engine = Engine(model, drafter)
    engine.confident = 0.0
    out, _ = generate(engine, grammar, 1)
    assert out == gu.reference(model, gu.PROMPT, grammar, N)
    assert seen and all(allowed is not None for _, allowed in seen)
    assert all(bool(allowed[t]) for t, allowed in seen), "a first draft token the grammar forbids"
    assert engine.stats.cut == 0 and engine.stats.drafted == len(seen)


def test_within_keeps_the_logits_when_no_allowed_token_is_scored():
    """A reduced draft vocabulary can score none of the allowed tokens (-inf everywhere after the mask): the
    head's logits are kept as they were (its draft is then cut by the grammar), never a row of -inf."""
    from mlx_engine.drafters.mtp.drafter import within

    logits = mx.array([[0.5, -mx.inf, 2.0, -mx.inf]])
    assert within(logits, mx.array([True, False, False, False, False])).tolist() == [[0.5, -mx.inf, -mx.inf, -mx.inf]]
    assert within(logits, mx.array([False, True, False, True])).tolist() == logits.tolist()


@pytest.mark.parametrize("form", ["generic-auto", "qwen3_coder-forced", "glm47-auto"])
def test_a_call_grammar_under_speculation(form):
    """tool_choice auto with a strict tool (toolcalls/grammars.py optional_calls: free text, then a call held
    to its schema) or a forced call, in the generic JSON form or an XML-like one. A noisy copy of the target
    drafts (accepted in part) against its masks: the output is plain constrained greedy, token for token."""
    from mlx_engine.toolcalls.formats import GENERIC, mlx_lm_format
    from mlx_engine.toolcalls.grammars import forced_call, optional_calls, strict_view

    tool = {"type": "function", "function": {"name": "add", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "op": {"enum": ["plus", "minus"]}},
        "required": ["a"]}}}
    name, choice = form.split("-")
    fmt = GENERIC if name == "generic" else mlx_lm_format(name)
    build = optional_calls if choice == "auto" else forced_call
    grammar = build(fmt, strict_view([tool]), gu.llg_tokenizer())
    model = gu.target()
    ref = gu.reference(model, gu.PROMPT, grammar, 40)
    engine = Engine(model, DraftModelDrafter(noisy(), V))
    out, _ = generate(engine, grammar, 3, n=40)
    assert out == ref
    if choice == "auto":  # the model's drafts verified, accepted in part
        assert 0 < engine.stats.accepted < engine.stats.drafted
    else:  # a forced call is mostly forced text: drafted by the grammar, the model's drafts cut where illegal
        assert engine.stats.forced_accepted > 0 and engine.stats.cut > 0
