"""Checkpoints under the names their makers publish (tests/real_fixtures.py, from real_checkpoint_keys.json)
load through the drafter factory exactly as `--drafter mtp` does, in each published storage form (BF16,
FP8 block-scaled, fused and per-expert experts):

- every head tensor is consumed: each feeds a parameter of the head or is one of the target's own tensors
  stored again in the head's prefix (DeepSeek's embed_tokens / shared_head.head), and greedy speculative
  output is the target's own greedy output;
- a tensor the head does not use is refused by its published name (never silently ignored), a missing one
  is named as published (a norm, an expert of the stack, an FP8 tensor's block scales);
- the head's logits against numpy computed from the fixture's own stored tensors (BF16 Qwen3.5 dense and
  MiMo: the whole head; DeepSeek FP8: every FP8 tensor dequantised from its bytes, and the head's input).
"""

import json
import re

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from hf_writer import E4M3, ZERO_CENTRED, config, text_cfg
from mlx_engine import load
from mlx_engine.drafters.mtp import MTPWeightsError
from mlx_engine.drafters.mtp.published import published_names
from mlx_engine.drafters.registry import make_drafter
from mlx_engine.models.mtp_tensors import copy_predicate, family_of
from real_fixtures import FORMS, MTP_FORMS, write_real
from reference import mlx_lm_greedy
from test_mtp_helpers import PROMPT, generate

N = 24


def tiny_layers(key: str) -> int:
    form = FORMS[key]
    return text_cfg(config(form.family, **form.overrides))["num_hidden_layers"]


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    made = {}

    def get(key):
        if key not in made:
            folder = tmp_path_factory.mktemp(key.replace("/", "_"))
            made[key] = folder, write_real(folder, key)
        return made[key]

    return get


@pytest.mark.parametrize("key", MTP_FORMS)
def test_published_checkpoint_loads_every_tensor_and_decodes_exactly(real, key):
    folder, info = real(key)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert {k for k, f in index.items() if f == info["head_file"]} == set(info["head"])
    loaded = load(str(folder))
    drafter = make_drafter("mtp", loaded)
    assert drafter.num_layers == (3 if key.startswith("step3p5") else 1)
    # every published head tensor feeds a parameter of the head or is a copy of the target's own
    group, tc = family_of(loaded.config), text_cfg(loaded.config)
    fed = set()
    for name, _ in tree_flatten(drafter.head.parameters()):
        alts = [a for a in published_names(group, name, tc) if set(a) <= set(info["head"])]
        assert alts, f"{name}: no published tensor feeds it"
        fed |= set(alts[0]) | {k + "_scale_inv" for k in alts[0]}
    copies = {k for k in info["head"] if copy_predicate(loaded.config)(k)}
    assert set(info["head"]) == (fed & set(info["head"])) | copies
    assert generate(loaded.model, drafter, 2, n=N) == mlx_lm_greedy(loaded.model, PROMPT, N)


# a tensor a newer or other release puts in the head's namespace, which this engine's head does not compute
STRAYS = {
    "deepseek_v3": "model.layers.{n}.self_attn.indexer.wq_b.weight",  # V3.2's sparse-attention indexer
    "glm4_moe": "model.layers.{n}.self_attn.indexer.wk.weight",
    "glm4_moe_air": "model.layers.{n}.self_attn.indexer.wk.weight",
    "glm4_moe_lite": "model.layers.{n}.self_attn.indexer.wk.weight",
    "qwen3_next": "mtp.embed_tokens.weight",  # mtp_use_dedicated_embeddings: its own embedding
    "qwen3_5_dense": "mtp.embed_tokens.weight",
    "qwen3_5_moe": "mtp.embed_tokens.weight",
    "mimo": "model.mtp_layers.0.self_attn.attention_sink_bias",  # MiMo-V2-Flash's attention sinks
    "step3p5": "model.layers.{n}.self_attn.sinks",
}


@pytest.mark.parametrize("key", MTP_FORMS)
def test_unexpected_head_tensor_is_refused_by_name(tmp_path, key):
    name = STRAYS[FORMS[key].ref].format(n=tiny_layers(key))
    write_real(tmp_path, key, extra={name: np.ones((4, 64), np.float32)})
    with pytest.raises(MTPWeightsError, match=re.escape(name)):
        make_drafter("mtp", load(str(tmp_path)))


def missing_cases():
    hnorm = {"qwen3_next": "mtp.pre_fc_norm_hidden.weight", "qwen3_5_dense": "mtp.pre_fc_norm_hidden.weight",
             "qwen3_5_moe": "mtp.pre_fc_norm_hidden.weight", "mimo": "model.mtp_layers.0.hidden_layernorm.weight"}
    for key in MTP_FORMS:
        ref = FORMS[key].ref
        yield key, hnorm.get(ref, "model.layers.{n}.hnorm.weight")
        if ref in ("deepseek_v3", "glm4_moe", "qwen3_next"):
            yield key, ("mtp.layers.0.mlp.experts.1.up_proj.weight" if ref == "qwen3_next"
                        else "model.layers.{n}.mlp.experts.1.up_proj.weight")
    yield "deepseek_v3/fp8", "model.layers.{n}.self_attn.o_proj.weight_scale_inv"
    yield "qwen3_5_moe/fp8-per-expert", "mtp.layers.0.mlp.experts.2.down_proj.weight_scale_inv"


