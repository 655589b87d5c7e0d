"""HF layout -> convert (keeps the head as mtp.safetensors) -> load -> same greedy output."""

import json

import mlx.nn as nn
import pytest

from mlx_engine import load
from mlx_engine.convert import convert
from mlx_engine.drafters.mtp import MissingHeadError, load_mtp_drafter
from test_mtp_helpers import PROMPT, generate, load_hf, make
from reference import mlx_lm_greedy
from device import ON_GPU


@pytest.mark.parametrize("family,fp8,shards", [("qwen3_5", False, 1), ("deepseek_v3", False, 2),
                                               ("deepseek_v3", True, 1)])
def test_convert_round_trip_unquantized(tmp_path_factory, tmp_path, family, fp8, shards):
    hf = make(tmp_path_factory, family, fp8=fp8, shards=shards)
    model, config = load_hf(hf)
    want = generate(model, load_mtp_drafter(model, hf, config), 2, n=40)

    out = convert(hf, tmp_path / "mlx")
    assert (out / "mtp.safetensors").exists()
    info = json.loads((out / "mtp.json").read_text())
    assert info["family"] == family and info["quantization"] is None
    m = load(str(out))  # the engine's loader: mlx-lm + fp32 on CPU
    drafter = load_mtp_drafter(m.model, m.path, m.config)  # finds mtp.safetensors by itself
    assert generate(m.model, drafter, 2, n=40) == want
    # the converted head is the same head: identical head caches after the same run
    import numpy as np

    ref = load_mtp_drafter(model, hf, config)
    generate(model, ref, 2, n=12)
    generate(m.model, drafter, 2, n=12)
    ref.flush(), drafter.flush()
    np.testing.assert_allclose(np.array(drafter.cache[0].keys), np.array(ref.cache[0].keys), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "family",
    [
        "qwen3_5",
        pytest.param(
            "deepseek_v3",
            marks=pytest.mark.skipif(
                ON_GPU, reason="MLX's CUDA back-end has no fp32 quantized_matmul for this shape (1x16x32x4)"
            ),
        ),
    ],
)
def test_convert_round_trip_quantized(tmp_path_factory, tmp_path, family):
    hf = make(tmp_path_factory, family)
    out = convert(hf, tmp_path / "q", quantize=True, q_bits=4, q_group_size=32, mtp_bits=8)
    info = json.loads((out / "mtp.json").read_text())
    assert info["quantization"]["bits"] == 8
    m = load(str(out))
    drafter = load_mtp_drafter(m.model, m.path, m.config)
    quantized = [mod for _, mod in drafter.head.named_modules() if isinstance(mod, nn.QuantizedLinear)]
    assert quantized and all(q.bits == 8 for q in quantized)
    ref = mlx_lm_greedy(m.model, PROMPT, 64)
    for k in (1, 3):  # 64 tokens each
        assert generate(m.model, load_mtp_drafter(m.model, m.path, m.config), k) == ref


def test_convert_refuses_model_without_head(tmp_path_factory, tmp_path):
    hf = make(tmp_path_factory, "mimo", with_head=False)
    with pytest.raises(MissingHeadError, match="mimo"):
        convert(hf, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    out = convert(hf, tmp_path / "y", require_head=False)
    assert not (out / "mtp.safetensors").exists()
