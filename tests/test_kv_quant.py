"""A quantized KV cache (kv_bits): speculative output equals plain output with the same cache, in both
engines, whatever the prompt's chunking (a quantized cache decodes batch invariant by default: a float-level
difference between a verify pass's rows and a decode step's would flip quantization codes); rollback is
exact; the memory it saves; combinations it cannot serve are refused by name."""

import functools

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import QuantizedKVCache

import tiny_models
from mlx_engine import DraftModelDrafter, Engine, GenerationConfig, NgramDrafter
from mlx_engine.core.batch_engine import BatchEngine
from mlx_engine.target_model import cache as cache_ops
from mlx_engine.target_model.model import Target
from test_greedy_equality import PROMPT

WIDE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)  # head dim 32
N = 40


@functools.cache
def model(family="llama", noise=0.0):
    m = tiny_models.build(family, seed=1, **WIDE, **({"head_dim": 32} if family == "qwen3" else {}))[0]
    if noise:  # a draft: each weight moved by noise x its tensor's spread (agrees often, not always)
        mx.random.seed(7)
        m.update(tree_map(lambda w: w + noise * w.std() * mx.random.normal(w.shape), m.parameters()))
        mx.eval(m.parameters())
    return m


def tokens_of(engine, prompt, k, n=N):
    return [t for s in engine.generate(prompt, GenerationConfig(max_tokens=n, num_draft=k)) for t in s.tokens]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("bits", [4, 8])
def test_speculative_equals_plain_with_the_same_quantized_cache(family, bits):
    plain = tokens_of(Engine(model(family), kv_bits=bits, kv_group_size=32), PROMPT, 0)
    draft = DraftModelDrafter(model(family, noise=0.1), tiny_models.VOCAB)
    engine = Engine(model(family), draft, kv_bits=bits, kv_group_size=32)
    assert tokens_of(engine, PROMPT, 3) == plain
    if family == "llama":  # (the tiny qwen3 repeats one token here: every draft is accepted)
        assert 0 < engine.stats.accepted < engine.stats.drafted  # partial accepts: rollbacks happened
    assert tokens_of(Engine(model(family), NgramDrafter(), kv_bits=bits, kv_group_size=32), PROMPT, 4) == plain
    assert isinstance(engine.cache[0], QuantizedKVCache) and engine.cache[0].bits == bits


def test_rollback_then_refeed_rewrites_the_same_entries():
    """A token's quantized entries do not depend on its neighbours: trimming drafts and feeding the same
    tokens again gives the same bits, so a rolled-back cache equals one that never saw the drafts."""
    t = Target(model(), kv_bits=4, kv_group_size=32)
    a, b = t.make_cache(), t.make_cache()
    t.forward(mx.array(PROMPT), a)
    t.forward(mx.array(PROMPT), b)
    ckpt = cache_ops.checkpoint(a, 4)
    t.forward(mx.array([7, 8, 9, 10]), a)
    assert cache_ops.rollback(a, ckpt, 2) == 0  # trimmed by offset, nothing to replay
    t.forward(mx.array([11]), a)
    t.forward(mx.array([7, 8, 11]), b)
    for ca, cb in zip(a, b):
        assert ca.offset == cb.offset == len(PROMPT) + 3
        for (_, x), (_, y) in zip(tree_flatten(ca.keys_and_values()), tree_flatten(cb.keys_and_values())):
            assert mx.array_equal(x, y)


def test_batch_engine_rows_equal_the_engine_alone_with_the_same_cache():
    prompts = {0: PROMPT, 1: PROMPT[3:] + [4, 4, 4], 2: [9, 8, 7, 6, 5, 4, 3, 2, 1] * 3}
    engine = BatchEngine(model(), NgramDrafter(), num_draft=3, kv_bits=4, kv_group_size=32)
    out, done = {i: [] for i in prompts}, set()
    engine.add(0, prompts[0], 24)
    engine.add(1, prompts[1], 24)
    steps = 0
    while len(done) < 3:
        if steps == 3:
            engine.add(2, prompts[2], 24)  # joins a running batch
        for o in engine.step():
            out[o.seq_id] += o.tokens
            if o.finished:
                done.add(o.seq_id)
        steps += 1
    for i, p in prompts.items():
        assert out[i] == tokens_of(Engine(model(), kv_bits=4, kv_group_size=32), p, 0, 24), i
    assert type(engine.prefix_cache.root.children[PROMPT[0]].layers[0][0]) is tuple  # the tree keeps quantized parts


