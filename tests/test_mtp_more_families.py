"""MTP drafters of glm4_moe_lite (DeepSeek-style MLA + MoE) and step3p5 (3 heads, own output heads,
zero-centred norms) on tiny HF-layout checkpoints:

- greedy speculative decoding with the MTP drafter is token-for-token mlx-lm's greedy decoding (k = 1..3);
- each head's logits equal a numpy computation of the head's input (enorm/hnorm incl. 1 + w where
  zero-centred, concat order, eh_proj), its output norm and its output head (the target's lm_head, or
  Step-3.5's per-layer shared_head.output), with the decoder block taken from the target's own mlx-lm
  layer (the checkpoint's head block is a copy of it), fp32, rtol 1e-4.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from hf_writer import ZERO_CENTRED, read_hf, text_cfg
from mlx_engine.drafters.mtp import load_mtp_drafter
from reference import mlx_lm_greedy
from test_mtp_helpers import PROMPT, generate, load_hf, make

FAMILIES = ["glm4_moe_lite", "step3p5"]
N_TOKENS = 64
L = 6  # slots in one batched head call


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_mlx_lm(tmp_path_factory, family):
    folder = make(tmp_path_factory, family)
    model, config = load_hf(folder)
    drafter = load_mtp_drafter(model, folder, config)
    assert drafter.family == family
    if family == "step3p5":
        assert drafter.num_layers == 3
    ref = mlx_lm_greedy(model, PROMPT, N_TOKENS)
    for k in (1, 2, 3):
        drafter = load_mtp_drafter(model, folder, config)
        assert generate(model, drafter, k, n=N_TOKENS) == ref, f"{family} k={k}"


def rms(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


# family -> index of the target layer the checkpoint's head blocks copy (block_from_target=True)
BLOCK_SOURCE = {"glm4_moe_lite": lambda tc: tc["num_hidden_layers"] - 1, "step3p5": lambda tc: 0}


@pytest.mark.parametrize("family", FAMILIES)
def test_head_logits_match_numpy(tmp_path_factory, family):
    folder = make(tmp_path_factory, family, block_from_target=True)
    model, config = load_hf(folder)
    drafter = load_mtp_drafter(model, folder, config)
    tc = text_cfg(config)
    eps, n = tc["rms_norm_eps"], tc["num_hidden_layers"]
    w = {k: v.astype(np.float64) for k, v in read_hf(folder).items()}
    zc = 1.0 if family in ZERO_CENTRED else 0.0
    target_layer = drafter.target.inner.layers[BLOCK_SOURCE[family](tc)]
    mask = mx.array(np.tril(np.ones((L, L), bool)))

    rng = np.random.default_rng(0)
    assert drafter.num_layers == tc["num_nextn_predict_layers"]
    for i in range(drafter.num_layers):
        pre = f"model.layers.{n + i}."
        toks = rng.integers(0, tc["vocab_size"], L)
        hid = rng.normal(0, 1, (L, tc["hidden_size"])).astype(np.float32)
        e = w["model.embed_tokens.weight"][toks]
        a, b = rms(e, zc + w[pre + "enorm.weight"], eps), rms(hid, zc + w[pre + "hnorm.weight"], eps)
        x_ref = np.concatenate([a, b], -1) @ w[pre + "eh_proj.weight"].T

        layer = drafter.head.layers[i]
        e_mx = drafter.target.embed_tokens(mx.array(toks))
        np.testing.assert_allclose(np.array(layer.project(e_mx, mx.array(hid))), x_ref, rtol=1e-4, atol=1e-4)

        y_ref = np.array(target_layer(mx.array(x_ref, dtype=mx.float32)[None], mask, None)[0]).astype(np.float64)
        h_ref = rms(y_ref, zc + w[pre + "shared_head.norm.weight"], eps)
        out_w = w[pre + "shared_head.output.weight"] if family == "step3p5" else w["lm_head.weight"]
        logits_ref = h_ref @ out_w.T

        h = layer(e_mx, mx.array(hid), KVCache())
        logits = drafter._logits(i, h, [])
        np.testing.assert_allclose(np.array(h), h_ref, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.array(logits), logits_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_oracle_head_accepts_everything_and_stays_exact(tmp_path_factory, family):
    """Drafts forced right (the head and its caches still run, trim and re-evaluate): every draft is
    accepted and the output is still mlx-lm's, sliding-window head caches included for step3p5."""
    from mlx_engine import Engine, GenerationConfig
    from mlx_engine.drafters.mtp import load_head
    from test_mtp_helpers import OracleMTP

    folder = make(tmp_path_factory, family)
    model, config = load_hf(folder)
    ref = mlx_lm_greedy(model, PROMPT, 48)
    for k in (1, 3):
        engine = Engine(model, OracleMTP(load_head(model, folder, config), model))
        out = [t for s in engine.generate(PROMPT, GenerationConfig(max_tokens=48, num_draft=k)) for t in s.tokens]
        assert out == ref
        assert engine.stats.drafted > 0 and engine.stats.accepted == engine.stats.drafted
