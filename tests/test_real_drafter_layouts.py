"""EAGLE-3, DFlash and Gemma 4 assistant checkpoints under the names real_checkpoint_keys.json lists, stored
as published (BF16 floats; EAGLE-3's d2t int64 and t2d bool; the assistant's token_ordering int64), load
through the drafter factory as `--drafter eagle3 / dflash / gemma4-assistant` do and decode exactly; a
tensor the drafter does not use is refused by name, a missing one named.

Where our layout differs from the reference's list (the assistant's list is "inferred" there):
- the assistant's layers carry `layer_scalar` (mlx-lm's gemma4_text requires it of every real Gemma 4
  checkpoint it loads; the reference's inferred list omits it);
- the centroid head is stored as `masked_embedding.centroids.weight` / `masked_embedding.token_ordering`
  (transformers' module names; the reference lists SGLang's names after it strips `masked_embedding.`).
"""

import re
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

import dflash_util
import gemma4_util
import tiny_models
from eagle3_writer import write_eagle3
from hf_writer import write_safetensors
from mlx_engine.drafters.registry import DrafterError, DrafterOptions, make_drafter
from real_fixtures import KEYS
from reference import mlx_lm_greedy
from test_mtp_helpers import generate

PROMPT = [3, 17, 22, 9, 28, 7, 5, 20, 17, 22, 9]
N = 24


def listed(family: str, layers: int = 1) -> set[str]:
    out = set()
    for k in KEYS[family]["keys"]:
        out.update(k.replace("{i}", str(i)) for i in range(layers if "{i}" in k else 1))
    return out


def store(folder, tensors: dict, extra=None, drop=()) -> None:
    """model.safetensors as published: float tensors BF16, integer / boolean ones as they are."""
    t = {k: np.asarray(v) for k, v in tensors.items() if k not in drop}
    t.update(extra or {})
    bf16 = {k for k, v in t.items() if v.dtype == np.float32}
    write_safetensors(folder / "model.safetensors", t, bf16=bf16)


def loaded(model):
    return SimpleNamespace(model=model, path=None, config={}, tokenizer=None)


# -- EAGLE-3 ------------------------------------------------------------------------------------------------

def eagle3(tmp_path, extra=None, drop=()):
    model, cfg = tiny_models.build("llama", seed=0, num_hidden_layers=6)
    tensors = write_eagle3(tmp_path, cfg, draft_vocab=cfg["vocab_size"] // 2)["tensors"]
    assert set(tensors) == listed("eagle3")  # every published name, nothing else
    tensors["t2d"] = tensors["t2d"].astype(np.bool_)
    store(tmp_path, tensors, extra, drop)
    return model, DrafterOptions(eagle3=str(tmp_path))


def test_eagle3_published_layout_decodes_exactly(tmp_path):
    model, opts = eagle3(tmp_path)
    assert mx.load(str(tmp_path / "model.safetensors"))["d2t"].dtype == mx.int64
    drafter = make_drafter("eagle3", loaded(model), opts)
    assert generate(model, drafter, 2, n=N, prompt=PROMPT) == mlx_lm_greedy(model, PROMPT, N)


@pytest.mark.parametrize("extra,drop,name", [
    ({"midlayer.self_attn.q_norm.weight": np.ones(16, np.float32)}, (), "midlayer.self_attn.q_norm.weight"),
    (None, ("midlayer.hidden_norm.weight",), "midlayer.hidden_norm.weight"),
])
def test_eagle3_stray_or_missing_tensor_is_named(tmp_path, extra, drop, name):
    model, opts = eagle3(tmp_path, extra, drop)
    with pytest.raises(DrafterError, match=re.escape(name)):
        make_drafter("eagle3", loaded(model), opts)


def test_eagle3_pytorch_bin_only_is_refused_clearly(tmp_path):
    """yuhuili/EAGLE3-LLaMA3.1-Instruct-8B ships pytorch_model.bin: refused with a message, no traceback."""
    model, _ = eagle3(tmp_path / "ok")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not read")
    with pytest.raises(DrafterError, match="safetensors"):
        make_drafter("eagle3", loaded(model), DrafterOptions(eagle3=str(tmp_path / "bin")))


# -- DFlash -------------------------------------------------------------------------------------------------

def dflash(tmp_path, extra=None, drop=()):
    model = tiny_models.build("qwen3", seed=2, vocab=64)[0]
    _, tensors = dflash_util.write_dflash(tmp_path, 48, 64, layer_ids=(0, 1))
    assert set(tensors) == listed("dflash", layers=2)
    store(tmp_path, tensors, extra, drop)
    return model, DrafterOptions(dflash=str(tmp_path))


def test_dflash_published_layout_decodes_exactly(tmp_path):
    model, opts = dflash(tmp_path)
    drafter = make_drafter("dflash", loaded(model), opts)
    assert generate(model, drafter, 3, n=N, prompt=PROMPT) == mlx_lm_greedy(model, PROMPT, N)


@pytest.mark.parametrize("extra,drop,name", [
    ({"layers.0.attention_conv.weight": np.ones((4, 4), np.float32)}, (), "layers.0.attention_conv.weight"),
    (None, ("hidden_norm.weight",), "hidden_norm.weight"),
])
def test_dflash_stray_or_missing_tensor_is_named(tmp_path, extra, drop, name):
    model, opts = dflash(tmp_path, extra, drop)
    with pytest.raises(DrafterError, match=re.escape(name)):
        make_drafter("dflash", loaded(model), opts)


# -- Gemma 4 assistant --------------------------------------------------------------------------------------

def assistant(tmp_path, extra=None, drop=()):
    model = gemma4_util.build_target(64, seed=2)
    tensors = gemma4_util.write_assistant(tmp_path, 64, ordered=True)
    ours = {re.sub(r"^masked_embedding\.", "", k) for k in tensors if not k.endswith("layer_scalar")}
    assert ours == listed("gemma4_assistant", layers=2)  # the differences named in the module docstring
    store(tmp_path, tensors, extra, drop)
    return model, DrafterOptions(assistant=str(tmp_path))


def test_gemma4_assistant_published_layout_decodes_exactly(tmp_path):
    model, opts = assistant(tmp_path)
    assert mx.load(str(tmp_path / "model.safetensors"))["masked_embedding.token_ordering"].dtype == mx.int64
    drafter = make_drafter("gemma4-assistant", loaded(model), opts)
    assert generate(model, drafter, 2, n=N, prompt=PROMPT) == mlx_lm_greedy(model, PROMPT, N)


@pytest.mark.parametrize("extra,drop,name", [
    ({"model.layers.0.self_attn.k_proj.weight": np.ones((16, 24), np.float32)}, (),
     "model.layers.0.self_attn.k_proj.weight"),
    (None, ("post_projection.weight",), "post_projection.weight"),
])
def test_gemma4_assistant_stray_or_missing_tensor_is_named(tmp_path, extra, drop, name):
    model, opts = assistant(tmp_path, extra, drop)
    with pytest.raises(DrafterError, match=re.escape(name)):
        make_drafter("gemma4-assistant", loaded(model), opts)
