"""Sampled MTP drafting is lossless: every generated token, at every position of its cycle, follows the
target's sampling distribution built from first principles (test_distribution_positions' check), with the
MTP head's own probabilities as q. The tiny checkpoints have an 8-token vocabulary so the per-position
chi-square has power; the random heads disagree with their targets often, so residual resamples, accepted
drafts and bonus tokens all occur. (test_mtp_engine only checks that a seed reproduces its output.)"""

import pytest

from hf_writer import write_checkpoint
from mlx_engine import Engine, SamplingConfig
from mlx_engine.drafters.chain import ChainDrafter
from mlx_engine.drafters.mtp import load_mtp_drafter
from mlx_engine.drafters.ngram import NgramDrafter
from test_distribution_positions import assert_every_position_follows_target
from test_mtp_helpers import load_hf

PROMPT = [1, 4, 2, 5, 3, 7]


def checkpoint(tmp_path_factory, family):
    folder = tmp_path_factory.getbasetemp() / "mtp_sampled" / family
    if not (folder / "config.json").exists():
        write_checkpoint(folder, family, seed=3, vocab=8)
    return load_hf(folder) + (folder,)


@pytest.mark.parametrize("family, cfg", [
    ("qwen3_5", SamplingConfig(temperature=1.0)),
    pytest.param("deepseek_v3", SamplingConfig(temperature=0.8, top_p=0.9, repetition_penalty=1.3),
                 marks=pytest.mark.slow),
])
def test_every_position_follows_the_target(tmp_path_factory, family, cfg):
    model, config, folder = checkpoint(tmp_path_factory, family)
    engine = Engine(model, load_mtp_drafter(model, folder, config))
    classes = assert_every_position_follows_target(engine, model, cfg, k=3, runs=200, max_tokens=8, prompt=PROMPT,
                                                   min_bonus=60)
    assert 0 < engine.totals["accepted"] < engine.totals["drafted"]
    assert {j for (k, j) in classes if k == 3} == {1, 2, 3, 4}, classes


@pytest.mark.slow
def test_ngram_mtp_chain_every_position_follows_the_target(tmp_path_factory):
    model, config, folder = checkpoint(tmp_path_factory, "qwen3_5")
    chain = ChainDrafter(load_mtp_drafter(model, folder, config), NgramDrafter(min_ngram=1))
    engine = Engine(model, chain)
    assert_every_position_follows_target(engine, model, SamplingConfig(temperature=1.0, top_k=5), k=2, runs=200,
                                         max_tokens=10, prompt=PROMPT, min_bonus=0)  # prompt lookup rarely gets all k
    assert chain.cycles["ngram"] > 0 and chain.cycles["mtp"] > 0, chain.cycles
