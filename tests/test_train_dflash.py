"""The DFlash trainer's batched forward (many anchors per sequence, one block-diagonal mask) computes what
the drafter computes for a block: same logits on the same context."""

import pytest
import mlx.core as mx
import numpy as np

import dflash_util as du
import tiny_models
from mlx_engine.drafters.dflash import DFlashDrafter, load_dflash
from mlx_engine.target_model.model import Target
from mlx_engine.train.dflash import make_batch, train_forward


def test_train_forward_equals_the_drafters_block(tmp_path):
    model = tiny_models.build("qwen3", seed=1, num_hidden_layers=4)[0]
    cfg, _ = du.write_dflash(tmp_path, 48, tiny_models.VOCAB, seed=3, layer_ids=(0, 2), block_size=5)
    drafter = DFlashDrafter(load_dflash(tmp_path), model)
    t = Target(model)
    seq = [3, 17, 42, 9, 128, 77, 5, 200, 17, 42, 9, 60, 61]
    n = 9  # context rows 0..8, the block's anchor token seq[9] at position 9
    _, feats = t.forward(mx.array(seq[:n]), t.make_cache(), drafter.hidden_request)
    drafter.begin(seq[: n + 1], feats)
    want = np.array(drafter.logits(drafter.block_hidden()[1:]))
    B = cfg["block_size"]
    block = mx.array([[seq[n]] + [cfg["dflash_config"]["mask_token_id"]] * (B - 1)])
    mask = mx.ones((1, B, n + B), dtype=mx.bool_)
    y = train_forward(drafter.model, t.embed_tokens(block), feats[None], mx.arange(n, n + B)[None], mask,
                      cfg["rope_theta"])
    got = np.array(t.lm_head(y[0, 1:]))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_batch_masks_context_before_each_anchor():
    rng = np.random.default_rng(0)
    L, H, B, m = 30, 4, 4, 3
    data = [(np.arange(L, dtype=np.int32), np.ones((L, 2 * H), np.float16), np.ones((L, H), np.float16), 5)]
    toks, feats, qpos, mask, teacher, w = make_batch(data, [0], rng, m, B, 32, 99)
    qpos, mask, toks = np.array(qpos[0]), np.array(mask[0]), np.array(toks[0])
    for j in range(m):
        a = qpos[j * B]
        assert toks[j * B] == a and (toks[j * B + 1 : (j + 1) * B] == 99).all()
        assert mask[j * B, :32].sum() == a  # context rows 0..a-1 only
        assert mask[j * B, 32:].sum() == B  # its own block only
        assert a >= 5 and a + B - 1 < L


def test_bad_corpus_or_layers_is_one_error_line(tmp_path, capsys):
    from mlx_engine.train.dflash import main as train_dflash

    for argv, said in ((["--corpus", str(tmp_path / "missing.jsonl")], "no such file"),
                       (["--layers", "a,b"], "argument --layers")):
        assert train_dflash(["--out", str(tmp_path / "out"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and said in err and len(err.splitlines()) == 1
