"""The models agents run take the batch engine's whole path (issue 51): hybrid GatedDeltaNet targets (qwen3_next,
qwen3_5 dense and MoE), sliding-window ones (gpt-oss, Gemma 4 with its KV-shared layers) and a CacheList per
layer (LongCat-Flash: the concurrency and prefix-tree tests), each with a draft
model of its own kind (a hybrid draft beside a hybrid target). For each: 8 concurrent greedy requests with
speculation on equal each served alone (rows joining and leaving mid-batch, windows wrapping inside verify
passes: window 8, prompts of 12-40 tokens, 3 drafts a pass); sampled rows follow the target's distribution;
a prefix-tree hit equals a cold run, greedy and seeded, and feeds only the tokens after what it restored
(counted); a newcomer's first token comes within two steps beside a long prompt; cancel at every stage."""

import functools

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

import tiny_models
from mlx_engine.core.batch_engine import BatchEngine
from mlx_engine.core.engine import Engine, GenerationConfig
from mlx_engine.drafters.draft_model import DraftModelDrafter
from mlx_engine.sampling import SamplingConfig
from test_batch_engine import alone, run

FAMILIES = tiny_models.AGENT_FAMILIES
LISTS = ("longcat_flash",)  # a CacheList per layer (two MLA attentions, each its own KV cache)
HYBRID = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


@functools.cache
def target(family: str, vocab: int = tiny_models.VOCAB, **overrides):
    return tiny_models.build(family, seed=1, vocab=vocab, **overrides)[0]


@functools.cache
def draft(family: str, vocab: int = tiny_models.VOCAB, noise: float = 0.003, **overrides):
    """The target with weight noise: agrees often, not always (partial accepts, per-row rollbacks)."""
    model = tiny_models.build(family, seed=1, vocab=vocab, **overrides)[0]
    mx.random.seed(7)
    model.update(tree_map(lambda w: w + noise * mx.random.normal(w.shape) if w.dtype == mx.float32 else w,
                          model.parameters()))
    mx.eval(model.parameters())
    return model


def drafter(family: str, vocab: int = tiny_models.VOCAB, noise: float = 0.003, **overrides):
    return DraftModelDrafter(draft(family, vocab, noise, **overrides), vocab)


def prompts(n: int = 8, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, tiny_models.VOCAB, int(rng.integers(12, 40))).tolist() for _ in range(n)]


def fed_counter(engine: BatchEngine) -> dict:
    """seq id -> the prompt tokens its row was fed (every chunk the engine's passes fed it)."""
    fed = {}
    turn = engine._prompt_turn

    def counting(plan):
        turn(plan)
        for i, f in enumerate(plan.feeding):
            if f is not None and plan.fed[i] and (i not in plan.spans or plan.spans[i].start == 0):
                fed[f.seq.id] = fed.get(f.seq.id, 0) + plan.fed[i]

    alone_first = engine._first_chunk_alone

    def first_alone(p, hidden):  # (a batch without rows feeds a first chunk alone)
        n = alone_first(p, hidden)
        fed[p.seq.id] = fed.get(p.seq.id, 0) + n
        return n

    engine._prompt_turn = counting
    engine._first_chunk_alone = first_alone
    return fed


@pytest.mark.cpu_exact
@pytest.mark.parametrize("family", FAMILIES + LISTS)
def test_eight_concurrent_greedy_rows_with_speculation_equal_each_alone(family):
    model = target(family)
    reqs = {i: (p, 14 + 3 * i, {}) for i, p in enumerate(prompts())}
    engine = BatchEngine(model, drafter(family), num_draft=3, max_batch=8)
    assert engine.supported is None, engine.supported
    got, done = run(engine, reqs, joins={2: [5], 4: [6], 7: [7]})  # three join a running batch
    assert got == {i: alone(model, p, n) for i, (p, n, _) in reqs.items()}
    drafted = sum(s["drafted"] for _, s in done.values())
    accepted = sum(s["accepted"] for _, s in done.values())
    assert 0 < accepted < drafted, (accepted, drafted)  # rows accepted some drafts and rolled back others