@pytest.mark.parametrize("key,name", list(missing_cases()))
def test_missing_head_tensor_is_named(tmp_path, key, name):
    name = name.format(n=tiny_layers(key))
    write_real(tmp_path, key, drop=(name,))
    with pytest.raises(MTPWeightsError, match=re.escape(name)):
        make_drafter("mtp", load(str(tmp_path)))


# -- logits against numpy from the fixture's own tensors ---------------------------------------------------

@pytest.mark.parametrize("key", ["qwen3_5_dense/bf16", "mimo/bf16"])
def test_head_logits_match_numpy_from_stored_tensors(real, key):
    from test_mtp_reference import FULL_NUMPY, LAYOUT, L, rms

    folder, info = real(key)
    loaded = load(str(folder))
    drafter = make_drafter("mtp", loaded)
    family = FORMS[key].family
    tc = text_cfg(info["config"])
    w = {k: v.astype(np.float64) for k, v in info["tensors"].items()}  # BF16 values, as stored
    pre, en, hn, pj, on, bpre, order = LAYOUT[family]
    zc = 1.0 if family in ZERO_CENTRED else 0.0
    rng = np.random.default_rng(1)
    toks = rng.integers(0, tc["vocab_size"], L)
    hid = rng.normal(0, 1, (L, tc["hidden_size"])).astype(np.float32)
    e = w["model.language_model.embed_tokens.weight" if family == "qwen3_5" else "model.embed_tokens.weight"][toks]
    a, b = rms(e, zc + w[pre + en + ".weight"], tc["rms_norm_eps"]), rms(hid, zc + w[pre + hn + ".weight"], tc["rms_norm_eps"])
    x = np.concatenate([a, b] if order == "eh" else [b, a], -1) @ w[pre + pj + ".weight"].T
    h_ref = rms(FULL_NUMPY[family](x, w, pre + bpre, tc), zc + w[pre + on + ".weight"], tc["rms_norm_eps"])
    logits_ref = h_ref @ w["lm_head.weight"].T

    layer = drafter.head.layers[0]
    h = layer(drafter.target.embed_tokens(mx.array(toks)), mx.array(hid), KVCache())
    np.testing.assert_allclose(np.array(drafter._logits(0, h, [])), logits_ref, rtol=1e-4, atol=1e-4)


def test_deepseek_fp8_head_is_dequantised_from_its_bytes(real):
    folder, info = real("deepseek_v3/fp8")
    loaded = load(str(folder))
    head = make_drafter("mtp", loaded).head
    params = dict(tree_flatten(head.parameters()))
    n = tiny_layers("deepseek_v3/fp8")
    stored = info["tensors"]
    fp8 = sorted(k[: -len("_scale_inv")] for k in info["head"] if k.endswith("_scale_inv"))
    assert fp8 and f"model.layers.{n}.eh_proj.weight" not in fp8  # as published: eh_proj stays BF16
    from mlx_engine.models.safetensors_file import read_header

    dtypes = {k: v["dtype"] for k, v in read_header(folder / info["head_file"])[0].items()}
    assert dtypes[f"model.layers.{n}.eh_proj.weight"] == "BF16"
    assert dtypes[f"model.layers.{n}.mlp.gate.e_score_correction_bias"] == "F32"  # as in the header dump's total
    checked = 0
    for k in fp8:
        want = E4M3[stored[k]] * np.repeat(np.repeat(stored[k + "_scale_inv"], 128, 0), 128, 1)[
            : stored[k].shape[0], : stored[k].shape[1]]
        rest = k[len(f"model.layers.{n}."):]
        m = re.match(r"mlp\.experts\.(\d+)\.(\w+)\.weight$", rest)
        if m:
            got = np.array(params[f"layers.0.block.mlp.switch_mlp.{m.group(2)}.weight"][int(m.group(1))])
        elif f"layers.0.block.{rest}" in params:
            got = np.array(params[f"layers.0.block.{rest}"])
        else:
            continue  # kv_b_proj: split in two by the family's own sanitize
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        checked += 1
    assert checked >= len(fp8) - 1
    np.testing.assert_array_equal(np.array(params["layers.0.eh_proj.weight"]), stored[f"model.layers.{n}.eh_proj.weight"])


def test_a_folder_with_only_the_head_shard_serves_as_mtp_weights(real, tmp_path):
    """As after `hf download REPO config.json model.safetensors.index.json <the head's shard>`."""
    import shutil

    from mlx_engine.convert import convert
    from mlx_engine.drafters.registry import DrafterOptions

    folder, info = real("deepseek_v3/fp8")
    part = tmp_path / "head-only"
    part.mkdir()
    for f in ("config.json", "model.safetensors.index.json", info["head_file"]):
        shutil.copy(folder / f, part / f)
    target = convert(folder, tmp_path / "q", quantize=True, q_group_size=32, require_head=False)
    (target / "mtp.safetensors").unlink()
    loaded = load(str(target))
    drafter = make_drafter("mtp", loaded, DrafterOptions(mtp_weights=str(part)))
    assert generate(loaded.model, drafter, 2, n=N) == mlx_lm_greedy(loaded.model, PROMPT, N)
    (part / info["head_file"]).unlink()
    with pytest.raises(MTPWeightsError, match=re.escape(info["head_file"])):
        make_drafter("mtp", loaded, DrafterOptions(mtp_weights=str(part)))
