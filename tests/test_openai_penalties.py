"""OpenAI's presence_penalty, frequency_penalty and logit_bias under speculation: lossless as the repetition
penalty is (tests/test_penalty_equality.py).

Definitions (vLLM's semantics; tests/sampling_reference.py writes them in numpy): logit[t] += logit_bias[t];
logit[t] -= presence * (count[t] > 0) + frequency * count[t], count[t] the occurrences of t among the tokens
generated so far (the prompt excluded). A verify pass's row i counts the generated tokens and drafts 1..i,
as plain decoding counts them at that position.
- the sampler chain equals the definitions, row by row, each row with its own counts;
- greedy: speculative output equals plain greedy output, the reference being mlx-lm's own generate_step
  with a logits processor written from the definitions (numpy), for an oracle drafter (every draft
  accepted: deep rows, where a row counted without the drafts before it picks another token), a draft
  model, a noisy copy, prompt lookup, MTP, a token-tree drafter (which falls back to a chain under the
  penalties and keeps trees under a logit bias alone), and the batch engine (four rows);
- temperature > 0: every emitted position follows the reference distribution
  (test_distribution_positions.py's machinery);
- validation: ranges, ids against the vocabulary where it is known.
"""

import functools
import zlib

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import tiny_models
from device import as_engine_decodes
from mlx_engine import Draft, DraftModelDrafter, Engine, GenerationConfig, NgramDrafter, SamplingConfig
from mlx_engine.core.batch_engine import BatchEngine
from mlx_engine.drafters.suffix import SuffixDrafter
from mlx_engine.drafters.suffix_cache import SuffixCache
from mlx_engine.sampling import probabilities, process_logits, row_counts, token_counts
from sampling_reference import distribution_of, process_of
from test_distribution_positions import assert_every_position_follows_target, make_drafter, small_target
from test_greedy_equality import noisy_copy

PROMPT = [3, 17, 42, 9, 200, 11, 5, 77, 3, 17, 42, 9, 128, 64, 31, 2, 3, 17, 42]
N = 40
CASES = {
    "presence": SamplingConfig(presence_penalty=2.0),
    "frequency": SamplingConfig(frequency_penalty=1.5),
    "logit_bias": SamplingConfig(logit_bias={62: -100, 17: 4.0, 5: 2.5}),
    "all": SamplingConfig(presence_penalty=-0.5, frequency_penalty=1.0, logit_bias={174: 3.0},
                          repetition_penalty=1.3),
}
# prompt lookup drafts only where the output repeats a token: milder settings that still change the output
LOOKUP_CASES = {
    "presence": SamplingConfig(presence_penalty=-0.3),
    "frequency": SamplingConfig(frequency_penalty=0.3),
    "logit_bias": CASES["logit_bias"],
    "all": SamplingConfig(presence_penalty=-1.0, frequency_penalty=0.5, logit_bias={174: 1.0}),
}


@functools.cache
def llama():
    return tiny_models.build("llama", seed=1)[0]


# ------------------------------------------------------------------------------------------ the sampler chain


CHAIN_CONFIGS = [
    SamplingConfig(temperature=1.0, presence_penalty=1.5),
    SamplingConfig(temperature=0.7, frequency_penalty=0.8, top_k=4),
    SamplingConfig(temperature=1.0, presence_penalty=-1.0, frequency_penalty=2.0, top_p=0.9),
    SamplingConfig(temperature=1.2, logit_bias={0: 5.0, 3: -100.0, 7: 1.5}),
    SamplingConfig(temperature=0.9, logit_bias={1: 2.0}, presence_penalty=0.5, frequency_penalty=-0.5,
                   repetition_penalty=1.4, repetition_context=4, min_p=0.05),
]


@pytest.mark.parametrize("cfg", CHAIN_CONFIGS, ids=repr)
def test_sampler_chain_equals_the_definitions(cfg):
    """Rows of a verify pass: row i counts the generated tokens and drafts 1..i; the repetition penalty's
    history is the prompt too."""
    rng = np.random.default_rng(zlib.crc32(repr(cfg).encode()))
    for _ in range(15):
        V, n = int(rng.integers(8, 40)), int(rng.integers(1, 6))
        P, G = int(rng.integers(1, 10)), int(rng.integers(0, 25))
        logits = (rng.standard_normal((n, V)) * 3).astype(np.float32)
        prompt, generated = rng.integers(0, V, P), rng.integers(0, V, G)
        drafts = rng.integers(0, V, n - 1)
        context = np.concatenate([prompt, generated, drafts])
        counts = {int(t): int(c) for t, c in zip(*np.unique(generated, return_counts=True))}
        got_counts = row_counts(token_counts(counts, V), mx.array(drafts.astype(np.int32)))
        got = process_logits(mx.array(logits), mx.array(context), cfg, got_counts)
        probs = np.array(probabilities(got, cfg))
        for i in range(n):
            gen = list(generated) + list(drafts[:i])
            np.testing.assert_allclose(np.array(got[i]), process_of(cfg, logits[i], context[: P + G + i], gen),
                                       rtol=1e-5, atol=1e-4, err_msg=f"row {i}")
            want = distribution_of(cfg, logits[i], context[: P + G + i], gen)
            # the same tokens kept by the filters (a -100 bias may underflow float32 to an exact 0: not a filter)
            assert (probs[i][want == 0] == 0).all() and (probs[i][want > 1e-30] > 0).all(), f"row {i}"
            np.testing.assert_allclose(probs[i], want, rtol=1e-4, atol=1e-6, err_msg=f"row {i}")


