"""Long prompts in the batch engine: prefilled a chunk per step inside the running batch's own pass (no
stall, no pass of their own), shortest first, cancellable mid-prefill, and started from the prefix tree of
earlier requests or from another row."""

import mlx.core as mx
import numpy as np
import pytest

import tiny_models
from mlx_engine.core.batch_engine import BatchEngine
from mlx_engine.core.context import ContextLengthError
from mlx_engine.core.engine import Engine, GenerationConfig
from mlx_engine.drafters.mtp import load_mtp_drafter
from mlx_engine.drafters.ngram import NgramDrafter
from mlx_engine.sampling import SamplingConfig
from mlx_engine.target_model.model import Target
from test_mtp_helpers import load_hf, make

LONG = np.random.default_rng(5).integers(0, tiny_models.VOCAB, 300).tolist()
SHORT = [5, 9, 17, 33, 2, 41, 5, 9]


@pytest.fixture(scope="module")
def llama():
    return tiny_models.build("llama", seed=3)[0]


def alone(model, prompt, n):
    cfg = GenerationConfig(max_tokens=n, num_draft=0)
    return [t for s in Engine(model, None).generate(prompt, cfg) for t in s.tokens]


def assert_greedy_equal(model, prompt, got, expected):
    """Equal, or different first where the target's two best logits are within float error of each other:
    chunks of another size reduce the attention in another order (1e-6 here), which may flip a tie."""
    i = next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    if i is None:
        assert len(got) == len(expected)
        return
    logits, _ = Target(model).forward(mx.array(prompt + expected[:i]), Target(model).make_cache())
    top2 = mx.sort(logits[-1])[-2:]
    gap = float(top2[1] - top2[0])
    assert gap < 1e-4, f"token {i} differs ({got[i]} != {expected[i]}) with a top-2 gap of {gap}: not numerics"


def drain(engine, out, done, limit=2000):
    for _ in range(limit):
        if not engine.running():
            return
        for o in engine.step():
            out.setdefault(o.seq_id, []).extend(o.tokens)
            if o.finished:
                done[o.seq_id] = o
    raise AssertionError("did not finish")


def test_a_long_prompt_never_stalls_a_running_stream(llama):
    engine = BatchEngine(llama, NgramDrafter(), num_draft=2, prefill_step=16)
    engine.add("short", SHORT, 200)
    out, done = {}, {}
    while "short" not in out:
        for o in engine.step():
            out.setdefault(o.seq_id, []).extend(o.tokens)
    engine.add("long", LONG, 8)
    steps_prefilling = 0
    while engine.prefilling():
        got = {}
        for o in engine.step():
            got.setdefault(o.seq_id, []).extend(o.tokens)
            if o.finished:
                done[o.seq_id] = o
        steps_prefilling += 1
        if "short" not in done:
            assert got.get("short"), "the running stream got no token in a step of the long prompt's prefill"
        for sid, t in got.items():
            out.setdefault(sid, []).extend(t)
    assert steps_prefilling >= len(LONG) // 16  # the prompt went in chunks of at most 16, one per step
    drain(engine, out, done)
    assert_greedy_equal(llama, LONG, out["long"], alone(llama, LONG, 8))
    assert_greedy_equal(llama, SHORT, out["short"], alone(llama, SHORT, 200))


def test_prompt_chunks_ride_in_the_batch_pass(llama, monkeypatch):
    """While a long prompt is prefilled beside a decoding stream, every step is ONE forward pass of the target
    (the stream's tokens and the prompt's chunk together): the weights are read once, not once per chunk."""
    from mlx_engine.target_model.model import Target as T

    engine = BatchEngine(llama, NgramDrafter(), num_draft=2, prefill_step=16)
    engine.add("short", SHORT, 200)
    while not engine.step():
        pass
    passes = []
    for name in ("forward", "forward_batch"):
        real = getattr(T, name)
        monkeypatch.setattr(T, name, lambda self, *a, _r=real, _n=name, **k: passes.append(_n) or _r(self, *a, **k))
    engine.add("long", LONG, 4)
    steps = 0
    while engine.prefilling():
        passes.clear()
        outs = engine.step()
        steps += 1
        assert passes == ["forward_batch"], passes
        assert any(o.seq_id == "short" and o.tokens for o in outs)
    assert steps >= len(LONG) // 16


def test_short_prompts_are_prefilled_before_a_long_one(llama):
    engine = BatchEngine(llama, None, prefill_step=8)
    engine.add("long", LONG, 4)
    engine.step()
    engine.add("short", SHORT, 4)
    first = []
    while len(first) < 2:
        for o in engine.step():
            if o.tokens and o.seq_id not in first:
                first.append(o.seq_id)
    assert first == ["short", "long"]


