"""Batch invariance across sequences (the batch engine, the server's continuous batching): after
make_batch_invariant, a pass of B sequences x L tokens over a BatchKVCache gives every (sequence, token)
row the bits of that sequence's single-token decode step, and BatchEngine(batch_invariant=True) emits,
for every request, the tokens Engine(batch_invariant=True) gives it alone, whatever runs beside it.

MLX's attention and quantized matmul are made row-mixing in these tests (a trace of the first row added
to every row): on this CPU they may happen to be row independent for small shapes, and the claim must
not rest on that."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.utils import quantize_model

import tiny_models
from mlx_engine import Engine, GenerationConfig
from mlx_engine.core.batch_engine import BatchEngine
from mlx_engine.drafters.ngram import NgramDrafter
from mlx_engine.target_model import cache as cache_ops
from mlx_engine.target_model.batch_cache import append_sequence
from mlx_engine.target_model.batch_invariant import make_batch_invariant, several_sequences_unsupported
from test_fixed_rows import row_mixing

PROMPTS = [[5, 9, 17, 33, 2, 41, 5, 9], [7, 7, 8, 9], [100, 3, 4, 100, 3, 4, 100, 3, 4, 100, 3]]
TOKENS = [[12, 250, 7, 8, 33, 1, 64], [64, 3, 5, 99, 12, 250, 9], [1, 2, 3, 4, 5, 6, 7]]
DIMS = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64)


def build(family: str, bits: int, **dims):
    model, cfg = tiny_models.build(family, seed=1, **(dims or DIMS))
    if bits:
        quantize_model(model, cfg, 64 if bits == 4 else 32, bits)
    return model


@pytest.fixture
def mixing(monkeypatch):
    """MLX's attention and quantized matmul made row-dependent for the test."""
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", row_mixing(mx.fast.scaled_dot_product_attention))
    monkeypatch.setattr(mx, "quantized_matmul", row_mixing(mx.quantized_matmul))


def singles(model, prompt, tokens):
    """Logits [len(tokens), V] of single-token passes over `tokens` after `prompt` (one sequence)."""
    cache = cache_ops.make_cache(model)
    model(mx.array(prompt)[None], cache=cache)
    return np.array(mx.concatenate([model(mx.array([[t]]), cache=cache)[0] for t in tokens]))


def batch_passes(model, prompts, tokens, sizes):
    """Logits [B, sum(sizes), V]: every prompt prefilled alone, its cache a row of a BatchKVCache, then
    passes of the given sizes over all sequences at once."""
    caches = []
    for p in prompts:
        cache = cache_ops.make_cache(model)
        model(mx.array(p)[None], cache=cache)
        caches = append_sequence(caches, cache)
    out, at = [], 0
    for n in sizes:
        out.append(model(mx.array([t[at : at + n] for t in tokens]), cache=caches))
        at += n
    return np.array(mx.concatenate(out, axis=1))


CASES = [("llama", 4), ("llama", 0), ("qwen3", 8), ("deepseek_v3", 4)]  # deepseek_v3: MLA, MoE, raw-weight gate


@pytest.mark.parametrize("family,bits", CASES)
def test_a_pass_of_several_sequences_gives_each_row_its_single_step_bits(family, bits, mixing):
    model = make_batch_invariant(build(family, bits, **(dict(DIMS, head_dim=16) if family == "qwen3" else DIMS)))
    got = batch_passes(model, PROMPTS, TOKENS, [1, 6])  # 3 x 1 rows, then 3 x 6 (18 > 16: two launches per linear)
    for b, (p, t) in enumerate(zip(PROMPTS, TOKENS)):
        assert np.array_equal(got[b], singles(model, p, t)), f"sequence {b}"


def test_the_stock_model_mixes_rows_here_so_the_test_can_fail(mixing):
    model = build("llama", 4)
    got = batch_passes(model, PROMPTS, TOKENS, [1, 6])
    assert not np.array_equal(got[1], singles(model, PROMPTS[1], TOKENS[1]))


def greedy_alone(model, prompt, n):
    cfg = GenerationConfig(max_tokens=n, num_draft=0)
    return [t for s in Engine(model, None, batch_invariant=True).generate(prompt, cfg) for t in s.tokens]


