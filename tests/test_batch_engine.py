"""Continuous batching with speculation (core/batch_engine.py): several sequences decoded together, each
drafting with its own drafter state, one verify pass for all, per-row rollback. Every sequence's output
equals the same request served alone."""

import mlx.core as mx
import numpy as np
import pytest

import tiny_models
from mlx_engine.core.batch_engine import BatchEngine
from mlx_engine.core.engine import Engine, GenerationConfig
from mlx_engine.drafters.mtp import load_head, load_mtp_drafter
from mlx_engine.drafters.ngram import NgramDrafter
from mlx_engine.sampling import SamplingConfig
from mlx_engine.target_model.batch_cache import BatchKVCache
from mlx_lm.models.cache import KVCache
from test_mtp_helpers import OracleMTP, load_hf, make

PROMPTS = [[5, 9, 17, 33, 2, 41, 5, 9], [7, 7, 8, 9, 10, 7, 7], [100, 3, 4, 100, 3], [1, 2, 3, 1, 2, 3, 1, 2],
           [200, 11, 5, 77, 128, 64, 31, 2, 99, 150, 7, 8]]


@pytest.fixture(scope="module")
def llama():
    return tiny_models.build("llama", seed=3)[0]


def alone(model, prompt, n, stop=frozenset(), sampling=None, seed=0):
    """The request served alone, plain decoding by the single-sequence Engine."""
    cfg = GenerationConfig(max_tokens=n, num_draft=0, stop_tokens=stop, sampling=sampling or SamplingConfig(), seed=seed)
    return [t for s in Engine(model, None).generate(prompt, cfg) for t in s.tokens]


def run(engine, requests, joins=None):
    """requests: {id: (prompt, max_tokens, kwargs)}; joins: {step: [ids]} (the rest join before step 0).
    -> ({id: tokens}, {id: (finish, stats)})."""
    joins = joins or {}
    later = {i for ids in joins.values() for i in ids}
    for i, (p, n, kw) in requests.items():
        if i not in later:
            engine.add(i, p, n, **kw)
    got, done, step = {i: [] for i in requests}, {}, 0
    while len(done) < len(requests):
        for i in joins.get(step, []):
            p, n, kw = requests[i]
            engine.add(i, p, n, **kw)
        for o in engine.step():
            got[o.seq_id] += o.tokens
            if o.finished:
                done[o.seq_id] = (o.finished, o.stats)
        step += 1
        assert step < 500
    return got, done


def test_rows_join_into_the_spare_rows_the_last_rows_left():
    """The last rows leave by shortening the row count (their arrays kept as spare rows) and the next rows
    join into them in place, no new arrays made; each row then holds exactly its own entries, the stale
    ones of a spare row never seen; a leave from the middle, or one leaving more than MAX_SPARE rows,
    copies into arrays of the rows kept."""
    from mlx_engine.target_model.batch_cache import MAX_SPARE

    mx.random.seed(1)
    entries = lambda n: (mx.random.normal((1, 2, n, 4)), mx.random.normal((1, 2, n, 4)))  # noqa: E731
    batch, singles = BatchKVCache(), []
    for n in (5, 9, 7):
        k, v = entries(n)
        batch.add_row(k, v)
        singles.append(KVCache())
        singles[-1].update_and_fetch(k, v)
    batch.keep_rows([0])
    arrays = (batch.keys, batch.values)
    assert batch.lens == [5] and batch.allocated == 3
    for n in (0, 4):  # an empty row (a prompt to be fed) and a prefix-cache hit
        k, v = entries(n)
        batch.add_row(k, v)
        c = KVCache()
        if n:
            c.update_and_fetch(k, v)
        singles[len(batch.lens) - 1] = c
    assert (batch.keys, batch.values) == arrays and batch.allocated == 3  # joined in place
    new_k, new_v = mx.random.normal((3, 2, 2, 4)), mx.random.normal((3, 2, 2, 4))
    mask = batch.make_mask(2)
    keys, _ = batch.update_and_fetch(new_k, new_v)
    assert keys.shape[0] == 3
    for i, c in enumerate(singles):
        c.update_and_fetch(new_k[i : i + 1], new_v[i : i + 1])
        k, v = batch.row(i)
        assert mx.array_equal(k, c.keys[:, :, : c.offset]) and mx.array_equal(v, c.values[:, :, : c.offset])
        assert mask[i, 0].tolist() == [[p <= c.offset - 2 + q for p in range(mask.shape[-1])] for q in range(2)]
    batch.keep_rows([0, 2])  # the middle row leaves: a copy
    assert batch.allocated == 2 and batch.lens == [7, 6]
    assert mx.array_equal(batch.row(1)[0], singles[2].keys[:, :, : singles[2].offset])
    for _ in range(MAX_SPARE + 1):
        batch.add_row(*entries(1))
    batch.keep_rows([0])  # MAX_SPARE + 2 rows left: their memory given back
    assert batch.allocated == 1 and batch.lens == [7]



