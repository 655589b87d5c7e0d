"""The models agents run take the batch engine's whole path (issue 51): hybrid GatedDeltaNet targets (qwen3_next,
qwen3_5 dense and MoE) and sliding-window ones (gpt-oss, Gemma 4 with its KV-shared layers), each with a draft
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
from mlx_engine.target_model.batch_recurrent import BatchRecurrentCache
from test_batch_engine import alone, run

FAMILIES = tiny_models.AGENT_FAMILIES
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

    engine._prompt_turn = counting
    return fed


@pytest.mark.cpu_exact
@pytest.mark.parametrize("family", FAMILIES)
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
