"""A prompt token that crosses the decoder layers over several steps (target_model/layer_span.py): deep in a long
prompt one token's attention can outweigh a decoding step, so the batch engine lets it cross as many
layers per step as fit, its hidden state carried between steps. What it computes must be what one pass
over all layers computes: the same logits and the same cache entries, and the same tokens out."""

import mlx.core as mx
import numpy as np
import pytest

import tiny_models
from mlx_engine.core.batch_engine import BatchEngine
from mlx_engine.core.chunk_sizer import ChunkSizer
from mlx_engine.drafters.mtp import load_mtp_drafter
from mlx_engine.drafters.ngram import NgramDrafter
from mlx_engine.target_model import layer_span, sequence_attention
from mlx_engine.target_model.batch_cache import BatchKVCache
from mlx_engine.target_model.model import Target
from test_batch_prefill import SHORT, alone, assert_greedy_equal, drain
from test_mtp_helpers import load_hf, make

PROMPT = np.random.default_rng(11).integers(0, tiny_models.VOCAB, 40).tolist()


@pytest.fixture(autouse=True)
def prompts_play_deep_ones(monkeypatch):
    """The Starved sizer below plays a prompt deep enough that one token does not fit a step, with a prompt
    of 40 tokens: the batch engine's rule for short prompts (fed whole, core/batch_turn.py SMALL_PROMPT)
    is off here, as it is for any prompt longer than it."""
    from mlx_engine.core import batch_turn

    monkeypatch.setattr(batch_turn, "SMALL_PROMPT", 0)


@pytest.fixture(scope="module")
def deep():
    return tiny_models.build("llama", seed=4, num_hidden_layers=5)[0]


class Starved(ChunkSizer):
    """A budget that fits `share` of one token's pass whatever is measured (no budget: the largest)."""

    def __init__(self, share: float):
        super().__init__(first=1, largest=1)
        self.share = share

    def size(self, budget, base=0.0, depth=None):
        self.fits = self.share if budget is not None else float(self.largest)
        return 1


def batch_cache(target, prompts):
    """Per-layer BatchKVCache with each prompt's entries as a row (one single-sequence prefill each)."""
    caches = [BatchKVCache() for _ in target.layers]
    for p in prompts:
        single = target.make_cache()
        target.forward(mx.array(p), single)
        for bc, c in zip(caches, single):
            bc.add_row(c.keys[:, :, : c.offset], c.values[:, :, : c.offset], 64)
    return caches


def test_a_token_crossing_the_layers_in_three_passes_equals_one_pass(deep):
    target = Target(deep)
    sequence_attention.install(deep)
    layer_span.install(target.layers)
    prompts, step = [PROMPT[:7], PROMPT[:19]], mx.array([[3], [PROMPT[19]]])
    ref = batch_cache(target, prompts)
    ref_logits, _ = target.forward_batch(step, ref)
    split = batch_cache(target, prompts)
    carried = None
    for start, end in [(0, 2), (2, 3), (3, 5)]:
        span = layer_span.Span(row=1, start=start, end=end, tokens=1, carried=carried)
        with layer_span.crossing([span]):
            logits, _ = target.forward_batch(step, split)
        mx.eval(logits, span.captured)
        carried = span.captured
        for layer, bc in enumerate(split):
            bc.trim_row(1, 0 if start <= layer < end else 1)  # what it wrote outside its span
            if end < 5:
                bc.trim_row(0, 1)  # row 0 decodes the same token again in the next pass
    assert np.allclose(np.array(logits), np.array(ref_logits), atol=1e-5)
    for bc, rc in zip(split, ref):
        assert bc.lens == rc.lens == [8, 20]
        for a, b in zip(bc.row(1), rc.row(1)):
            assert np.allclose(np.array(a), np.array(b), atol=1e-5)


LATE = [7, 3, 99, 12, 250, 3, 7]


def crossing_run(model, drafter, prompt, share=0.3, n=12, stream=SHORT):
    """A stream decoding; `prompt` added and fed while the sizer fits `share` of a token per step, and
    another stream ("late") joining after it (its row after the crossing one). -> (outputs, finished, the
    layers each feeding step's chunk reached)."""
    engine = BatchEngine(model, drafter, num_draft=2 if drafter else 0, prefill_step=16)
    engine.prefills.sizer = Starved(share)
    engine.add("stream", stream, 400)
    out, done = {}, {}

    def step():
        for o in engine.step():
            out.setdefault(o.seq_id, []).extend(o.tokens)

    while "stream" not in out or engine.prefilling():
        step()
    engine.add("long", prompt, n)
    step()
    engine.add("late", LATE, 1000)
    reached = []
    while any(p["id"] == "long" and p["stage"] == "target" for p in engine.prefilling()):
        got = {}
        for o in engine.step():
            got[o.seq_id] = o.tokens
            if o.finished:
                done[o.seq_id] = o
        if "stream" not in done:
            assert got.get("stream"), "the running stream got no token in a step of the prompt's prefill"
        p = next((p for p in engine.prefills.joining.values() if p.seq.id == "long"), None)
        reached.append(p.layer if p is not None else 0)
        for sid, t in got.items():
            out.setdefault(sid, []).extend(t)
    drain(engine, out, done)
    return out, done, reached