def test_arrays_made_anew_hold_the_spare_rows_asked_for_and_the_next_row_joins_into_one():
    """`spare`: a cache grown (a long prompt's room) or rebuilt by a join holds that many rows beyond the live
    ones; the next row joins into one in place (no new arrays, add_row says nothing was copied), each row
    holding exactly its own entries; with none spare a join copies (and says so)."""
    mx.random.seed(2)
    entries = lambda n: (mx.random.normal((1, 2, n, 4)), mx.random.normal((1, 2, n, 4)))  # noqa: E731
    batch, singles = BatchKVCache(), []
    batch.spare = 1

    def add(n):
        k, v = entries(n)
        copied = batch.add_row(k, v)
        singles.append(KVCache())
        if n:
            singles[-1].update_and_fetch(k, v)
        return copied

    assert add(5) is False and batch.allocated == 2
    batch.reserve(600)  # grown ahead of a long prompt: the spare row kept
    assert batch.capacity >= 600 and batch.allocated == 2
    arrays = (batch.keys, batch.values)
    assert add(3) is False and (batch.keys, batch.values) == arrays  # joined in place
    batch.spare = 0
    assert add(0) is True and batch.allocated == 3  # no spare row left: copied
    new_k, new_v = mx.random.normal((3, 2, 2, 4)), mx.random.normal((3, 2, 2, 4))
    batch.update_and_fetch(new_k, new_v)
    for i, c in enumerate(singles):
        c.update_and_fetch(new_k[i : i + 1], new_v[i : i + 1])
        k, v = batch.row(i)
        assert mx.array_equal(k, c.keys[:, :, : c.offset]) and mx.array_equal(v, c.values[:, :, : c.offset])


@pytest.mark.cpu_exact
@pytest.mark.parametrize("num_draft", [0, 1, 3, "auto"])
def test_concurrent_greedy_each_equals_alone(llama, num_draft):
    stop = frozenset({17})
    reqs = {i: (p, 20 + 3 * i, {"stop_tokens": stop}) for i, p in enumerate(PROMPTS)}
    ref = {i: alone(llama, p, n, stop) for i, (p, n, _) in reqs.items()}
    engine = BatchEngine(llama, NgramDrafter(), num_draft=num_draft, max_batch=5)
    got, done = run(engine, reqs, joins={2: [3], 5: [4]})  # two requests join a running batch
    assert got == ref
    for i, (finish, stats) in done.items():
        assert finish == ("stop" if ref[i][-1] in stop else "length")
        assert stats["completion_tokens"] == len(ref[i])
        assert 0 <= stats["accepted"] <= stats["drafted"]
        if stats["verify_passes"]:  # tokens per drafting step: accepted drafts + 1, at most k + 1
            assert 1 <= stats["tokens_per_verify"] <= (8 if num_draft == "auto" else num_draft) + 1
    if num_draft not in (0, "auto"):
        assert sum(s["accepted"] for _, s in done.values()) > 0  # prompt lookup found something to accept