@pytest.mark.cpu_exact
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_quantized_kv_rows_equal_each_alone(family):
    """kv_bits: the full-attention layers' entries quantized (mlx-lm quantizes no window nor recurrent state;
    gpt-oss's attention sinks none at all): four rows together equal each row alone in the batch engine."""
    heads = dict(head_dim=32)  # (a multiple of the group size)
    model = target(family, **heads)
    kv = dict(kv_bits=8, kv_group_size=32)
    reqs = {i: (p, 12, {}) for i, p in enumerate(prompts(4, seed=5))}
    together, _ = run(BatchEngine(model, drafter(family, **heads), num_draft=2, max_batch=4, **kv), reqs)
    for i, r in reqs.items():
        each, _ = run(BatchEngine(model, drafter(family, **heads), num_draft=2, max_batch=1, **kv), {i: r})
        assert together[i] == each[i]


# -------------------------------------------------------------------------------------------- sampled rows

SMALL_VOCAB = 6
SAMPLED_PROMPT = [1, 4, 2, 5, 3, 0, 2, 4, 1, 3, 5, 2]  # 12 tokens: the window (8) wraps before the first draw


@pytest.mark.parametrize("family", [f if f in ("qwen3_next", "gpt_oss") else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])
def test_sampled_rows_follow_the_target_distribution(family):
    """400 sampled requests, 8 at a time (rows joining as others leave), speculation on with a draft that is
    often rejected: every token given all before it follows the target's distribution (a conditional
    chi-square grouped by the token before it; sampling_reference.py), never a probability-0 token."""
    from sampling_reference import grouped_p_value
    from test_distribution_positions import ALPHA, reference_probs

    model = target(family, SMALL_VOCAB)
    cfg = SamplingConfig(temperature=0.8, top_k=4)
    engine = BatchEngine(model, drafter(family, SMALL_VOCAB, noise=0.05), num_draft=3, max_batch=8,
                         prefix_cache_bytes=0)
    runs, n = 400, 8
    got, done, waiting = {}, {}, list(range(runs))
    while len(done) < runs:
        while waiting and engine.free_slots() > 0:  # a new request joins as soon as a row leaves
            seed = waiting.pop(0)
            engine.add(seed, SAMPLED_PROMPT, n, sampling=cfg, seed=seed)
        for o in engine.step():
            got.setdefault(o.seq_id, []).extend(o.tokens)
            if o.finished:
                done[o.seq_id] = (o.finished, o.stats)
    tokens = np.array([got[s] for s in range(runs)])
    probs = reference_probs(model, SAMPLED_PROMPT, tokens, cfg)
    picked = np.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]
    assert (picked > 0).all(), "sampled a probability-0 token"
    previous = np.concatenate([np.full((runs, 1), SAMPLED_PROMPT[-1]), tokens[:, :-1]], axis=1)
    p, _ = grouped_p_value(probs.reshape(-1, SMALL_VOCAB), tokens.reshape(-1), previous.reshape(-1))
    assert p > ALPHA, p
    drafted = sum(s["drafted"] for _, s in done.values())
    accepted = sum(s["accepted"] for _, s in done.values())
    assert 0 < accepted < drafted, (accepted, drafted)


# --------------------------------------------------------------------------------------------- prefix tree

def tree_prompts():
    rng = np.random.default_rng(0)
    a = rng.integers(0, tiny_models.VOCAB, 90).tolist()
    b = a[:40] + rng.integers(0, tiny_models.VOCAB, 30).tolist()  # parts from a after 40 tokens
    c = a[:40] + rng.integers(0, tiny_models.VOCAB, 25).tolist()  # and from both there
    return a, b, c


@pytest.mark.cpu_exact
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("family", FAMILIES + LISTS)
def test_a_prefix_hit_equals_a_cold_run_and_feeds_only_the_rest(family, sampled):
    """An agent's turns through one engine (the tree kept between them) against each turn cold (no tree):
    equal tokens, greedy and seeded; each turn's row is fed exactly the prompt tokens after what the hit
    restored. What a hit restores: a sliding-window model the whole shared prefix; a hybrid the deepest
    checkpoint of its recurrent states: none before the turn where two prompts first part (b), then exactly
    where they part (c, a checkpoint b left at 40), the whole earlier conversation (the next turn), and a
    resent prompt one token short of its end."""
    model = target(family)
    kw = {"sampling": SamplingConfig(temperature=0.9), "seed": 5} if sampled else {}
    a, b, c = tree_prompts()
    engine = BatchEngine(model, drafter(family), num_draft=2, max_batch=4)
    fed = fed_counter(engine)

    def turn(name, prompt):
        got, done = run(engine, {name: (prompt, 10, kw)})
        cold, _ = run(BatchEngine(model, drafter(family), num_draft=2, max_batch=4, prefix_cache_bytes=0),
                      {name: (prompt, 10, kw)})
        assert got[name] == cold[name], name
        reused = done[name][1]["reused_prompt_tokens"]
        assert fed[name] == len(prompt) - reused, (name, fed[name], reused)
        return got[name], reused

    answer, reused = turn("a", a)
    assert reused == 0
    turns = {"b": b, "c": c, "next": a + answer + [3, 1, 4, 1, 5], "resent": a}
    reused = {name: turn(name, p)[1] for name, p in turns.items()}
    if family in HYBRID:
        expect = {"b": 0, "c": 40, "next": len(a) + len(answer) - 1, "resent": len(a) - 1}
    else:
        expect = {"b": 40, "c": 40, "next": len(a) + len(answer) - 1, "resent": len(a) - 1}
    assert reused == expect


