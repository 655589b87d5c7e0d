"""train-dflash: its many-blocks training forward computes what the drafter computes at run time; a short
run on a tiny target lowers the held-out loss and writes a checkpoint the dflash drafter loads, whose
greedy output equals plain decoding."""

import json

import mlx.core as mx
import numpy as np
import pytest

import model_dirs
from mlx_engine import Engine, GenerationConfig
from mlx_engine.drafters.dflash import DFlashDrafter, DFlashModel, load_dflash
from mlx_engine.models import load
from mlx_engine.target.model import Target
from mlx_engine.train import dflash as train
from reference import mlx_lm_greedy


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_dflash")
    folder = model_dirs.save_tiny(root / "model", "llama", seed=3, vocab=320)
    m = load(str(folder))
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(24):
        prompt = rng.integers(3, 320, size=int(rng.integers(4, 10))).tolist()
        rows.append({"prompt_ids": prompt, "response_ids": mlx_lm_greedy(m.model, prompt, 40)})
    corpus = root / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps(r) for r in rows))
    return root, folder, m, corpus, rows


def test_training_forward_equals_the_drafter(setup):
    """block_forward over a batch of anchors == DFlashDrafter.block_hidden after a prefill of the prefix."""
    _, _, m, _, rows = setup
    target = Target(m.model)
    cfg = train.drafter_config(dict(m.config), (0, 1), 2, 5, mask_token_id=1)
    mx.random.seed(0)
    model = DFlashModel(cfg)
    train.init_from_target(model, target)
    toks = rows[0]["prompt_ids"] + rows[0]["response_ids"]
    feats = train.encode(target, [toks], (0, 1), progress=None)[0]
    data = [(np.array(toks), feats, len(rows[0]["prompt_ids"]) - 1)]
    rng = np.random.default_rng(1)
    L = 2 * len(toks)  # a window longer than the sequence starts at position 0
    f, cpos, ids, bpos, mask, _, _ = train.make_batch(rng, data, [0], L, 3, 5, 1, np.arange(320))
    emb = target.embed_tokens(mx.array(ids))
    h = train.block_forward(model, mx.array(f).astype(mx.float32), mx.array(cpos), emb, mx.array(bpos),
                            mx.array(mask), float(cfg["rope_theta"]))
    assert cpos[0, 0] == 0 and cpos[0, 1] == 1
    anchors = {int(bpos[0, b * 5]) for b in range(3)}
    assert len(anchors) > 1
    for b in range(3):
        a = int(bpos[0, b * 5])
        drafter = DFlashDrafter(model, m.model)
        drafter.begin(toks[: a + 1], mx.array(feats[:a].astype(np.float32)))  # the committed prefix x_0..x_a
        np.testing.assert_allclose(np.array(h[0, b * 5 : (b + 1) * 5]), np.array(drafter.block_hidden()),
                                   rtol=1e-4, atol=1e-4)


def test_short_run_learns_and_drafts_losslessly(setup):
    root, folder, m, corpus, rows = setup
    out = root / "drafter"
    args = ["--model", str(folder), "--out", str(out), "--corpus", str(corpus), "--target-layers", "0,1",
            "--block-size", "5", "--steps", "30", "--batch", "4", "--seq-len", "32", "--anchors", "4",
            "--lr", "3e-3", "--warmup", "2", "--log-every", "10", "--vocab-subset", "0", "--mask-token", "1"]
    assert train.main(args) == 0
    info = json.loads((out / "train.json").read_text())
    first, last = info["history"][0], info["history"][-1]
    assert last[2] < first[2]  # held-out loss went down
    drafter = DFlashDrafter(load_dflash(out), m.model)
    prompt = rows[-1]["prompt_ids"]
    eng = Engine(m.model, drafter)
    got = [t for s in eng.generate(prompt, GenerationConfig(max_tokens=32, num_draft=4)) for t in s.tokens]
    assert got == mlx_lm_greedy(m.model, prompt, 32)
    assert eng.stats.accepted > 0


def test_bad_flags_are_errors(tmp_path, capsys):
    assert train.main(["--out", str(tmp_path), "--corpus", str(tmp_path / "none.jsonl")]) == 2
    out = capsys.readouterr()
    assert "error: corpus file" in out.err + out.out
    assert train.main(["--out", str(tmp_path), "--target-layers", "0,x"]) == 2