@pytest.mark.cpu_exact
def test_mtp_rows_draft_with_their_own_state(tmp_path_factory):
    """An MTP head per row (each sequence its own head cache), batched verify: each output equals its
    request served alone. With an oracle head (drafts right whenever the row's OWN history is right) every
    draft of every row is accepted: no row drafts from another row's state."""
    folder = make(tmp_path_factory, "deepseek_v3")
    model, config = load_hf(folder)
    reqs = {i: (p, 24, {}) for i, p in enumerate(PROMPTS[:3])}
    engine = BatchEngine(model, load_mtp_drafter(model, folder, config), num_draft=2, max_batch=3,
                         batched_drafting=False)
    assert engine.supported is None
    got, _ = run(engine, reqs, joins={1: [2]})
    for i, (p, n, _) in reqs.items():
        assert got[i] == alone(model, p, n)

    oracle = OracleMTP(load_head(model, folder, config), model)
    got, done = run(BatchEngine(model, oracle, num_draft=3, max_batch=3), reqs, joins={2: [2]})
    for i, (p, n, _) in reqs.items():
        assert got[i] == alone(model, p, n)
        stats = done[i][1]
        assert stats["drafted"] > 0 and stats["accepted"] == stats["drafted"]


@pytest.mark.cpu_exact
def test_sampled_rows_equal_themselves_alone(llama):
    """At T > 0 a row's draws come from its own seed and its logits do not depend on the other rows."""
    s = SamplingConfig(temperature=0.8, top_p=0.95)
    reqs = {i: (p, 16, {"sampling": s, "seed": 10 + i}) for i, p in enumerate(PROMPTS[:3])}
    together, _ = run(BatchEngine(llama, NgramDrafter(), num_draft=2, max_batch=3), reqs)
    for i, r in reqs.items():
        each, _ = run(BatchEngine(llama, NgramDrafter(), num_draft=2, max_batch=1), {i: r})
        assert together[i] == each[i]


def test_cancel_frees_the_row(llama):
    engine = BatchEngine(llama, NgramDrafter(), num_draft=2, max_batch=2)
    engine.add("a", PROMPTS[0], 50)
    engine.add("b", PROMPTS[1], 50)
    engine.step()
    engine.cancel("a")
    outs = engine.step()
    assert [o.finished for o in outs if o.seq_id == "a"] == ["cancelled"]
    assert engine.running() == 1 and engine.cache[0].lens and len(engine.cache[0].lens) == 1
    assert engine.cache[0].keys.shape[0] == 1


@pytest.mark.cpu_exact
def test_next_turn_reuses_a_finished_prefix(llama):
    engine = BatchEngine(llama, NgramDrafter(), num_draft=2, max_batch=2)
    first, _ = run(engine, {0: (PROMPTS[4], 10, {})})
    turn2 = PROMPTS[4] + first[0] + [3, 4, 5]
    got, done = run(engine, {1: (turn2, 10, {})})
    assert done[1][1]["reused_prompt_tokens"] >= len(PROMPTS[4])
    assert got[1] == alone(llama, turn2, 10)


def test_model_whose_cache_cannot_batch_is_refused():
    """LFM2's short-convolution layers (an ArraysCache that is not GatedDeltaNet's) are not batched: the engine
    says why (the server takes the fair queue and says it; tests/test_serve_batch.py)."""
    model = tiny_models.build("lfm2", seed=0)[0]
    engine = BatchEngine(model, None)
    assert engine.supported and "not GatedDeltaNet" in engine.supported
    with pytest.raises(ValueError, match="cannot be batched"):
        engine.add(0, [1, 2, 3], 4)


def test_batch_cache_rows_match_single_caches():
    """Rows of different lengths fed together hold exactly what each row's own KVCache holds; trim_row
    drops one row's tail only."""
    mx.random.seed(0)
    singles, batch = [KVCache(), KVCache()], BatchKVCache()
    for c, n in zip(singles, (5, 9)):
        k, v = mx.random.normal((1, 2, n, 4)), mx.random.normal((1, 2, n, 4))
        c.update_and_fetch(k, v)
        batch.add_row(k, v)
    new_k, new_v = mx.random.normal((2, 2, 3, 4)), mx.random.normal((2, 2, 3, 4))
    mask = batch.make_mask(3)
    batch.update_and_fetch(new_k, new_v)
    for i, c in enumerate(singles):
        c.update_and_fetch(new_k[i : i + 1], new_v[i : i + 1])
        k, v = batch.row(i)
        assert mx.array_equal(k, c.keys[:, :, : c.offset]) and mx.array_equal(v, c.values[:, :, : c.offset])
        n = c.offset - 3
        assert mask[i, 0].tolist() == [[p <= n + q for p in range(12)] for q in range(3)]
    batch.trim_row(1, 2)
    assert batch.lens == [8, 10]
    assert mx.array_equal(batch.row(1)[0], singles[1].keys[:, :, :10])


