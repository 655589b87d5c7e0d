"""An agent's long prompt must not starve the batch engine (issue 39): a short request that arrives while a
long prompt is fed, in the target's stage or the drafter's, gets its first token within a bounded number
of engine steps (steps, not seconds: any machine); a prefix-tree hit re-feeds neither the target nor the
drafter (tokens counted), and the drafter's restored entries equal those of a cold feed; a row cancelled
in its drafter stage leaves at the next step; greedy output is unchanged throughout. For every drafter kind
the server batches with: none, mtp, eagle3, dflash, a draft model, suffix+mtp."""

import copy
import json

import mlx.core as mx
import numpy as np
import pytest

import dflash_util
import tiny_models
from eagle3_writer import write_eagle3
from mlx_engine.core import drafter_prefix
from mlx_engine.drafters.base import hidden_request
from mlx_engine.core.batch_engine import BatchEngine
from mlx_engine.drafters.chain import ChainDrafter
from mlx_engine.drafters.dflash import DFlashDrafter, DFlashModel, load_dflash
from mlx_engine.drafters.draft_model import DraftModelDrafter
from mlx_engine.drafters.eagle3 import load_eagle3_drafter
from mlx_engine.drafters.mtp import load_mtp_drafter
from mlx_engine.drafters.mtp.drafter import MTPDrafter
from mlx_engine.drafters.suffix import SuffixDrafter
from mlx_engine.drafters.suffix_cache import SuffixCache
from mlx_engine.target_model.model import Target
from test_batch_prefill import alone, assert_greedy_equal
from test_greedy_equality import noisy_copy
from test_mtp_helpers import load_hf, make

