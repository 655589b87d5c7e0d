"""Greedy speculative output == plain output with a repetition penalty, for every drafter kind.

A verify pass scores [last, d_1..d_k]; row i must be penalised with the committed history plus
d_1..d_i, exactly as plain decoding penalises the step that follows d_i. The reference is mlx-lm's own
generate_step with its `make_repetition_penalty` logits processor (the history is the prompt + every
generated token, the last `CONTEXT` of them counted), not the engine. Every kind: a draft model, n-gram and
suffix lookup, MTP, EAGLE-3, DFlash, Gemma 4's assistant, chains. Drafters that agree with the target
(the target as its own draft, oracle heads that read the full target, the echo assistant) get drafts
accepted at deep positions, where a row penalised without the earlier drafts would pick another token.
"""

import functools

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_repetition_penalty

import dflash_util
import gemma4_util
import tiny_models
from device import as_engine_decodes
from eagle3_writer import write_eagle3
from mlx_engine import DraftModelDrafter, Engine, GenerationConfig, NgramDrafter, SamplingConfig
from mlx_engine.drafters.chain import ChainDrafter
from mlx_engine.drafters.dflash import DFlashDrafter, load_dflash
from mlx_engine.drafters.eagle3 import load_eagle3_drafter
from mlx_engine.drafters.gemma4_assistant import Gemma4AssistantDrafter, load_assistant
from mlx_engine.drafters.mtp import load_head, load_mtp_drafter
from mlx_engine.drafters.suffix import SuffixDrafter
from mlx_engine.drafters.suffix_cache import SuffixCache
from sampling_reference import penalize
from test_eagle3 import OracleEagle3
from test_greedy_equality import noisy_copy
from test_mtp_helpers import OracleMTP, load_hf, make

PENALTY, CONTEXT = 2.0, 20
PENALIZED = SamplingConfig(repetition_penalty=PENALTY, repetition_context=CONTEXT)
# repeats itself, so prompt lookup finds matches
PROMPT = [3, 17, 42, 9, 200, 11, 5, 77, 3, 17, 42, 9, 128, 64, 31, 2, 3, 17, 42]
N = 48


def mlx_lm_penalized(model, prompt, n, penalty=PENALTY):
    """mlx-lm's plain greedy decoding with its repetition-penalty processor."""
    as_engine_decodes(model)
    steps = generate_step(mx.array(prompt), model, max_tokens=n,
                          logits_processors=[make_repetition_penalty(penalty, CONTEXT)])
    return [int(t) for t, _ in steps]


def run(model, drafter, k, prompt=PROMPT, n=N):
    engine = Engine(model, drafter)
    cfg = GenerationConfig(max_tokens=n, num_draft=k, sampling=PENALIZED)
    return [t for s in engine.generate(prompt, cfg) for t in s.tokens], engine.stats


def check(model, drafter, k, deep=True, prompt=PROMPT, n=N):
    """Speculative == mlx-lm's penalised plain output, the penalty changes that output, and (deep) drafts
    were accepted at the second position or later, where the earlier drafts are in the penalty history."""
    want = mlx_lm_penalized(model, prompt, n)
    assert want != mlx_lm_penalized(model, prompt, n, penalty=1.0), "the penalty must change the output"
    out, stats = run(model, drafter, k, prompt, n)
    assert out == want, f"first difference at {next(i for i, (a, b) in enumerate(zip(out, want)) if a != b)}"
    assert stats.drafted > 0
    if deep:
        assert sum(stats.accepted_at[1:]) > 0, stats.accepted_at


@functools.cache
def llama():
    return tiny_models.build("llama", seed=1)[0]


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("kind", ["self", "noisy", "ngram", "suffix"])
def test_draft_model_and_lookup(kind, k):
    model = llama()
    if kind == "ngram":
        drafter = NgramDrafter(min_ngram=1)
    elif kind == "suffix":
        drafter = SuffixDrafter(SuffixCache(), min_match=1)
    else:
        drafter = DraftModelDrafter(model if kind == "self" else noisy_copy("llama", 0.01), tiny_models.VOCAB)
    check(model, drafter, k, deep=(kind in ("self", "noisy") and k > 1))