def test_cancel_mid_prefill_frees_the_slot_and_keeps_what_was_fed(llama):
    engine = BatchEngine(llama, None, max_batch=1, prefill_step=16)
    engine.add("a", LONG, 8)
    for _ in range(5):
        assert engine.step() == []
    fed = engine.prefilling()[0]["done"]
    assert 0 < fed < len(LONG) and engine.free_slots() == 0
    engine.cancel("a")
    outs = engine.step()
    assert [(o.seq_id, o.tokens, o.finished) for o in outs] == [("a", [], "cancelled")]
    assert engine.free_slots() == 1 and engine.prefilling() == [] and engine.running() == 0
    # the same prompt again starts from the fed part
    engine.add("b", LONG, 8)
    out, done = {}, {}
    drain(engine, out, done)
    assert done["b"].stats["reused_prompt_tokens"] >= fed
    assert_greedy_equal(llama, LONG, out["b"], alone(llama, LONG, 8))


@pytest.mark.parametrize("drafter", ["ngram", "mtp"])
def test_prefix_tree_serves_the_next_turn_with_speculation_and_batching(drafter, tmp_path_factory):
    if drafter == "mtp":
        folder = make(tmp_path_factory, "deepseek_v3")
        model, config = load_hf(folder)
        d = load_mtp_drafter(model, folder, config)
    else:
        model, d = tiny_models.build("llama", seed=3)[0], NgramDrafter()
    engine = BatchEngine(model, d, num_draft=2, prefill_step=32)
    turn1 = LONG[:200]
    engine.add("t1", turn1, 16)
    engine.add("other", SHORT, 30)  # another client decoding beside
    out, done = {}, {}
    drain(engine, out, done)
    turn2 = turn1 + out["t1"] + [7, 8, 9]
    engine.add("t2", turn2, 16)
    engine.add("other2", SHORT + [1], 20)
    drain(engine, out, done)
    reused = done["t2"].stats["reused_prompt_tokens"]
    assert reused >= len(turn1) + len(out["t1"]) - 1
    assert_greedy_equal(model, turn2, out["t2"], alone(model, turn2, 16))
    assert engine.prefix_cache.status()["hits"] >= 1


@pytest.mark.cpu_exact  # the hit row beside another equals the request alone: rows' float arithmetic independent
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.9, top_p=0.95)],
                         ids=["greedy", "sampled"])
def test_a_prompt_the_tree_holds_whole_still_feeds_its_last_token(llama, sampling):
    """The prefix tree holds the whole prompt, its last token included (the same prompt again, or one ending
    inside an earlier answer), while the batch's rows hold another conversation: the row takes the first
    len(prompt) - 1 tokens from the tree and feeds the last for its first token; its output equals the
    request run cold, greedy and sampled with a seed."""
    engine = BatchEngine(llama, NgramDrafter(), num_draft=2)
    a = LONG[:40]
    out, done = {}, {}
    engine.add("a", a, 16)
    drain(engine, out, done)  # the tree now holds a + out["a"][:-1]
    for n, prompt in enumerate((a, a + out["a"][:10])):
        assert engine.prefix_cache.match(prompt) == len(prompt)
        engine.add(f"other{n}", SHORT + [n], 30)  # the batch's own rows hold another conversation
        engine.step()
        engine.add(n, prompt, 16, sampling=sampling, seed=7)
        drain(engine, out, done)
        assert done[n].stats["reused_prompt_tokens"] == len(prompt) - 1
        cold, cold_done = {}, {}
        fresh = BatchEngine(llama, NgramDrafter(), num_draft=2, prefix_cache_bytes=0)
        fresh.add(n, prompt, 16, sampling=sampling, seed=7)
        drain(fresh, cold, cold_done)
        assert out[n] == cold[n] and cold_done[n].stats["reused_prompt_tokens"] == 0


def test_the_same_long_prompt_twice_at_once_prefills_once(llama):
    engine = BatchEngine(llama, None, prefill_step=32)
    engine.add("a", LONG, 4)
    engine.add("b", LONG, 4)
    out, done = {}, {}
    drain(engine, out, done)
    reused = sorted(done[s].stats["reused_prompt_tokens"] for s in "ab")
    assert reused[0] == 0 and reused[1] == len(LONG) - 1
    assert out["a"] == out["b"]


def test_context_window_refused_at_add(llama):
    engine = BatchEngine(llama, None, context_length=305)
    with pytest.raises(ContextLengthError):
        engine.add("a", LONG, 6)
    assert engine.running() == 0
