"""Drafting over a reduced vocabulary (drafters/vocab_subset.py): exact logits on the subset, and still
lossless: greedy output equals plain decoding, sampled output follows the target's distribution."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

import tiny_models
from mlx_engine import DraftModelDrafter, Engine, GenerationConfig, SamplingConfig
from mlx_engine.drafters.vocab_subset import SubsetOutput, load_vocab_subset
from mlx_engine.target_model.model import Target
from test_distribution import CONFIGS, N_SAMPLES, chi_square_p_value, exact_joint
from test_distribution import PROMPT as DIST_PROMPT
from test_distribution import VOCAB as DIST_VOCAB
from test_greedy_equality import PROMPT, noisy_copy, plain, target


def subset_ids(n: int, seed: int = 0) -> mx.array:
    """Half the vocabulary, in a shuffled order (the loader keeps any order)."""
    return mx.array(np.random.default_rng(seed).permutation(n)[: n // 2], dtype=mx.int32)


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # an own lm_head, and a tied embedding
def test_subset_logits_are_the_full_logits_on_the_subset(family):
    model = target(family)
    t = Target(model)
    ids = subset_ids(tiny_models.VOCAB)
    logits, h = t.forward(mx.array(PROMPT), t.make_cache(), True)
    got = SubsetOutput(t, ids, tiny_models.VOCAB)(h)
    off = np.ones(tiny_models.VOCAB, bool)
    off[np.array(ids)] = False
    assert mx.allclose(got[:, ids], logits[:, ids], atol=1e-5)
    assert np.all(np.isneginf(np.array(got)[:, off]))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_a_draft_vocab_subset_equals_plain(family, k):
    ids = subset_ids(tiny_models.VOCAB, seed=k)
    engine = Engine(target(family), DraftModelDrafter(noisy_copy(family), tiny_models.VOCAB, vocab_subset=ids))
    steps = list(engine.generate(PROMPT, GenerationConfig(max_tokens=64, num_draft=k)))
    assert [t for s in steps for t in s.tokens] == plain(family)
    drafted = [t for s in steps for t in s.draft]
    assert drafted and set(drafted) <= set(ids.tolist())  # only subset tokens are ever drafted
    assert engine.stats.accepted > 0


def test_sampling_with_a_draft_vocab_subset_follows_the_target():
    cfg = CONFIGS["temperature 1"]
    model = tiny_models.build("llama", seed=1, vocab=DIST_VOCAB, num_hidden_layers=1)[0]
    draft = tiny_models.build("llama", seed=2, vocab=DIST_VOCAB, num_hidden_layers=1)[0]
    ids = mx.array([0, 2, 3, 5], dtype=mx.int32)
    engine = Engine(model, DraftModelDrafter(draft, DIST_VOCAB, vocab_subset=ids))
    counts = np.zeros((DIST_VOCAB, DIST_VOCAB))
    drafted, accepted = set(), 0
    for seed in range(N_SAMPLES):
        gen = GenerationConfig(max_tokens=4, num_draft=2, sampling=cfg, seed=seed)
        steps = list(itertools.islice(engine.generate(DIST_PROMPT, gen), 2))  # the first token, then one k=2 cycle
        tokens = [t for step in steps for t in step.tokens]
        counts[tokens[0], tokens[1]] += 1
        drafted.update(steps[1].draft)
        accepted += steps[1].n_accepted > 0
    assert drafted <= {0, 2, 3, 5} and 0 < accepted < N_SAMPLES
    expected = exact_joint(model, cfg) * N_SAMPLES
    assert counts[:, [1, 4]].sum() > 0  # tokens outside the subset are still emitted (by the target)
    assert chi_square_p_value(counts.ravel(), expected.ravel()) > 1e-3


def test_load_vocab_subset_checks_the_file(tmp_path):
    good = tmp_path / "head.safetensors"
    mx.save_safetensors(str(good), {"vocab_subset": mx.array([3, 1, 2], dtype=mx.int32)})
    assert load_vocab_subset(good, 10).tolist() == [3, 1, 2]
    with pytest.raises(ValueError, match="outside"):
        load_vocab_subset(good, 3)
    none = tmp_path / "other.safetensors"
    mx.save_safetensors(str(none), {"x": mx.zeros((2,))})
    with pytest.raises(ValueError, match="no 'vocab_subset'"):
        load_vocab_subset(none, 10)
    with pytest.raises(FileNotFoundError):
        load_vocab_subset(tmp_path / "missing.safetensors", 10)
    junk = tmp_path / "junk.safetensors"
    junk.write_text("not a tensor file")
    with pytest.raises(ValueError, match="cannot read"):
        load_vocab_subset(junk, 10)