KINDS = ["none", "mtp", "eagle3", "dflash", "draft", "suffix+mtp"]
KEPT = [k for k in KINDS if k != "none"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """kind -> (target model, a fresh drafter each call, vocabulary)."""
    cache = {}

    def get(kind):
        if kind in cache:
            model, factory, vocab = cache[kind]
            return model, factory(), vocab
        if kind in ("mtp", "suffix+mtp"):
            folder = make(tmp_path_factory, "deepseek_v3")
            model, config = load_hf(folder)
            proto = load_mtp_drafter(model, folder, config)
            vocab = Target(model).vocab_size
            factory = (lambda: proto) if kind == "mtp" else \
                (lambda: ChainDrafter(proto, SuffixDrafter(SuffixCache(), min_match=2)))
        elif kind == "eagle3":
            model, cfg = tiny_models.build("llama", seed=0, num_hidden_layers=6)
            folder = tmp_path_factory.mktemp("eagle3")
            write_eagle3(folder, cfg)
            proto = load_eagle3_drafter(folder, model)
            factory, vocab = (lambda: proto), tiny_models.VOCAB
        elif kind == "dflash":
            vocab = 64
            model = tiny_models.build("qwen3", seed=2, vocab=vocab)[0]
            folder = tmp_path_factory.mktemp("dflash") / "full"
            dflash_util.write_dflash(folder, 48, vocab, layer_ids=(0, 1))
            proto = DFlashDrafter(load_dflash(folder), model)
            factory = lambda: proto
        elif kind == "draft":
            model, vocab = tiny_models.build("llama", seed=1)[0], tiny_models.VOCAB
            proto = DraftModelDrafter(noisy_copy("llama"), vocab)
            factory = lambda: proto
        else:
            model, vocab = tiny_models.build("llama", seed=3)[0], tiny_models.VOCAB
            factory = lambda: None
        cache[kind] = (model, factory, vocab)
        return model, factory(), vocab

    return get


def prompts(vocab):
    rng = np.random.default_rng(11)
    long = rng.integers(1, vocab, 300).tolist()
    short = rng.integers(1, vocab, 8).tolist()
    return long, short


def engine_for(model, drafter, **kw):
    # a huge idle budget: chunks grow to prefill_step whatever this machine's speed (counts, not seconds)
    return BatchEngine(model, drafter, num_draft=2, prefill_step=16, idle_budget=1e6, **kw)


def step_until(engine, cond, out, limit):
    """Step until cond(outputs so far) holds; -> the steps it took (fails past `limit`)."""
    for n in range(1, limit + 1):
        for o in engine.step():
            out.setdefault(o.seq_id, []).extend(o.tokens)
        if cond(out):
            return n
    raise AssertionError(f"not within {limit} steps; prefilling: {engine.prefilling()}")


def drain(engine, out):
    step_until(engine, lambda _: not engine.running(), out, 3000)


@pytest.mark.parametrize("kind", KINDS)
def test_a_short_request_is_not_starved_by_a_long_prompt_in_either_stage(built, kind):
    model, drafter, vocab = built(kind)
    long, short = prompts(vocab)
    # long enough that its drafter stage outlasts the steps counted below (chunks of 64, 128, ... positions):
    # a long row that drafted and decoded would give the newcomer chunks sized by this machine's step times
    long = long * 4
    engine = engine_for(model, drafter)
    out = {}
    engine.add("long", long, 12)
    for _ in range(4):
        engine.step()
    assert [p["stage"] for p in engine.prefilling()] == ["target"]
    before = engine.prefilling()[0]["done"]
    engine.add("short", short, 6)  # while the long prompt's target stage runs
    fed = []
    steps = step_until(engine, lambda o: fed.append(engine.prefilling()[0]["done"]) or o.get("short"), out, 20)
    assert steps == 1, f"first token after {steps} steps (its row joins into the spare row and is fed at once)"
    # the newcomer's steps carry its own work only: the long prompt waits (beside its chunk, the short one
    # would wait as long as that chunk takes)
    assert engine.prefilling()[0]["id"] == "long" and set(fed) == {before}, (before, fed)
    step_until(engine, lambda o: len(o.get("short", [])) >= 6, out, 40)
    if kind != "none":  # the long one's drafter stage: a new short request again goes first
        step_until(engine, lambda o: o.get("long"), out, 200)
        assert [(p["id"], p["stage"]) for p in engine.prefilling()] == [("long", "drafter")]
        engine.add("short2", short[::-1], 6)
        steps = step_until(engine, lambda o: o.get("short2"), out, 20)
        assert steps <= 2, f"first token after {steps} steps in the long one's drafter stage"
        # its own drafter stage (8 positions) is fed before the long one's rest: it drafts within a step
        step_until(engine, lambda _: engine.prefilling() == [] or "short2" not in
                   [p["id"] for p in engine.prefilling()], out, 4)
        assert any(p["id"] == "long" for p in engine.prefilling()), "the long drafter was done first anyway"
    drain(engine, out)
    for sid, p, n in (("long", long, 12), ("short", short, 6), ("short2", short[::-1], 6)):
        if sid in out:
            assert_greedy_equal(model, p, out[sid], alone(model, p, n))


def test_a_request_joining_a_long_decoding_row_takes_its_spare_row_and_is_fed_in_that_step(built):
    """A long prompt fed alone grows its cache with one spare row (another request could still join), so a
    short request arriving while the long one decodes joins into it in place (no array of the long row's
    entries copied) and gets its first token from the step it joins in, the remeasuring step that follows a
    long prefill included (its few tokens do not wait for that measurement), its 40 tokens in one chunk
    whatever the chunk sizer says (8 here). A batch of one keeps no spare."""
    model, _, vocab = built("none")
    long, short = prompts(vocab)
    short = short * 5
    engine, out = BatchEngine(model, None, num_draft=2, prefill_step=64, idle_budget=1e6), {}
    engine.add("long", long, 10)
    step_until(engine, lambda o: o.get("long"), out, 200)
    engine.prefills.chunk_size = lambda *a, **k: 8
    assert all(bc.allocated == 2 for bc in engine.cache)
    arrays = [(bc.keys, bc.values) for bc in engine.cache]
    engine.add("short", short, 4)
    assert step_until(engine, lambda o: o.get("short"), out, 10) == 1
    assert all((bc.keys, bc.values) == a for bc, a in zip(engine.cache, arrays))
    drain(engine, out)
    for sid, p, n in (("long", long, 10), ("short", short, 4)):
        assert_greedy_equal(model, p, out[sid], alone(model, p, n))
    single = BatchEngine(model, None, max_batch=1, prefill_step=16, idle_budget=1e6)
    single.add("long", long, 10)
    step_until(single, lambda o: o.get("long"), {}, 200)
    assert [bc.allocated for bc in single.cache] == [1] * len(single.cache)


def test_the_mtp_head_feeds_the_last_slot_of_a_piece_alone(built, monkeypatch):
    """The MTP head's prompt is fed in pieces whose last slot goes alone: only that slot's output h' is read,
    so the slots before it compute their keys and values only (fed with them, its row cost the piece's
    whole attention and MLP: a 2.5 s step 8k deep on a 2-core CPU, against ~0.04 s for the entries)."""
    model, drafter, vocab = built("mtp")
    long, _ = prompts(vocab)
    target = Target(model)
    _, hidden = target.forward(mx.array(long[:-1]), target.make_cache(), hidden_request(drafter))
    d = copy.copy(drafter)
    d.begin(list(long), hidden)
    pending = len(d._pend_tok)
    sizes = []
    real = MTPDrafter._run
    monkeypatch.setattr(MTPDrafter, "_run", lambda self, i, t, h: (sizes.append(t.shape[0]) if i == 0 else None)
                        or real(self, i, t, h))
    d.prefill_pending(100)
    d.flush()
    assert sizes == [99, 1, pending - 101, 1]


class FeedCounter:
    """Counts the positions every drafter kind feeds into its own state (patched at its feeding primitive)."""

    def __init__(self, monkeypatch):
        self.n = 0
        real_feed = MTPDrafter._feed_pending

        def mtp_feed(d, limit=None):
            before = len(d._pend_tok)
            real_feed(d, limit)
            self.n += before - len(d._pend_tok)
        monkeypatch.setattr(MTPDrafter, "_feed_pending", mtp_feed)
        real_forward = DraftModelDrafter._forward
        monkeypatch.setattr(DraftModelDrafter, "_forward",
                            lambda d, t: self.add(t.shape[0]) or real_forward(d, t))
        real_context = DFlashModel.feed_context
        monkeypatch.setattr(DFlashModel, "feed_context",
                            lambda m, f, c, s: self.add(f.shape[0]) or real_context(m, f, c, s))
        real_block = DFlashDrafter.block_hidden
        monkeypatch.setattr(DFlashDrafter, "block_hidden",
                            lambda d: self.add(sum(p.shape[0] for p in d._pending)) or real_block(d))

    def add(self, n):
        self.n += n


def reference_states(engine, drafter, tokens):
    """The drafter's state after a cold feed of `tokens` (prompt + first token), in the tree's frame."""
    target = engine.target
    _, hidden = target.forward(mx.array(tokens[:-1]), target.make_cache(), engine.want_hidden)
    ref = copy.copy(drafter)
    ref.begin(list(tokens), hidden)
    while getattr(ref, "prefill_pending", lambda n: 0)(1 << 20):
        pass
    getattr(ref, "flush", lambda: None)()
    return ref.prefix_states()


@pytest.mark.parametrize("kind", KEPT)
def test_a_prefix_hit_refeeds_neither_the_target_nor_the_drafter(built, kind, monkeypatch):
    model, drafter, vocab = built(kind)
    long, _ = prompts(vocab)
    turn1 = long[:200]
    engine = engine_for(model, drafter)
    assert engine.drafter_kept is None, engine.drafter_kept
    out = {}
    engine.add("t1", turn1, 16)
    drain(engine, out)
    turn2 = turn1 + out["t1"] + [7, 8, 9]
    counter = FeedCounter(monkeypatch)
    engine.add("t2", turn2, 16)
    s = None
    for _ in range(100):  # until its drafter drafts: then its state is compared with a cold feed's
        for o in engine.step():
            out.setdefault(o.seq_id, []).extend(o.tokens)
        s = next((s for s in engine.seqs if s.id == "t2"), None)
        if s is not None and engine._ready_to_draft(s):
            break
    fed_at_ready = counter.n
    new = len(turn2) - len(turn1)
    assert fed_at_ready <= new + 2, f"the drafter was fed {fed_at_ready} positions for {new} new tokens"
    states, n = drafter_prefix.row_states(engine, s)
    ref, ref_n = reference_states(engine, drafter, s.history)
    m = min(n, ref_n)
    assert m >= len(turn2) - 1
    for got, want in zip(states, ref):
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.array(a[..., :m, :]), np.array(b[..., :m, :]), rtol=2e-3, atol=2e-4)
    drain(engine, out)
    assert s.reused >= len(turn1) + len(out["t1"]) - 1  # the target's side: its prefill skipped too
    assert_greedy_equal(model, turn2, out["t2"], alone(model, turn2, 16))
    # the same turn cold: the drafter is fed the whole prompt (what the count above would show without it)
    cold = engine_for(model, copy.copy(drafter), prefix_cache_bytes=0)
    counter.n = 0
    cold.add("t2", turn2, 2)
    step_until(cold, lambda _: not cold.running(), {}, 200)
    assert counter.n >= len(turn2) - 2