def test_the_reference_is_the_definitions():
    logits = np.array([1.0, 2.0, -1.0, 0.5])
    got = process_of(SamplingConfig(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={3: 1.0}),
                     logits, history=[0, 0, 0, 2], generated=[2, 2, 1])
    # token 0 is only in the prompt (not counted); 1 once; 2 twice; 3 biased
    np.testing.assert_allclose(got, [1.0, 2.0 - 0.5 - 0.25, -1.0 - 0.5 - 0.5, 1.5])


# ------------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize("bad", [
    dict(presence_penalty=2.5), dict(frequency_penalty=-2.01), dict(presence_penalty=float("nan")),
    dict(logit_bias={5: 100.5}), dict(logit_bias={5: float("inf")}), dict(logit_bias={-1: 1.0}),
    dict(logit_bias={"x": 1.0}), dict(logit_bias={True: 1.0}), dict(logit_bias={5: "1"}),
    dict(logit_bias=[(5, 1.0), (5, 2.0)]),
])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingConfig(**bad)


def test_logit_bias_forms_and_vocabulary():
    a = SamplingConfig(logit_bias={"7": -100, 3: 2})
    assert a.logit_bias == ((3, 2.0), (7, -100.0)) and a == SamplingConfig(logit_bias=[(7, -100.0), (3, 2.0)])
    hash(a)  # the adaptive policy keys what it learns by the sampling config
    with pytest.raises(ValueError, match="outside the vocabulary"):
        next(Engine(llama()).generate(PROMPT, GenerationConfig(sampling=SamplingConfig(logit_bias={256: 1.0}))))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        BatchEngine(llama()).add(0, PROMPT, 4, sampling=SamplingConfig(logit_bias={1000: 1.0}))
    assert SamplingConfig(presence_penalty=2, frequency_penalty=-2).counted
    assert not SamplingConfig(logit_bias={1: 1.0}).counted


# ------------------------------------------------------------------------------------------ greedy equality


def reference(model, prompt, cfg: SamplingConfig, n=N) -> list[int]:
    """mlx-lm's plain greedy decoding with a logits processor written from the definitions (numpy)."""
    as_engine_decodes(model)

    def processor(tokens, logits):
        seen = np.array(tokens).tolist()
        x = process_of(cfg, np.array(logits[0].astype(mx.float32)), seen, seen[len(prompt):])
        return mx.array(x.astype(np.float32))[None]

    steps = generate_step(mx.array(prompt), model, max_tokens=n, logits_processors=[processor])
    return [int(t) for t, _ in steps]


class Oracle:
    """A drafter that drafts the reference continuation: every draft is accepted, at every depth."""

    name = "oracle"
    needs_hidden = False

    def __init__(self, *sequences: list[int]):
        self.sequences = [list(s) for s in sequences]
        self.history: list[int] = []

    def begin(self, tokens, hidden=None):
        self.history = list(tokens)

    def propose(self, k, sampling, key):
        seq = next(s for s in self.sequences if s[: len(self.history)] == self.history)
        out = (seq[len(self.history) : len(self.history) + k] + [0] * k)[:k]
        return Draft(mx.array(out, dtype=mx.int32), None, out)

    def commit(self, verdict, hidden=None):
        self.history += verdict.tokens

    def max_draft(self):
        return None


def run(model, drafter, k, cfg, prompt=PROMPT, n=N):
    engine = Engine(model, drafter)
    out = [t for s in engine.generate(prompt, GenerationConfig(max_tokens=n, num_draft=k, sampling=cfg))
           for t in s.tokens]
    return out, engine


def check(model, drafter, k, cfg, prompt=PROMPT, deep=False):
    want = reference(model, prompt, cfg)
    assert want != reference(model, prompt, SamplingConfig()), "the setting must change the output"
    out, engine = run(model, drafter, k, cfg, prompt)
    assert out == want, f"first difference at {next(i for i, (a, b) in enumerate(zip(out, want)) if a != b)}"
    if drafter is not None:
        assert engine.stats.drafted > 0
    if deep:
        assert sum(engine.stats.accepted_at[2:]) > 0, engine.stats.accepted_at
    return engine


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_plain_equals_reference(case):
    check(llama(), None, 0, CASES[case])


