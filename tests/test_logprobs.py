"""Logprobs: the target's log-probability of each emitted token, from the pass that verified it, never the
drafter's; the same with speculation on and off.

Definition: log-softmax of the target's logits as the model outputs them at that position (float32, before
the logit bias, the penalties, the temperature, the filters and a grammar's mask). The reference is computed
from the model directly: one mlx-lm forward over prompt + emitted tokens, log-softmax in float64.

Equality is np.allclose at atol 1e-5, not bit equality: a verify pass scores k + 1 rows in one matmul and a
plain step one, and a reduction over a different shape may round differently in the last bits (on this CPU
the fp32 rows come out equal in practice, on a GPU they need not; the reference's one pass over the whole
sequence differs from both by ~1e-7). At temperature > 0 plain and speculative decoding draw different tokens
(their random streams differ), so there both are compared with the reference at every position.
"""

import functools

import mlx.core as mx
import numpy as np
import pytest

import tiny_models
from mlx_engine import DraftModelDrafter, Engine, GenerationConfig, NgramDrafter, SamplingConfig, TokenLogprob, host
from mlx_engine.core.batch_engine import BatchEngine
from test_greedy_equality import noisy_copy
from tree_util import RandomTreeDrafter

PROMPT = [3, 17, 42, 9, 200, 11, 5, 77, 3, 17, 42, 9, 128, 64, 31, 2, 3, 17, 42]
N = 32
ATOL = 1e-5
KINDS = ["none", "self", "noisy", "ngram", "tree"]


@functools.cache
def llama():
    return tiny_models.build("llama", seed=1)[0]


def drafter(kind: str):
    model = llama()
    return {"none": lambda: None,
            "self": lambda: DraftModelDrafter(model, tiny_models.VOCAB),
            "noisy": lambda: DraftModelDrafter(noisy_copy("llama", 0.01), tiny_models.VOCAB),
            "ngram": lambda: NgramDrafter(min_ngram=1),
            "tree": lambda: RandomTreeDrafter(model, tiny_models.VOCAB, seed=3)}[kind]()


