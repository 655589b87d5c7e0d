"""Structured output in the batch engine (core/batch_grammar.py): four concurrent rows, each under its own
schema (or none), with each kind of drafter the batch runs (a copy per row, the batched MTP head): every
row's greedy output equals plain constrained greedy decoding of its request alone, every answer is valid,
an unconstrained row keeps drafting beside constrained ones, sampled rows never emit an illegal token."""

from __future__ import annotations

import json

import jsonschema
import pytest

import grammar_util as gu
import tiny_models
from eagle3_writer import write_eagle3
from mlx_engine import DraftModelDrafter, NgramDrafter, SamplingConfig
from mlx_engine.core.batch_engine import BatchEngine
from mlx_engine.drafters.eagle3 import load_eagle3_drafter
from mlx_engine.drafters.mtp import load_mtp_drafter
from reference import mlx_lm_greedy
from test_grammar_engine import _hf

V, N = gu.VOCAB, 80


def run_batch(model, drafter, grammars, num_draft, sampling=None, seed=0, **kw):
    engine = BatchEngine(model, drafter, num_draft=num_draft, prefix_cache_bytes=0, **kw)
    for j, (prompt, grammar) in enumerate(zip(gu.PROMPTS, grammars)):
        engine.add(j, prompt, N, sampling=sampling, seed=seed + j, stop_tokens=frozenset([gu.eos()]), grammar=grammar)
    outs, stats = {j: [] for j in range(len(grammars))}, {}
    while engine.running():
        for o in engine.step():
            outs[o.seq_id] += o.tokens
            if o.finished:
                stats[o.seq_id] = o.stats
    return outs, stats, engine


def make(kind, tmp):
    if kind in ("none", "draft-self", "guess", "ngram"):
        model = gu.target()
        return model, {"none": None, "draft-self": DraftModelDrafter(model, V), "ngram": NgramDrafter(min_ngram=1),
                       "guess": gu.LegalGuesser(gu.schema_grammar(gu.SCHEMAS[0]))}[kind]
    if kind in ("mtp-batched", "mtp-per-row"):
        model, config, folder = _hf(tmp, "deepseek_v3", 4)
        return model, load_mtp_drafter(model, folder, config)
    if kind == "eagle3":
        model, cfg = tiny_models.build("llama", seed=1, vocab=V, num_hidden_layers=4)
        write_eagle3(tmp / "e3", cfg, seed=4, draft_vocab=200)
        return model, load_eagle3_drafter(tmp / "e3", model)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["none", "draft-self", "guess", "ngram", "mtp-batched", "mtp-per-row", "eagle3"])
def test_four_rows_each_under_its_own_schema_equal_plain_constrained(kind, tmp_path):
    model, drafter = make(kind, tmp_path)
    grammars = [gu.schema_grammar(s) for s in gu.SCHEMAS]
    refs = [gu.reference(model, p, g, N) for p, g in zip(gu.PROMPTS, grammars)]
    for num_draft in (2, "auto"):
        outs, stats, engine = run_batch(model, drafter, grammars, num_draft,
                                        batched_drafting=kind != "mtp-per-row")
        if kind == "mtp-batched":
            assert engine.batched is not None
        for j, schema in enumerate(gu.SCHEMAS):
            assert outs[j] == refs[j], f"row {j}, num_draft={num_draft}"
            assert outs[j][-1] == gu.eos()
            jsonschema.validate(json.loads(gu.decode(outs[j])), schema)
        assert sum(s["forced"] for s in stats.values()) > 0


@pytest.mark.parametrize("kind", ["draft-self", "mtp-batched"])
def test_an_unconstrained_row_keeps_drafting_beside_constrained_ones(kind, tmp_path):
    model, drafter = make(kind, tmp_path)
    grammars = [gu.schema_grammar(gu.SCHEMAS[0]), None, gu.schema_grammar(gu.SCHEMAS[2]), None]
    outs, stats, _ = run_batch(model, drafter, grammars, 3)
    for j, g in enumerate(grammars):
        ref = gu.reference(model, gu.PROMPTS[j], g, N) if g is not None else mlx_lm_greedy(model, gu.PROMPTS[j], N)
        assert outs[j] == ref[: len(outs[j])] and len(outs[j]) == len(ref), f"row {j}"
    assert stats[1]["drafted"] > 0 and stats[3]["drafted"] > 0  # speculation stayed on for the free rows
    if kind == "draft-self":  # the target as its own draft: the free rows accept everything
        assert stats[1]["accepted"] == stats[1]["drafted"]


def test_sampled_rows_never_leave_their_grammar(tmp_path):
    """Temperature 1 with drafts the grammar mostly forbids (the target's unconstrained draft) and legal
    guesses: no crash, every token of every row legal, every finished answer valid."""
    model = gu.target()
    grammars = [gu.schema_grammar(s) for s in gu.SCHEMAS]
    for drafter in (DraftModelDrafter(model, V), gu.LegalGuesser(grammars[0])):
        for seed in (0, 1):
            outs, _, _ = run_batch(model, drafter, grammars, 3, sampling=SamplingConfig(temperature=1.0), seed=seed)
            for j, (g, schema) in enumerate(zip(grammars, gu.SCHEMAS)):
                g.matcher().consume([t for t in outs[j] if t != gu.eos()])  # raises on an illegal token
                if outs[j][-1] == gu.eos():
                    jsonschema.validate(json.loads(gu.decode(outs[j])), schema)


@pytest.mark.parametrize("kind", ["mtp-batched", "mtp-per-row"])
@pytest.mark.parametrize("threshold", [0.0, 1.01])
def test_unsure_positions_and_the_first_legal_token_in_the_batch(kind, threshold, tmp_path):
    """The batch's constrained rows, as core/engine.py's: the MTP head's first draft token chosen among the
    tokens the row's grammar allows, drafts verified up to the first position below the threshold (above 1:
    none); the outputs are plain constrained greedy either way."""
    model, drafter = make(kind, tmp_path)
    grammars = [gu.schema_grammar(s) for s in gu.SCHEMAS]
    refs = [gu.reference(model, p, g, N) for p, g in zip(gu.PROMPTS, grammars)]
    engine = BatchEngine(model, drafter, num_draft=2, prefix_cache_bytes=0, batched_drafting=kind == "mtp-batched")
    engine.confident = threshold
    firsts = []  # (first draft token, the tokens allowed there) of the batched head's constrained rows
    for j, (prompt, grammar) in enumerate(zip(gu.PROMPTS, grammars)):
        engine.add(j, prompt, N, stop_tokens=frozenset([gu.eos()]), grammar=grammar)
    if kind == "mtp-batched":
        original = engine.batched.propose

        def spy(k, samplings, keys, first_allowed=None):
            drafts = original(k, samplings, keys, first_allowed=first_allowed)
            if first_allowed is not None:
                firsts.extend(zip([d.tokens.tolist()[0] for d in drafts], first_allowed))
            return drafts

        engine.batched.propose = spy
    outs, stats = {j: [] for j in range(4)}, {}
    while engine.running():
        for o in engine.step():
            outs[o.seq_id] += o.tokens
            if o.finished:
                stats[o.seq_id] = o.stats
    assert [outs[j] for j in range(4)] == refs
    drafted = sum(s["drafted"] for s in stats.values())
    assert (drafted == 0) if threshold > 1 else (drafted > 0)
    if kind == "mtp-batched":
        assert firsts and all(bool(allowed[t]) for t, allowed in firsts), "a first draft token the grammar forbids"
