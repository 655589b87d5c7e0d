"""Every position of every cycle follows the target at temperature > 0 with the model drafters whose
draft probabilities q come from their own heads: EAGLE-3 (a reduced draft vocabulary mapped back to the
target's), DFlash (a block drafted in one pass), Gemma 4's assistant (reading the target's KV cache).
test_distribution_positions' check: the reference is built from the definitions, each generated token
given everything before it, per (k of its cycle, position in it), never a probability-0 token. (The
drafters' own tests look at the first two tokens only, against the engine's own sampler.)"""

import pytest

import dflash_util
import gemma4_util
import tiny_models
from eagle3_writer import write_eagle3
from mlx_engine import Engine, SamplingConfig
from mlx_engine.drafters.dflash import DFlashDrafter, load_dflash
from mlx_engine.drafters.eagle3 import load_eagle3_drafter
from mlx_engine.drafters.gemma4_assistant import Gemma4AssistantDrafter, load_assistant
from test_distribution_positions import assert_every_position_follows_target

V = 6
PROMPT = [1, 4, 2, 5, 3]


def eagle3(tmp_path):
    model, cfg = tiny_models.build("llama", seed=1, vocab=V, num_hidden_layers=4)
    write_eagle3(tmp_path / "e3", cfg, seed=4, draft_vocab=4)  # drafts only 4 of the 6 tokens
    return model, load_eagle3_drafter(tmp_path / "e3", model)


def dflash(tmp_path):
    model = tiny_models.build("qwen3", seed=3, vocab=V)[0]
    dflash_util.write_dflash(tmp_path / "df", 48, V, seed=4, layer_ids=(0, 1), mask_token_id=V - 1)
    return model, DFlashDrafter(load_dflash(tmp_path / "df"), model)


def gemma4(tmp_path):
    model = gemma4_util.build_target(V, seed=3)
    gemma4_util.write_assistant(tmp_path / "g4", V, seed=4)
    return model, Gemma4AssistantDrafter(load_assistant(tmp_path / "g4"), model)


@pytest.mark.parametrize("make, cfg", [
    (eagle3, SamplingConfig(temperature=1.0)),
    pytest.param(dflash, SamplingConfig(temperature=0.8, top_p=0.9), marks=pytest.mark.slow),
    pytest.param(gemma4, SamplingConfig(temperature=1.0, repetition_penalty=1.3), marks=pytest.mark.slow),
], ids=["eagle3", "dflash", "gemma4-assistant"])
def test_every_position_follows_the_target(tmp_path, make, cfg):
    model, drafter = make(tmp_path)
    engine = Engine(model, drafter)
    classes = assert_every_position_follows_target(engine, model, cfg, k=3, runs=300, max_tokens=10, prompt=PROMPT,
                                                   min_bonus=30)
    assert 0 < engine.totals["accepted"] < engine.totals["drafted"]
    assert {j for (k, j) in classes if k == 3} == {1, 2, 3, 4}, classes