def test_a_crossing_prompt_gives_the_tokens_of_one_decoded_alone(deep):
    out, _, reached = crossing_run(deep, NgramDrafter(), PROMPT)
    assert {1, 2, 3, 4} <= set(reached)  # 0.3 of a 5-layer pass: one layer per step
    assert_greedy_equal(deep, PROMPT, out["long"], alone(deep, PROMPT, 12))
    assert_greedy_equal(deep, SHORT, out["stream"], alone(deep, SHORT, 400))
    assert_greedy_equal(deep, LATE, out["late"], alone(deep, LATE, 1000))


def test_a_crossing_prompt_with_an_mtp_head(tmp_path_factory):
    folder = make(tmp_path_factory, "mimo")
    model, config = load_hf(folder)
    out, _, reached = crossing_run(model, load_mtp_drafter(model, folder, config), PROMPT, share=0.6)
    assert 1 in reached  # 2 layers, one per step
    assert_greedy_equal(model, PROMPT, out["long"], alone(model, PROMPT, 12))


def test_cancel_while_a_token_is_crossing_keeps_what_was_fed(deep):
    engine = BatchEngine(deep, None, prefill_step=16)
    engine.prefills.sizer = Starved(0.5)
    engine.add("stream", SHORT, 400)
    engine.step()
    engine.add("a", PROMPT, 8)
    for _ in range(400):
        engine.step()
        p = engine.prefills.feeding(next(s for s in engine.seqs if s.id == "a"))
        if p.done >= 20 and p.layer > 0:
            break
    assert p.done >= 20 and p.layer > 0  # a token is on its way across (0.5 of 5 layers: 2 per step)
    fed = p.done
    engine.cancel("a")
    engine.cancel("stream")
    engine.step()
    assert engine.running() == 0
    engine.add("b", PROMPT, 8)
    out, done = {}, {}
    drain(engine, out, done)
    assert done["b"].stats["reused_prompt_tokens"] == fed
    assert_greedy_equal(deep, PROMPT, out["b"], alone(deep, PROMPT, 8))


def test_the_sizer_turns_a_share_of_a_token_into_even_layer_steps():
    s = ChunkSizer(first=1, largest=512)
    s.observe(1, 0.27, True)  # a token at 0.2 s beside a 0.07 s decoding step
    assert s.size(0.15, 0.07) == 1
    assert s.fits == pytest.approx((0.85 * 0.15 - 0.07) / 0.2)  # 0.2875 of a token: 8.6 of 30 layers
    assert s.layers(1, 30, 30) == 8  # four steps of 8, 8, 7, 7 (not 8, 8, 8, 6)
    assert [s.layers(1, left, 30) for left in (22, 14, 7)] == [8, 7, 7]
    s.observe(8 / 30, 0.07 + 0.2 * 8 / 30, True)  # what crossing 8 of the 30 layers cost
    s.size(0.15, 0.07)
    assert s.layers(1, 30, 30) == 8
    s.observe(1 / 30, 0.07, True)  # one layer that cost nothing (noise): the next may only double it
    s.size(0.15, 0.07)
    assert s.fits == pytest.approx(2 / 30) and s.layers(1, 30, 30) == 2
    assert ChunkSizer().layers(1, 30, 30) == 30  # nothing measured: every layer
    assert ChunkSizer().layers(1, 5, 30) == 5


def test_a_measurement_at_one_depth_sizes_a_chunk_at_another():
    s = ChunkSizer(first=1, largest=512, reach=1000)
    s.observe(1, 0.09, True, depth=0)  # a shallow token: 0.02 s beside a 0.07 s step
    assert s.size(0.15, 0.07, depth=0) == 2  # (0.1275 - 0.07) / 0.02 = 2.9, at most doubling
    s.size(0.15, 0.07, depth=7000)  # a row that starts 7,000 positions deep: 8x the cost a token
    assert s.fits == pytest.approx(0.0575 / (0.02 * 8)) and s.layers(1, 30, 30) == 10  # 10.8 layers: 3 steps of 10


@pytest.mark.parametrize("share", [0.3, 0.6])
def test_a_crossing_prompt_hands_an_eagle3_head_the_features_of_one_pass(tmp_path_factory, share):
    """EAGLE-3 reads inner layers' outputs: a prompt crossing the layers over several steps keeps each
    requested layer's output in the pass that crosses it, and the features its head is begun on equal
    those of one pass over the prompt (a layer taken from the wrong pass would not); tokens unchanged."""
    from eagle3_writer import write_eagle3
    from mlx_engine.drafters.eagle3 import load_eagle3_drafter

    model, cfg = tiny_models.build("llama", seed=0, num_hidden_layers=6)
    folder = tmp_path_factory.mktemp("eagle3-span")
    write_eagle3(folder, cfg, aux_ids=[1, 3, 5])
    drafter = load_eagle3_drafter(folder, model)
    begun = []
    cls = type(drafter)
    spy = type("Spy", (cls,), {"begin": lambda self, tokens, hidden: (begun.append((list(tokens), hidden)),
                                                                        cls.begin(self, tokens, hidden))[1]})
    drafter.__class__ = spy
    out, _, reached = crossing_run(model, drafter, PROMPT, share=share)
    assert max(reached) > 0, "the prompt never crossed in steps: the test proves nothing"
    assert_greedy_equal(model, PROMPT, out["long"], alone(model, PROMPT, 12))
    tokens, hidden = next((t, h) for t, h in begun if t[: len(PROMPT)] == PROMPT)
    target = Target(model)
    _, ref = target.forward(mx.array(PROMPT), target.make_cache(), drafter.hidden_request)
    assert hidden.shape == ref.shape
    assert np.allclose(np.array(hidden), np.array(ref), atol=1e-4)