@pytest.mark.parametrize("k", [3, 6])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_oracle_deep_rows(case, k):
    """Every draft accepted: rows deep in the pass, whose counts hold the drafts before them."""
    want = reference(llama(), PROMPT, CASES[case])
    check(llama(), Oracle(PROMPT + want), k, CASES[case], deep=True)


@pytest.mark.parametrize("kind", ["self", "noisy", "ngram"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_drafters(case, kind):
    drafter = {"self": lambda: DraftModelDrafter(llama(), tiny_models.VOCAB),
               "noisy": lambda: DraftModelDrafter(noisy_copy("llama", 0.01), tiny_models.VOCAB),
               "ngram": lambda: NgramDrafter(min_ngram=1)}[kind]()
    check(llama(), drafter, 4, (LOOKUP_CASES if kind == "ngram" else CASES)[case])


def test_trees_fall_back_to_chains_under_the_count_penalties_and_keep_trees_under_a_bias():
    model = llama()
    for case, trees in (("frequency", False), ("logit_bias", True)):
        engine = check(model, SuffixDrafter(SuffixCache(), min_match=1), 6, LOOKUP_CASES[case])
        assert engine.trees.off is None
        assert engine.trees.wanted("suffix", LOOKUP_CASES[case]) == trees


@pytest.mark.parametrize("case", ["frequency", "all"])
def test_mtp(tmp_path_factory, case):
    from test_mtp_helpers import OracleMTP, load_hf, make
    from mlx_engine.drafters.mtp import load_head, load_mtp_drafter

    folder = make(tmp_path_factory, "qwen3_5")
    model, config = load_hf(folder)
    cfg = CASES[case]
    prompt = PROMPT
    want = reference(model, prompt, cfg)
    out, _ = run(model, OracleMTP(load_head(model, folder, config), model), 3, cfg, prompt)
    assert out == want
    out, _ = run(model, load_mtp_drafter(model, folder, config), 3, cfg, prompt)
    assert out == want


BATCH_PROMPTS = [PROMPT, [5, 6, 7, 8, 5, 6, 7, 8, 5], [100, 101, 3, 17, 42, 9, 200], [9, 9, 9, 9, 9, 9]]


@pytest.mark.parametrize("kind", ["oracle", "self", "ngram"])
@pytest.mark.parametrize("case", ["presence", "frequency", "logit_bias"])
def test_batch_engine_greedy(case, kind):
    """Four rows, each with its own setting (one without), each equal to its reference."""
    model, cfg = llama(), (LOOKUP_CASES if kind == "ngram" else CASES)[case]
    configs = [cfg, cfg, SamplingConfig(), cfg]
    wants = [reference(model, p, c, 24) for p, c in zip(BATCH_PROMPTS, configs)]
    drafter = {"oracle": lambda: Oracle(*[p + w for p, w in zip(BATCH_PROMPTS, wants)]),
               "self": lambda: DraftModelDrafter(model, tiny_models.VOCAB),
               "ngram": lambda: NgramDrafter(min_ngram=1)}[kind]()
    engine = BatchEngine(model, drafter, num_draft=4)
    for i, (p, c) in enumerate(zip(BATCH_PROMPTS, configs)):
        engine.add(i, p, 24, sampling=c)
    got = {i: [] for i in range(4)}
    while engine.running():
        for o in engine.step():
            got[o.seq_id] += o.tokens
    assert [got[i] for i in range(4)] == wants
    assert engine.k_steps.keys() - {0}, "the steps drafted"


# ------------------------------------------------------------------------------------------ temperature > 0


SAMPLED_CASES = {  # name: (drafter kind, sampling, k)
    "noisy copy, frequency penalty": ("noisy", SamplingConfig(temperature=1.0, frequency_penalty=0.7), 4),
    "other model, presence penalty + logit bias":
        ("other", SamplingConfig(temperature=0.8, presence_penalty=1.2, logit_bias={2: 1.5, 4: -0.5}), 4),
    "ngram, all three and top-k": ("ngram", SamplingConfig(temperature=1.0, top_k=4, presence_penalty=-0.5,
                                                           frequency_penalty=0.9, logit_bias={1: 1.0}), 2),
}


@pytest.mark.parametrize("name", list(SAMPLED_CASES))
def test_every_position_follows_target(name):
    kind, cfg, k = SAMPLED_CASES[name]
    engine = Engine(small_target(), make_drafter(kind))
    classes = assert_every_position_follows_target(engine, small_target(), cfg, k=k)
    assert 0 < engine.totals["accepted"] < engine.totals["drafted"]
    assert {j for (kc, j) in classes if kc == k} == set(range(1, k + 2)), classes