@pytest.mark.cpu_exact
@pytest.mark.parametrize("subset", [False, True], ids=["full-vocabulary", "vocab-subset"])
def test_batched_mtp_drafts_what_a_head_per_row_drafts(tmp_path_factory, monkeypatch, subset):
    """One head pass for all rows (drafters/mtp/batched.py) proposes, step by step, exactly the drafts of
    a separate MTP drafter per row, with rows joining and leaving, and the outputs equal alone; also on a
    reduced draft vocabulary (greedy: the argmax of the subset's scores)."""
    from mlx_engine.drafters.mtp.drafter import MTPDrafter

    folder = make(tmp_path_factory, "deepseek_v3")
    model, config = load_hf(folder)
    drafter = load_mtp_drafter(model, folder, config)
    if subset:  # every other token id, shuffled
        ids = np.random.default_rng(5).permutation(np.arange(0, model.args.vocab_size, 2))
        drafter.head.set_vocab_subset(mx.array(ids, dtype=mx.int32))
        drafter = MTPDrafter(drafter.head, drafter.target)
    reqs = {i: (p, 14 + 4 * i, {}) for i, p in enumerate(PROMPTS[:4])}
    logs = {}
    for batched in (False, True):
        engine = BatchEngine(model, drafter, num_draft=3, max_batch=4, batched_drafting=batched)
        assert (engine.batched is not None) == batched
        log = logs[batched] = []
        if batched:
            propose = engine.batched.propose

            def record(k, samplings, keys):
                drafts = propose(k, samplings, keys)
                for s, d in zip(engine.adopted, drafts):  # the drafts each row's acceptance reads (its room)
                    ki = min(k, s.max_tokens - s.generated - 1)
                    if ki > 0:
                        log.append((s.id, d.tokens[:ki].tolist()))
                return drafts

            engine.batched.propose = record
        else:
            from mlx_engine.core.batch_sequence import RunningSequence

            per_row = RunningSequence.propose

            def record(s, k):
                d = per_row(s, k)
                log.append((s.id, d.tokens.tolist()))
                return d

            monkeypatch.setattr(RunningSequence, "propose", record)
        got, _ = run(engine, reqs, joins={2: [2], 4: [3]})
        for i, (p, n, _) in reqs.items():
            assert got[i] == alone(model, p, n)
    by_row = {b: {i: [d for j, d in log if j == i] for i in reqs} for b, log in logs.items()}
    assert by_row[True] == by_row[False] and len(logs[True]) > 10  # each row's drafts, in its order


@pytest.mark.parametrize("num_draft", [0, 2])
def test_one_host_read_per_step(llama, num_draft):
    """A batched step, drafting or plain, synchronises with the device once: the read of every row's verdict."""
    from mlx_engine import host

    engine = BatchEngine(llama, NgramDrafter(), num_draft=num_draft, max_batch=3)
    for i, p in enumerate(PROMPTS[:3]):
        engine.add(i, p, 30)
    while engine.prefilling():  # a chunk of prefill per step, then each sequence's first token
        engine.step()
    before = dict(host.counts)
    for _ in range(5):
        engine.step()
    assert host.counts["read"] - before["read"] == 5
    assert host.counts["wait"] == before["wait"]