@pytest.mark.parametrize("kind", ["mtp", "draft"])
def test_cancel_in_the_drafter_stage_frees_the_row(built, kind):
    model, drafter, vocab = built(kind)
    long, short = prompts(vocab)
    engine = engine_for(model, drafter, max_batch=2)
    out = {}
    engine.add("long", long, 12)
    step_until(engine, lambda o: o.get("long"), out, 200)
    assert [(p["id"], p["stage"]) for p in engine.prefilling()] == [("long", "drafter")]
    engine.cancel("long")
    outs = engine.step()
    assert [(o.seq_id, o.finished) for o in outs] == [("long", "cancelled")]
    assert engine.prefilling() == [] and engine.running() == 0 and engine.free_slots() == 2
    engine.add("short", short, 4)
    drain(engine, out)
    assert out["short"] == alone(model, short, 4)


def test_a_pass_that_only_feeds_a_prompt_is_evaluated_in_its_step(built, monkeypatch):
    """A step that feeds a chunk and hands out no token waits for its pass: left lazy, the chunks' graph piled
    up over the whole prompt (steps timed at ~0, the step that finally read a token paid for all of them)."""
    from mlx_engine import host

    model, _, vocab = built("none")
    long, _ = prompts(vocab)
    engine = engine_for(model, None)
    engine.add("long", long, 4)
    engine.step()  # the first chunk, alone (the batch's shapes come from it)
    waits = []
    real = host.wait
    monkeypatch.setattr(host, "wait", lambda *a: waits.append(a) or real(*a))
    for _ in range(3):
        waits.clear()
        engine.step()
        assert waits, "a prompt-only step left its pass unevaluated"
        for bc in engine.cache:
            assert all(a is not None for a in bc.state)