def reference(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """[len(tokens), V]: log-softmax (float64) of the model's logits at the position of each token."""
    logits = model(mx.array(prompt + tokens[:-1])[None])[0, len(prompt) - 1 :].astype(mx.float32)
    x = np.array(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def generate(kind: str, n_top, sampling=SamplingConfig(), k=4, seed=0, max_tokens=N, prompt=PROMPT):
    engine = Engine(llama(), drafter(kind))
    cfg = GenerationConfig(max_tokens=max_tokens, num_draft=k, sampling=sampling, seed=seed, logprobs=n_top)
    tokens, logprobs = [], []
    for step in engine.generate(prompt, cfg):
        assert step.logprobs is not None and len(step.logprobs) == len(step.tokens)
        tokens += step.tokens
        logprobs += step.logprobs
    return tokens, logprobs, engine


def check_against_reference(tokens, logprobs, n_top, prompt=PROMPT):
    """Each entry: its token, the reference's logprob of it, the reference's top n sorted (ids and values)."""
    ref = reference(llama(), prompt, tokens)
    assert [lp.token for lp in logprobs] == tokens
    assert all(isinstance(lp, TokenLogprob) for lp in logprobs)
    got = np.array([lp.logprob for lp in logprobs])
    np.testing.assert_allclose(got, ref[np.arange(len(tokens)), tokens], atol=ATOL)
    for i, lp in enumerate(logprobs):
        assert len(lp.top) == n_top
        if not n_top:
            continue
        ids, values = [t for t, _ in lp.top], np.array([v for _, v in lp.top])
        assert (np.diff(values) <= 0).all(), f"position {i}: top not sorted"
        order = np.argsort(-ref[i], kind="stable")[:n_top]
        assert ids == order.tolist(), f"position {i}"
        np.testing.assert_allclose(values, ref[i, ids], atol=ATOL)
        if lp.token in ids:  # the chosen token's entry in the top equals its own logprob
            assert lp.logprob == lp.top[ids.index(lp.token)][1]


@pytest.mark.parametrize("n_top", [0, 5])
def test_greedy_logprobs_equal_with_speculation_on_and_off(n_top):
    plain_tokens, plain, _ = generate("none", n_top)
    check_against_reference(plain_tokens, plain, n_top)
    for kind in KINDS[1:]:
        tokens, logprobs, engine = generate(kind, n_top, k=8 if kind == "tree" else 4)
        assert tokens == plain_tokens, kind
        assert engine.stats.accepted > 0, kind
        if kind == "tree":
            assert engine.trees.off is None and engine.drafter.trees
        np.testing.assert_allclose([lp.logprob for lp in logprobs], [lp.logprob for lp in plain], atol=ATOL,
                                   err_msg=kind)
        for a, b in zip(logprobs, plain):
            assert [t for t, _ in a.top] == [t for t, _ in b.top], kind
            np.testing.assert_allclose([v for _, v in a.top], [v for _, v in b.top], atol=ATOL)
        check_against_reference(tokens, logprobs, n_top)


# the logprobs are the model's own: the temperature, the filters and the penalties change the tokens drawn,
# not the logprobs reported for them
SAMPLED = SamplingConfig(temperature=0.6, top_k=40, frequency_penalty=-0.5, logit_bias={17: 2.0})


# trees take no count penalties (they would fall back to chains): the bias alone
SAMPLED_TREE = SamplingConfig(temperature=0.7, top_k=3, logit_bias={5: 1.0})


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_logprobs_are_the_targets_at_every_position(kind):
    for seed in (1, 2):
        tokens, logprobs, engine = generate(kind, 3, SAMPLED_TREE if kind == "tree" else SAMPLED,
                                            k=8 if kind == "tree" else 4, seed=seed)
        check_against_reference(tokens, logprobs, 3)
        if kind != "none":
            assert engine.stats.accepted > 0
        if kind == "tree":
            assert engine.drafter.trees


def test_top_n_is_capped_by_the_vocabulary_and_validated():
    small = tiny_models.build("llama", seed=1, vocab=6, num_hidden_layers=1)[0]
    engine = Engine(small, NgramDrafter(min_ngram=1))
    steps = list(engine.generate([1, 4, 2, 5, 3], GenerationConfig(max_tokens=8, num_draft=2, logprobs=20)))
    assert all(len(lp.top) == 6 for s in steps for lp in s.logprobs)
    for bad in (21, -1, True, 1.5, "3"):
        with pytest.raises(ValueError, match="logprobs"):
            GenerationConfig(logprobs=bad)
        with pytest.raises(ValueError, match="logprobs"):
            BatchEngine(llama()).add(0, PROMPT, 4, logprobs=bad)


def test_off_costs_nothing(monkeypatch):
    """logprobs=None: no logprob row is built anywhere and every Step / Output says None."""
    import mlx_engine.core.batch_accept as be
    import mlx_engine.core.engine as eng
    import mlx_engine.core.tree_verify as tv

    def boom(*args):
        raise AssertionError("logprob rows built with logprobs off")

    for mod in (eng, be, tv):
        monkeypatch.setattr(mod, "logprob_rows", boom)
    for kind in KINDS:
        steps = list(Engine(llama(), drafter(kind)).generate(PROMPT, GenerationConfig(max_tokens=12, num_draft=4)))
        assert all(s.logprobs is None for s in steps)
    engine = BatchEngine(llama(), NgramDrafter(min_ngram=1), num_draft=2)
    engine.add(0, PROMPT, 8)
    while engine.running():
        assert all(o.logprobs is None for o in engine.step())


@pytest.mark.parametrize("temp", [0.0, 1.0])
@pytest.mark.parametrize("kind", ["none", "self", "ngram", "tree"])
def test_one_host_read_per_cycle_with_logprobs_and_penalties(kind, temp):
    """One read per cycle, logprobs and penalties on; and the same tokens, reads and waits as with logprobs off
    (a tree compaction that moves kept rows waits once, test_tree.py: as many with them as without)."""
    sampling = SamplingConfig(temperature=temp, presence_penalty=0.3, frequency_penalty=0.2, logit_bias={5: 1.0})
    if kind == "tree":  # trees take no count penalties (they fall back to chains): the bias alone
        sampling = SamplingConfig(temperature=temp, logit_bias={5: 1.0})
    seen = []
    for n_top in (None, 4):
        engine = Engine(llama(), drafter(kind))
        gen = engine.generate(PROMPT, GenerationConfig(max_tokens=40, num_draft=3, sampling=sampling, logprobs=n_top))
        tokens = next(gen).tokens
        before = dict(host.counts)
        for step in gen:
            tokens += step.tokens
        cycles = engine.stats.cycles
        assert cycles > 0 and host.counts["read"] - before["read"] == cycles
        seen.append((tokens, cycles, host.counts["wait"] - before["wait"]))
    assert seen[0] == seen[1]


# ------------------------------------------------------------------------------------------ the batch engine

BATCH_PROMPTS = [PROMPT, [5, 6, 7, 8, 5, 6, 7, 8, 5], [100, 101, 3, 17, 42, 9, 200], [9, 9, 9, 9, 9, 9]]
BATCH_TOP = [3, None, 0, 20]  # each row its own setting, one without


def run_batch(kind: str, sampling: SamplingConfig, max_tokens=20, reads=None):
    d = {"none": None, "self": DraftModelDrafter(llama(), tiny_models.VOCAB),
         "ngram": NgramDrafter(min_ngram=1)}[kind]
    engine = BatchEngine(llama(), d, num_draft=3 if d is not None else 0)
    for i, (p, n) in enumerate(zip(BATCH_PROMPTS, BATCH_TOP)):
        engine.add(i, p, max_tokens, sampling=sampling, seed=i, logprobs=n)
    tokens, logprobs = {i: [] for i in range(4)}, {i: [] for i in range(4)}
    while engine.running():
        before = host.counts["read"]
        for o in engine.step():
            tokens[o.seq_id] += o.tokens
            if BATCH_TOP[o.seq_id] is None:
                assert o.logprobs is None
            else:
                assert len(o.logprobs) == len(o.tokens)
                logprobs[o.seq_id] += o.logprobs
        if reads is not None:
            reads.append(host.counts["read"] - before)
    return tokens, logprobs, engine


@pytest.mark.parametrize("temp", [0.0, 0.9])
@pytest.mark.parametrize("kind", ["none", "self", "ngram"])
def test_batch_engine_logprobs(kind, temp):
    """Four rows, each with its own logprobs setting: each equals the reference; greedy, each equals the
    request decoded alone by Engine without speculation; one host read per step."""
    sampling = SamplingConfig(temperature=temp, frequency_penalty=0.4)
    reads = []
    tokens, logprobs, engine = run_batch(kind, sampling, reads=reads)
    assert max(reads) == 1
    if kind != "none":
        assert engine.k_steps.keys() - {0}
    for i, (p, n) in enumerate(zip(BATCH_PROMPTS, BATCH_TOP)):
        if n is None:
            continue
        check_against_reference(tokens[i], logprobs[i], n, prompt=p)
        if temp == 0.0:
            alone, lps, _ = generate("none", n, sampling, max_tokens=20, prompt=p)
            assert tokens[i] == alone
            np.testing.assert_allclose([lp.logprob for lp in logprobs[i]], [lp.logprob for lp in lps], atol=ATOL)


def test_distributed_engine_refuses_logprobs_and_count_penalties():
    from mlx_engine.distributed.engine import DistributedEngine
    from mlx_engine.distributed.group import DistributedError

    engine = DistributedEngine(llama(), None, group=mx.distributed.init())
    for cfg in (GenerationConfig(logprobs=0), GenerationConfig(sampling=SamplingConfig(frequency_penalty=0.5))):
        with pytest.raises(DistributedError, match="logprobs"):
            engine.generate(PROMPT, cfg)