@pytest.mark.cpu_exact
def test_draft_model_rows_each_keep_their_own_draft_cache():
    """A separate draft model (a noisy copy of the target) drafts with a copy per row, each with its own draft
    cache and rollback: outputs equal alone, and the rows together accept about what the single-sequence
    Engine accepts (a shared or mixed-up draft cache would draft for the wrong history and collapse it)."""
    from mlx_engine.drafters.draft_model import DraftModelDrafter
    from test_greedy_equality import noisy_copy

    target = tiny_models.build("llama", seed=1)[0]
    drafter = DraftModelDrafter(noisy_copy("llama"), tiny_models.VOCAB)
    reqs = {i: (p, 20, {}) for i, p in enumerate(PROMPTS[:3])}
    got, done = run(BatchEngine(target, drafter, num_draft=3, max_batch=3), reqs, joins={2: [2]})
    for i, (p, n, _) in reqs.items():
        assert got[i] == alone(target, p, n)
    drafted = sum(s["drafted"] for _, s in done.values())
    accepted = sum(s["accepted"] for _, s in done.values())
    single_d = single_a = 0
    for p, n, _ in reqs.values():
        engine = Engine(target, drafter)
        list(engine.generate(p, GenerationConfig(max_tokens=n, num_draft=3)))
        single_d, single_a = single_d + engine.stats.drafted, single_a + engine.stats.accepted
    assert single_a > 0 and accepted / drafted > 0.7 * single_a / single_d


@pytest.mark.cpu_exact
def test_a_request_s_num_draft_caps_its_own_row(llama):
    """Per-request num_draft in a batch: a row with num_draft 0 never drafts (its verify input is padded to
    the others' k + 1), a row with 1 drafts at most 1, the others draft the batch's k; every output equals
    the request served alone, greedy and sampled (a capped row's draws are those of its own k)."""
    s = SamplingConfig(temperature=0.8, top_p=0.95)
    reqs = {0: (PROMPTS[3], 24, {"num_draft": 0}), 1: (PROMPTS[0], 24, {"num_draft": 1}), 2: (PROMPTS[3], 24, {}),
            3: (PROMPTS[1], 16, {"num_draft": 0, "sampling": s, "seed": 5})}
    # 1-token matches: the tiny model's text always has one, so an uncapped row drafts on every step
    got, done = run(BatchEngine(llama, NgramDrafter(min_ngram=1), num_draft=3, max_batch=4), reqs)
    for i in (0, 1, 2):
        assert got[i] == alone(llama, reqs[i][0], reqs[i][1])
    each, _ = run(BatchEngine(llama, NgramDrafter(), num_draft=0, max_batch=1), {3: reqs[3]})
    assert got[3] == each[3]
    assert done[0][1]["drafted"] == 0 and done[3][1]["drafted"] == 0 and done[0][1]["verify_passes"] == 0
    assert done[1][1]["drafted"] <= done[1][1]["verify_passes"]  # at most 1 per step
    assert done[2][1]["drafted"] > done[2][1]["verify_passes"]  # more than 1 per step
    with pytest.raises(ValueError):
        BatchEngine(llama, NgramDrafter(), num_draft=2).add(9, PROMPTS[0], 4, num_draft=-1)


@pytest.mark.cpu_exact
def test_a_row_near_its_max_tokens_does_not_cut_the_others_drafts(llama):
    """A row drafts no further than its room before max_tokens, and only its own drafts shrink: three short
    requests ending next to a long one leave the long one at 2 drafts a step until its own last steps (a
    step of k < 2 is one where only rows near their end decode)."""
    reqs = {0: (PROMPTS[3], 40, {}), 1: (PROMPTS[0], 3, {}), 2: (PROMPTS[1], 4, {}), 3: (PROMPTS[2], 5, {})}
    engine = BatchEngine(llama, NgramDrafter(), num_draft=2, max_batch=4)
    step, checked = engine.step, []

    def watched():  # each step's k, where the long row decodes with room for 2 drafts
        long = next((s for s in engine.seqs if s.id == 0 and s.id not in engine.prefills.joining), None)
        before = dict(engine.k_steps)
        outs = step()
        if long is not None and long.max_tokens - long.generated - 1 >= 2:
            checked.append([k for k in engine.k_steps if engine.k_steps[k] != before.get(k, 0)])
        return outs

    engine.step = watched
    got, done = run(engine, reqs)
    for i, (p, n, _) in reqs.items():
        assert got[i] == alone(llama, p, n)
    assert len(checked) > 10 and all(ks == [2] for ks in checked), checked