def test_a_prompt_fed_alone_crosses_the_layers_in_shares_skipping_the_rest(monkeypatch):
    """While nothing decodes, a chunk too long for one IDLE_STEP crosses the decoder layers over several
    steps and the layers it does not cross are not computed at all (so a request arriving waits for a share,
    not for the whole chunk); the output equals the request alone, and a short request arriving
    mid-crossing still has its first token two steps later."""
    from mlx_lm.models.llama import TransformerBlock

    from mlx_engine.core import batch_prefill

    model = tiny_models.build("llama", seed=3, num_hidden_layers=4)[0]
    long, short = prompts(tiny_models.VOCAB)
    engine = engine_for(model, None)
    engine.add("long", long, 8)
    out = {}
    step_until(engine, lambda _: engine.prefilling()[0]["done"] >= 16, out, 10)  # its chunk time measured
    monkeypatch.setattr(batch_prefill, "IDLE_STEP", 1e-12)  # every chunk now crosses a layer a step
    calls = []
    real = TransformerBlock.__call__
    monkeypatch.setattr(TransformerBlock, "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    done = []
    for _ in range(8):
        calls.clear()
        engine.step()
        done.append(engine.prefilling()[0]["done"])
        assert len(calls) == 1, f"{len(calls)} layers computed in a step that crosses one"
    assert done[3] == done[0] + 16 and done[:3] == [done[0]] * 3  # 4 steps (layers) per 16-token chunk
    assert done[7] == done[4] + 16  # the chunk keeps its size (a share is not a smaller chunk)
    monkeypatch.setattr(batch_prefill, "IDLE_STEP", 1e6)  # a short prompt's chunk is not split
    engine.add("short", short, 4)
    steps = step_until(engine, lambda o: o.get("short"), out, 20)
    assert steps <= 2
    drain(engine, out)
    assert_greedy_equal(model, long, out["long"], alone(model, long, 8))
    assert_greedy_equal(model, short, out["short"], alone(model, short, 4))


def test_a_share_s_time_sizes_the_next_shares_and_a_chunk_s_unread_last_share_is_not_timed(monkeypatch):
    """A chunk fed alone in shares: each share's measured time sets the layers of the next (those that fit
    IDLE_STEP); the chunk's last share is not timed for the sizer when its output is not read (no first token
    from it: that layer's attention and MLP are never evaluated, only its keys and values, so timed as a
    whole pass it made the next chunk too large). A layer a step over 4 layers: 3 of every 4 steps timed."""
    from mlx_engine.core import batch_prefill
    from mlx_engine.core.batch_prefill import Prefilling
    from mlx_engine.target_model.layer_span import Span

    model = tiny_models.build("llama", seed=3, num_hidden_layers=4)[0]
    long, _ = prompts(tiny_models.VOCAB)
    engine = engine_for(model, None)
    p = Prefilling(seq=None, share=4)
    engine.prefills.reshare(p, Span(0, 4, 8, 16), 2 * batch_prefill.IDLE_STEP)
    assert p.share == 2  # twice the aim: half the layers
    engine.prefills.reshare(p, Span(0, 8, 10, 16), batch_prefill.IDLE_STEP / 3)
    assert p.share == 6
    engine.add("long", long, 4)
    step_until(engine, lambda _: engine.prefilling()[0]["done"] >= 16, {}, 10)
    monkeypatch.setattr(batch_prefill, "IDLE_STEP", 1e-12)  # every chunk crosses a layer a step
    timed = []
    real = engine.prefills.observe
    monkeypatch.setattr(engine.prefills, "observe", lambda *a, **k: timed.append(1) or real(*a, **k))
    for _ in range(8):
        engine.step()
    assert len(timed) == 6, f"{len(timed)} of 8 share steps timed"


def test_a_chunk_crossing_in_shares_waits_while_a_row_decodes(monkeypatch):
    """A chunk fed alone in layer shares, when a row starts decoding beside it, waits (beside the decoding
    row its whole width would run every layer's matmuls each step) and then finishes at once; outputs equal
    each request alone."""
    from mlx_engine.core import batch_prefill

    model = tiny_models.build("llama", seed=3, num_hidden_layers=4)[0]
    long, short = prompts(tiny_models.VOCAB)
    engine = engine_for(model, None)
    engine.add("long", long, 8)
    out = {}
    step_until(engine, lambda _: engine.prefilling()[0]["done"] >= 16, out, 10)
    monkeypatch.setattr(batch_prefill, "IDLE_STEP", 1e-12)
    engine.step()  # the next chunk crosses its first layer
    p = engine.prefills.joining["long"]
    assert p.layer == 1 and p.share == 1
    monkeypatch.setattr(batch_prefill, "IDLE_STEP", 1e6)
    monkeypatch.setattr(batch_prefill, "PAUSE_STEPS", 3)
    engine.add("short", short, 12)
    step_until(engine, lambda o: o.get("short"), out, 4)
    layers = []
    for _ in range(5):  # the short row decodes: the crossing waits PAUSE_STEPS steps, then ends in one
        for o in engine.step():
            out.setdefault(o.seq_id, []).extend(o.tokens)
        layers.append(p.layer)
    assert layers == [1, 1, 1, 0, 0], layers
    drain(engine, out)
    assert_greedy_equal(model, long, out["long"], alone(model, long, 8))
    assert_greedy_equal(model, short, out["short"], alone(model, short, 12))