def served_together(engine, prompts, n, joins_at=2):
    """Every prompt through the batch engine; the last joins after `joins_at` steps. -> tokens per prompt."""
    got = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts[:-1]):
        engine.add(i, p, n)
    done, step = set(), 0
    while len(done) < len(prompts):
        if step == joins_at:
            engine.add(len(prompts) - 1, prompts[-1], n)
        for o in engine.step():
            got[o.seq_id] += o.tokens
            if o.finished:
                done.add(o.seq_id)
        step += 1
    return [got[i] for i in range(len(prompts))]


@pytest.mark.parametrize("family,bits", [("llama", 4), ("deepseek_v3", 4)])
def test_batch_engine_output_equals_each_request_alone(family, bits, mixing):
    model = build(family, bits)
    engine = BatchEngine(model, NgramDrafter(), num_draft=3, batch_invariant=True, prefix_cache_bytes=0)
    assert engine.batch_invariant and engine.supported is None
    together = served_together(engine, PROMPTS, 24)
    assert together == [greedy_alone(model, p, 24) for p in PROMPTS]
    assert any(k > 0 for k in engine.k_steps), "the test needs verify passes"


def test_batch_engine_caps_drafts_at_the_contract():
    engine = BatchEngine(build("llama", 4), NgramDrafter(), num_draft=20, batch_invariant=True, prefix_cache_bytes=0)
    served_together(engine, [[1, 2, 3, 4] * 6] * 2, 40, joins_at=0)
    assert max(engine.k_steps) == 15


def test_fixed_row_mode_is_refused_for_several_sequences():
    with pytest.raises(ValueError, match="one sequence"):
        BatchEngine(build("llama", 4), None, batch_invariant="fixed")


class _OtherMLA(nn.Module):
    """An attention of the shape batch_invariant runs one token at a time (embed_q / unembed_out)."""

    def __init__(self):
        super().__init__()
        self.embed_q, self.unembed_out = nn.Linear(4, 4), nn.Linear(4, 4)


def test_attention_run_one_token_at_a_time_keeps_the_batch_engine_off():
    model = build("llama", 4)
    model.model.layers[0].other = _OtherMLA()
    engine = BatchEngine(model, None, batch_invariant=True)
    assert "one sequence only" in several_sequences_unsupported(model) and "one sequence only" in engine.supported
    with pytest.raises(ValueError, match="cannot be batched"):
        engine.add(0, PROMPTS[0], 4)


KERNEL_DIMS = {  # head dims the kernel takes (multiples of 32)
    "llama": dict(DIMS, num_attention_heads=2, num_key_value_heads=1),
    "deepseek_v3": dict(DIMS, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, qk_rope_head_dim=32,
                        qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=None),  # MLA: the rope term too
}


@pytest.mark.parametrize("family", KERNEL_DIMS)
def test_through_the_emulated_attention_kernel(monkeypatch, mixing, family):
    """Head dims the kernel takes, its Metal body on the CPU emulator in the registry's place: one launch
    per layer over the batch cache, told each sequence's key count; rows equal single steps."""
    from metal_emu_util import emu_kernel, emulated
    from metal_kernels.emu import compiler_available

    from mlx_engine import kernels
    from mlx_engine.kernels import batch_attention as A

    if not compiler_available():
        pytest.skip("the Metal emulator needs g++")
    monkeypatch.setitem(kernels._resolved, "batch_attention", ("metal", emulated(emu_kernel(A), A.launch_spec)))
    calls = []
    real = kernels._resolved["batch_attention"][1]
    spy = lambda *a, **kw: calls.append(kw.get("lens")) or real(*a, **kw)  # noqa: E731
    monkeypatch.setitem(kernels._resolved, "batch_attention", ("metal", spy))
    model = make_batch_invariant(build(family, 0, **KERNEL_DIMS[family]))
    got = batch_passes(model, PROMPTS, TOKENS, [3])
    for b, (p, t) in enumerate(zip(PROMPTS, TOKENS)):
        assert np.array_equal(got[b], singles(model, p, t[:3])), f"sequence {b}"
    assert [len(p) + 3 for p in PROMPTS] in calls  # the batch pass: each sequence over its own keys