# --------------------------------------------------------------------------------------- an agent's prompt

@pytest.mark.parametrize("family", FAMILIES)
def test_a_newcomer_s_first_token_comes_within_two_steps_beside_a_long_prompt(family):
    """A short request arriving while an 1,200-token prompt is fed (chunks of 16) gets its first token within
    two steps, the long one's chunks paused meanwhile; both end equal to each alone."""
    from test_agent_prefill import engine_for, step_until
    from test_batch_prefill import assert_greedy_equal

    model = target(family)
    rng = np.random.default_rng(11)
    long, short = rng.integers(1, tiny_models.VOCAB, 1200).tolist(), rng.integers(1, tiny_models.VOCAB, 8).tolist()
    engine = engine_for(model, drafter(family))
    out = {}
    engine.add("long", long, 6)
    for _ in range(4):
        engine.step()
    assert [p["stage"] for p in engine.prefilling()] == ["target"]
    engine.add("short", short, 6)
    steps = step_until(engine, lambda o: o.get("short"), out, 20)
    assert steps <= 2, f"first token after {steps} steps"
    step_until(engine, lambda _: not engine.running(), out, 3000)
    assert_greedy_equal(model, long, out["long"], alone(model, long, 6))
    assert out["short"] == alone(model, short, 6)


@pytest.mark.parametrize("family", FAMILIES)
def test_cancel_at_every_stage_frees_the_row_and_the_rest_go_on(family):
    """Cancelled while queued, while its prompt is fed, in its drafter's stage and while decoding: each leaves
    at the next step; the rows left decode on, equal to each alone."""
    from test_agent_prefill import engine_for

    model = target(family)
    ps = prompts(5, seed=9)
    long = ps[0] * 20
    engine = engine_for(model, drafter(family))
    for i, p in enumerate([long] + ps[1:]):
        engine.add(i, p, 12)
    engine.cancel(4)  # queued
    ended, out = {}, {}

    def step():
        for o in engine.step():
            out.setdefault(o.seq_id, []).extend(o.tokens)
            if o.finished:
                ended[o.seq_id] = o.finished

    for _ in range(3):
        step()
    assert ended.get(4) == "cancelled"
    stage = {p["id"]: p["stage"] for p in engine.prefilling()}
    assert stage.get(0) == "target"
    engine.cancel(0)  # feeding its prompt
    step()
    assert ended.get(0) == "cancelled"
    while not any(p["stage"] == "drafter" for p in engine.prefilling()) and engine.running():
        step()
    in_drafter = next((p["id"] for p in engine.prefilling() if p["stage"] == "drafter"), None)
    if in_drafter is not None:
        engine.cancel(in_drafter)
        step()
        assert ended.get(in_drafter) == "cancelled"
    def decoding_row():  # a row past both stages, decoding
        return next((s.id for s in engine.seqs if s.id not in ended and s.id not in engine.prefills.joining), None)

    while decoding_row() is None:
        step()
    decoding = decoding_row()
    engine.cancel(decoding)
    step()
    assert ended.get(decoding) == "cancelled"
    while engine.running():
        step()
    assert engine.cache == [] and not engine.seqs
    for i in range(1, 4):
        if ended[i] != "cancelled":
            assert out[i] == alone(model, ps[i], 12)