def test_plain_decoding_through_the_engine_equals_mlx_lm():
    out, stats = run(llama(), None, 0)
    assert out == mlx_lm_penalized(llama(), PROMPT, N) and stats.drafted == 0


@pytest.fixture(scope="module")
def qwen3_5_mtp(tmp_path_factory):
    folder = make(tmp_path_factory, "qwen3_5")
    model, config = load_hf(folder)
    return model, folder, config


@pytest.mark.parametrize("k", [2, 4])
def test_mtp(qwen3_5_mtp, k):
    model, folder, config = qwen3_5_mtp
    check(model, OracleMTP(load_head(model, folder, config), model), k)
    check(model, load_mtp_drafter(model, folder, config), k, deep=False)  # the random head itself


@pytest.fixture(scope="module")
def llama6_eagle3(tmp_path_factory):
    model, cfg = tiny_models.build("llama", seed=0, num_hidden_layers=6)
    folder = tmp_path_factory.mktemp("penalty_e3")
    write_eagle3(folder, cfg, seed=2, draft_vocab=128)
    return model, folder


def oracle_eagle3(model, folder):
    drafter = load_eagle3_drafter(folder, model)
    drafter.__class__ = OracleEagle3
    return drafter


@pytest.mark.parametrize("k", [2, 5])
def test_eagle3(llama6_eagle3, k):
    model, folder = llama6_eagle3
    check(model, oracle_eagle3(model, folder), k)
    check(model, load_eagle3_drafter(folder, model), k, deep=False)


class OracleDFlash(DFlashDrafter):
    """The real DFlash drafter (block pass, context rows, commits) whose block logits put all their weight
    on the target's own penalised greedy continuation: drafts accepted deep."""

    def logits(self, h):
        tokens, rows = list(self.history), []
        for _ in range(h.shape[0]):
            raw = np.array(self.target.model(mx.array(tokens)[None])[0, -1])
            nxt = int(np.argmax(penalize(raw, tokens, PENALTY, CONTEXT)))
            rows.append(np.eye(raw.shape[0], dtype=np.float32)[nxt] * 50.0)
            tokens.append(nxt)
        return mx.array(np.stack(rows)) + 0 * super().logits(h)


@pytest.mark.parametrize("k", [2, 5])
def test_dflash(tmp_path_factory, k):
    model = tiny_models.build("qwen3", seed=2, vocab=64)[0]
    path = tmp_path_factory.getbasetemp() / "penalty_dflash"
    if not (path / "config.json").exists():
        dflash_util.write_dflash(path, 48, 64, layer_ids=(0, 1))
    prompt = [3, 17, 22, 9, 28, 7, 5, 20, 17, 22, 9]
    check(model, OracleDFlash(load_dflash(path), model), k, prompt=prompt)
    check(model, DFlashDrafter(load_dflash(path), model), k, deep=False, prompt=prompt)


@pytest.mark.parametrize("k", [2, 4])
def test_gemma4_assistant(tmp_path, k):
    model = gemma4_util.build_target(32, seed=2)
    path = tmp_path / "echo"
    gemma4_util.write_assistant(path, 32, echo_embed=np.array(model.model.embed_tokens.weight))
    prompt = [3, 17, 22, 9, 28, 7, 5, 20, 17, 22, 9]
    check(model, Gemma4AssistantDrafter(load_assistant(path), model), k, deep=False, prompt=prompt)


@pytest.mark.parametrize("k", [2, 5])
def test_chains(qwen3_5_mtp, llama6_eagle3, k):
    model, folder = llama6_eagle3
    check(model, ChainDrafter(oracle_eagle3(model, folder), NgramDrafter(min_ngram=1)), k)
    model, folder, config = qwen3_5_mtp
    for lookup in (NgramDrafter(min_ngram=1), SuffixDrafter(SuffixCache(), min_match=1)):
        check(model, ChainDrafter(OracleMTP(load_head(model, folder, config), model), lookup), k)