def test_kv_memory_of_a_4_bit_cache():
    """Per 32 values: 16 bytes of data + a scale and a bias (the model's fp32) = 24 bytes against 128."""
    sizes = {}
    for bits in (None, 4):
        t = Target(model(), kv_bits=bits, kv_group_size=32)
        cache = t.make_cache()
        t.forward(mx.array(list(range(256))), cache)
        sizes[bits] = cache_ops.kv_bytes(cache)
    assert sizes[4] / sizes[None] == pytest.approx(24 / 128)


def test_refused_by_name():
    with pytest.raises(ValueError, match="bits must be one of"):
        Engine(model(), kv_bits=7)
    with pytest.raises(ValueError, match="group size must be one of"):
        Engine(model(), kv_bits=4, kv_group_size=48)
    with pytest.raises(ValueError, match="cannot be quantized to 4 bits in groups of 64"):
        Engine(tiny_models.build("llama")[0], kv_bits=4)  # head dimension 12
    with pytest.raises(ValueError, match="fixed-row passes do not cover a quantized KV cache"):
        Engine(model(), kv_bits=4, kv_group_size=32, batch_invariant="fixed")
    with pytest.raises(ValueError, match="fixed-row passes do not cover a quantized KV cache"):
        BatchEngine(model(), kv_bits=4, kv_group_size=32, batch_invariant="fixed")


def test_a_quantized_cache_decodes_batch_invariant_by_default_and_stock_on_request():
    assert Engine(model(), kv_bits=4, kv_group_size=32).batch_invariant
    assert BatchEngine(model(), kv_bits=4, kv_group_size=32).batch_invariant
    fresh = tiny_models.build("llama", seed=1, **WIDE)[0]  # (a patched model stays patched)
    assert not Engine(fresh, kv_bits=4, kv_group_size=32, batch_invariant=False).batch_invariant


def test_drafter_caches_quantized_on_their_own():
    """The drafter's KV cache type is its own choice: a 4-bit draft cache under a full-precision target
    (and the reverse) changes acceptance at most, never the output."""
    from mlx_engine.drafters.base import quantize_kv

    plain = tokens_of(Engine(model()), PROMPT, 0)
    draft = DraftModelDrafter(model(noise=0.1), tiny_models.VOCAB)
    assert quantize_kv(draft, 4, 32) is None
    engine = Engine(model(), draft)
    assert tokens_of(engine, PROMPT, 3) == plain and engine.stats.accepted > 0
    assert isinstance(draft.cache[0], QuantizedKVCache) and draft.cache[0].bits == 4
    assert "keeps no quantizable KV cache" in quantize_kv(NgramDrafter(), 4, 32)


@pytest.mark.slow
def test_embedded_model_mtp_head_with_both_caches_quantized():
    """The embedded SmolLM2 and its trained MTP head (head dim 64): target and head caches 4-bit, output
    equal to plain decoding with the same target cache."""
    from mlx_engine.drafters.base import quantize_kv
    from mlx_engine.drafters.registry import DrafterOptions, make_drafter
    from mlx_engine.models import load

    m = load(None)
    prompt = m.tokenizer.apply_chat_template([{"role": "user", "content": "List three colours."}],
                                             add_generation_prompt=True)
    plain = tokens_of(Engine(m.model, kv_bits=4), prompt, 0, 24)
    drafter = make_drafter("mtp", m, DrafterOptions())
    assert quantize_kv(drafter, 4, 64) is None
    engine = Engine(m.model, drafter, kv_bits=4)
    assert tokens_of(engine, prompt, 2, 24) == plain and engine.stats.accepted > 0


def test_verify_rows_equal_decode_steps_over_a_quantized_cache_where_stock_attention_mixes_rows(monkeypatch):
    """mlx-lm's quantized attention made row-dependent (its quantized matmul mixing rows, as a device's may):
    in the batch-invariant mode a 5-token pass over a 4-bit cache still gives each row the logits and the
    cache entries of the single-token decode step, bit for bit (each row runs the decode step's call)."""
    from mlx_engine.target_model.batch_invariant import make_batch_invariant
    from test_fixed_rows import row_mixing

    monkeypatch.setattr(mx, "quantized_matmul", row_mixing(mx.quantized_matmul))
    target = Target(make_batch_invariant(tiny_models.build("llama", seed=1, **WIDE)[0]), kv_bits=4, kv_group_size=32)
    prompt, tokens = PROMPT[:12], [5, 77, 5, 200, 31]
    one, single = target.make_cache(), target.make_cache()
    for cache in (one, single):
        target.forward(mx.array(prompt), cache)
    together = target.forward(mx.array(tokens), one)[0]
    alone = mx.concatenate([target.forward(mx.array([t]), single)[0] for t in tokens])
    assert mx.array_equal(together, alone)
    for a, b in zip(tree_flatten([c.state for c in one]), tree_flatten([c.state for c in single])):
        assert mx.array_equal(a[1], b[1])