@pytest.mark.cpu_exact
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_a_hybrid_target_s_own_mtp_head_drafts_for_every_row(tmp_path_factory, family):
    """The batched MTP head (one head pass for all rows) on a hybrid target: rows equal each alone; a prefix
    hit hands the head its entries too (the drafter's state rides in the tree beside the checkpoint)."""
    from mlx_engine.drafters.mtp import load_mtp_drafter
    from test_mtp_helpers import load_hf, make

    folder = make(tmp_path_factory, family)
    model, config = load_hf(folder)
    engine = BatchEngine(model, load_mtp_drafter(model, folder, config), num_draft=2, max_batch=6)
    assert engine.batched is not None and engine.drafter_kept is None
    reqs = {i: (p, 14, {}) for i, p in enumerate(prompts(6, seed=4))}
    got, _ = run(engine, reqs, joins={2: [4], 5: [5]})
    assert got == {i: alone(model, p, n) for i, (p, n, _) in reqs.items()}
    first = reqs[0][0] * 3
    answer, _ = run(engine, {"a": (first, 8, {})})
    nxt = first + answer["a"] + [7, 8, 9]
    got, done = run(engine, {"b": (nxt, 8, {})})
    assert got["b"] == alone(model, nxt, 8)
    assert done["b"][1]["reused_prompt_tokens"] == len(first) + 7  # the whole first turn: history less its last


@pytest.mark.parametrize("family", ["qwen3_next", "gpt_oss"])
def test_a_prompt_crossing_the_layers_in_steps_beside_a_stream(family, monkeypatch):
    """Deep in a long prompt a token crosses the layers over several steps (target_model/layer_span.py): in the
    layers it rests in, a recurrent row keeps its state and a window row its entries; both streams equal
    each alone."""
    from mlx_engine.core import batch_turn
    from test_layer_span import PROMPT, SHORT, crossing_run

    monkeypatch.setattr(batch_turn, "SMALL_PROMPT", 0)  # (the 40-token prompt plays a deep one)
    model = target(family)
    out, _, reached = crossing_run(model, drafter(family), PROMPT)
    assert {1, 2, 3} <= set(reached)  # it crossed in shares
    assert out["long"] == alone(model, PROMPT, 12) and out["stream"] == alone(model, SHORT, 400)


@pytest.mark.cpu_exact
def test_batch_invariant_rows_of_a_hybrid_equal_its_invariant_decode_and_a_window_says_why_not():
    """--batch-invariant: a hybrid's rows equal Engine(batch_invariant=True) alone; sliding windows are not
    covered by the invariant attention yet, and the engine says so (the server's fair queue then says why)."""
    model = tiny_models.build("qwen3_next", seed=1)[0]  # (its own copy: the invariant path patches it in place)
    own = DraftModelDrafter(draft.__wrapped__("qwen3_next"), tiny_models.VOCAB)
    engine = BatchEngine(model, own, num_draft=2, max_batch=4, batch_invariant=True)
    assert engine.supported is None and engine.batch_invariant
    reqs = {i: (p, 10, {}) for i, p in enumerate(prompts(4))}
    got, _ = run(engine, reqs)
    for i, (p, n, _) in reqs.items():
        cfg = GenerationConfig(max_tokens=n, num_draft=0)
        assert got[i] == [t for s in Engine(model, None, batch_invariant=True).generate(p, cfg) for t in s.tokens]
    windows = BatchEngine(tiny_models.build("gpt_oss", seed=1)[0], None, batch_invariant=True)
    assert "sliding-window" in windows.supported


@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss"])
def test_four_rows_each_under_its_own_schema_equal_plain_constrained(family):
    """Structured output on these rows (core/batch_grammar.py): each row held to its own JSON schema, its
    grammar's forced runs drafted beside a draft model's drafts, equals plain constrained greedy decoding
    (mlx-lm's generate_step driving llguidance) and is valid."""
    import json

    import jsonschema

    import grammar_util as gu
    from test_grammar_batch import N, run_batch

    model = target(family, gu.VOCAB)
    outs, stats, _ = run_batch(model, drafter(family, gu.VOCAB), [gu.schema_grammar(s) for s in gu.SCHEMAS], 2)
    for j, (prompt, schema) in enumerate(zip(gu.PROMPTS, gu.SCHEMAS)):
        assert outs[j] == gu.reference(model, prompt, gu.schema_grammar(schema), N), f"row {j}"
        if outs[j][-1] == gu.eos():
            jsonschema.validate(json.loads(gu.decode(outs[j])), schema)
    assert sum(s["forced"] for s in stats.values()) > 0
