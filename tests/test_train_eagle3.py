"""train-eagle3 on a tiny llama target: the training-time-test unroll computes exactly the drafter's run-time
draft logits at every depth, a few steps lower the loss, checkpoint + resume is exact, and the written
checkpoint (EAGLE-3 HF layout) loads through --drafter eagle3 and is lossless."""

import json
import mlx.core as mx
import numpy as np
import pytest

import model_dirs
from test_train_mtp import assert_same_checkpoint
from mlx_engine import Engine, GenerationConfig
from mlx_engine.drafters.eagle3 import load_eagle3_drafter
from mlx_engine.models import load
from mlx_engine.target_model.model import Target
from mlx_engine.train.corpus import generate_corpus
from mlx_engine.train.eagle3 import build_head, encode_features, feature_request, init_head, main, unroll, write_checkpoint

LAYERS = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_eagle3")
    folder = model_dirs.save_tiny(root / "model", "llama", seed=3, vocab=320, num_hidden_layers=LAYERS)
    m = load(str(folder))
    target = Target(m.model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 320, size=int(rng.integers(4, 12))).tolist() for _ in range(16)]
    seqs = generate_corpus(target, prompts, max_tokens=40, temperature=0.0, batch=16)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"prompt_ids": p, "response_ids": t[1:].tolist()}) + "\n"
                              for p, (t, _) in zip(prompts, seqs)))
    return root, folder, m, corpus


def _train(root, folder, corpus, name, *extra):
    out = root / name
    args = ["--model", str(folder), "--out", str(out), "--corpus", str(corpus), "--seq-len", "16", "--batch", "4",
            "--lr", "3e-3", "--warmup", "2", "--log-every", "2", "--ckpt-every", "4", "--ttt", "3", *extra]
    assert main(args) == 0
    return out


def test_ttt_unroll_equals_the_drafters_run_time_logits(setup, tmp_path):
    """For anchors p of one sequence, step j of the unroll == the drafter after `begin` on slots 0..p, then
    j chained steps fed the sequence's own tokens (its cache holding exact entries + draft-time ones)."""
    _, _, m, corpus = setup
    target = Target(m.model)
    row = json.loads(corpus.read_text().splitlines()[0])
    tokens = row["prompt_ids"] + row["response_ids"]
    _, request = feature_request(LAYERS)
    [(toks, feats)] = encode_features(target, [tokens], [0], request)
    feats = mx.array(feats[:, : 3 * target.inner.args.hidden_size]).astype(mx.float32)
    subset = np.sort(np.random.default_rng(1).choice(320, 200, replace=False)).astype(np.int32)
    mx.random.seed(0)
    head = build_head(m.model, len(subset))
    init_head(head, target, mx.array(subset), "last-layer")
    write_checkpoint(tmp_path, head, subset, 320, (2, 3, 3), {"rms_norm_eps": m.config["rms_norm_eps"],
                                                               "rope_theta": m.config["rope_theta"]}, mx.float32)
    D, S = 3, 12
    emb = target.embed_tokens
    es = mx.stack([emb(mx.array(tokens[j + 1 : j + 1 + S]))[None] for j in range(D)])
    got = [np.array(s[0]) for s in unroll(head, feats[None, :S], es)]
    drafter = load_eagle3_drafter(tmp_path, m.model)
    for p in (0, 4, S - 1):
        drafter.begin(tokens[: p + 2], feats[: p + 1])
        drafter.flush()
        y = drafter._out
        for j in range(D):
            want = np.array(drafter._logits(0, y, []))[0][subset]
            np.testing.assert_allclose(got[j][p], want, rtol=1e-4, atol=1e-4, err_msg=f"anchor {p}, step {j}")
            y = drafter._run(0, mx.array([tokens[p + j + 2]]), y)


def test_loss_decreases_and_resume_is_exact(setup):
    root, folder, m, corpus = setup
    full = _train(root, folder, corpus, "full", "--steps", "24", "--vocab-subset", "200")
    hist = json.loads((full / "checkpoint" / "state.json").read_text())["history"]
    assert hist[-1][1] < hist[0][1] * 0.9, hist
    part = _train(root, folder, corpus, "part", "--steps", "24", "--vocab-subset", "200", "--stop-after", "12")
    assert json.loads((part / "checkpoint" / "state.json").read_text())["step"] == 12
    part = _train(root, folder, corpus, "part", "--steps", "24", "--vocab-subset", "200", "--resume")
    assert json.loads((part / "checkpoint" / "state.json").read_text())["step"] == 24
    assert_same_checkpoint(full, part)
    cfg = json.loads((full / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 200 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]
    # the checkpoint loads as an EAGLE-3 drafter and is lossless
    drafter = load_eagle3_drafter(full, m.model)
    prompt = [5, 17, 33, 90, 41]
    plain = [t for s in Engine(m.model).generate(prompt, GenerationConfig(max_tokens=24)) for t in s.tokens]
    eng = Engine(m.model, drafter)
    spec = [t for s in eng.generate(prompt, GenerationConfig(max_tokens=24, num_draft=3)) for t in s.tokens]
    assert spec == plain and eng.stats.drafted > 0


def test_bad_input_is_a_clear_error(setup, tmp_path, capsys):
    root, folder, _, _ = setup
    st = tmp_path / "c.safetensors"
    mx.save_safetensors(str(st), {"tokens": mx.zeros((4,), mx.int32)})
    assert main(["--model", str(folder), "--out", str(tmp_path / "o"), "--corpus", str(st), "--steps", "2"]) == 2
    assert "error: " in capsys.readouterr().err
    assert main(["--model", str(folder), "--out", str(tmp_path / "o"), "--ttt", "0"]) == 2