def test_a_request_of_one_token_leaves_the_batch_and_the_batch_goes_on(llama):
    """max_tokens 1 (as a stop token first): the row ends in the step that feeds its prompt's last token,
    before its drafter is begun, and leaves with its prompt stored in the prefix tree (that leaving read the
    row's hidden rows, which only a begun drafter had set: the step raised, failing every request of a
    server's batch); the other row goes on."""
    engine = BatchEngine(llama, NgramDrafter(), num_draft=2, max_batch=2)
    got, done = run(engine, {"one": (PROMPTS[0], 1, {}), "other": (PROMPTS[3], 10, {})})
    assert got == {"one": alone(llama, PROMPTS[0], 1), "other": alone(llama, PROMPTS[3], 10)}
    assert done["one"][0] == "length" and engine.prefix_cache.match(PROMPTS[0]) == len(PROMPTS[0])


def test_a_row_s_acceptance_evidence_is_its_own_beside_a_row_feeding_its_prompt(llama):
    """Per-row acceptance evidence (the batch policy's RowEvidence, which turns a row's drafting off when its
    own drafts fail) counts that row's own verdicts, also when a row still feeding its prompt sits before
    it in the batch (the decoding rows are a subset of the batch's rows: the evidence is theirs, not that
    of the rows at the same positions). With no fading, a row's tries at the first draft position are its
    drafting steps and its hits its accepted drafts (one draft a step here)."""
    from mlx_engine.core.batch_policy import BatchPolicy

    long = (PROMPTS[4] * 40)[:400]  # at most 8 tokens a step: still feeding after the 25 steps below
    engine = BatchEngine(llama, NgramDrafter(min_ngram=1), num_draft="auto", max_batch=2, max_draft=1,
                         prefill_step=8)
    assert isinstance(engine.policy, BatchPolicy) and engine.policy.per_row_drafting
    engine.policy.row_window = float("inf")  # no fading: the counts are plain sums
    engine.add("feeding", long, 4)
    engine.step()
    engine.add("decoding", PROMPTS[0], 60)
    checked = 0
    for _ in range(25):  # the decoding row emits at most 2 tokens a step: it runs throughout
        engine.step()
        first, second = engine.seqs
        assert first.id == "feeding" and second.id == "decoding" and engine.prefills.feeding(first) is not None
        assert first.evidence.tries == [] and first.drafted == 0
        ev = second.evidence
        assert (ev.tries[:1], ev.hits[:1]) == (([second.verifies], [second.accepted]) if second.verifies else ([], []))
        checked += second.verifies > 0
    assert checked >= 5 and second.accepted > 0


@pytest.mark.parametrize("num_draft", [0, 2])
def test_a_stop_token_frees_its_row_in_the_step_that_emits_it(llama, num_draft):
    """A row whose stop token comes out (as its first token, or mid-answer, in a verify pass or a plain
    step) leaves the batch in the step that emits it: that step's output ends it, the row is gone from the
    batch and its cache, and no later step computes it (until max_tokens it would decode on unseen)."""
    whole = alone(llama, PROMPTS[0], 12)
    for stop in (whole[0], whole[5]):  # (whole[5] first occurs there)
        want = whole[: whole.index(stop) + 1]
        engine = BatchEngine(llama, NgramDrafter(min_ngram=1), num_draft=num_draft, max_batch=2)
        engine.add("other", PROMPTS[3], 40)
        engine.add("stops", PROMPTS[0], 60, stop_tokens=frozenset({stop}))
        got, ended, steps = [], None, 0
        while ended is None:
            outs = engine.step()
            steps += 1
            assert steps < 60
            for o in outs:
                if o.seq_id == "stops":
                    got += o.tokens
                    ended = o.finished
        assert (got, ended) == (want, "stop")
        assert [s.id for s in engine.seqs] == ["other"] and engine.cache[0].keys.shape[0] == 1
        assert all(o.seq_id == "other" for o in engine.step())
