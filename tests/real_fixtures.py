"""Tiny checkpoints written from the published tensor names of real checkpoints.

tests/real_checkpoint_keys.json is a copy of ../shared/reference/real-checkpoint-keys.json (gathered from
copies of the makers' model.safetensors.index.json, safetensors header dumps and inference engines' loaders;
each entry names its sources). For every MTP family it lists, `write_real` writes a checkpoint whose head
holds EXACTLY the listed names (the layer number moved to the tiny model's layer count, `{E}` expanded over
its experts), shapes scaled down, in each published storage form:

- BF16: every float tensor stored as BF16 (the published dtype);
- FP8 (DeepSeek-V3/R1 as published): the head layer's attention and experts as F8_E4M3 bytes with F32
  `weight_scale_inv` per 128x128 block, its eh_proj / norms / embed / head in BF16 (the header dump);
- Qwen3.5/3.6 MoE: BF16 release = experts FUSED (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`,
  no `.weight`); FP8 release = experts PER EXPERT with block scales, the head in its own `mtp.safetensors`
  shard (as Qwen3.6-35B-A3B-FP8 ships it).

The values come from tests/hf_writer.py (a random mlx-lm layer of the family mapped back to HF names); a name
the reference lists that the writer cannot produce fails the fixture, and so does a head tensor the
reference does not list. The target's tensors go to the first shards, the head's to the last one (as in
DeepSeek-V3, whose layer 61 sits in its last shards), with a model.safetensors.index.json.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import hf_writer
from hf_writer import _mlx_model, config, fp8_quantize, head_tensors, text_cfg, to_hf, write_safetensors, \
    write_tokenizer

KEYS = json.loads((Path(__file__).parent / "real_checkpoint_keys.json").read_text())


@dataclass(frozen=True)
class Form:
    ref: str  # the family's entry in real_checkpoint_keys.json
    family: str  # hf_writer's family
    storage: str  # bf16 | fp8 | bf16-fused | fp8-per-expert
    note: str
    overrides: dict = field(default_factory=dict)


FORMS = {f"{f.ref}/{f.storage}": f for f in [
    Form("deepseek_v3", "deepseek_v3", "fp8", "as published (DeepSeek-V3, -0324, V3.1, R1): FP8 block-scaled layer, "
         "BF16 eh_proj/norms/embed/head"),
    Form("deepseek_v3", "deepseek_v3", "bf16", "community BF16 conversions (not in the reference data)"),
    Form("glm4_moe", "glm4_moe", "bf16", "GLM-4.5 / 4.6 / 4.7 (qk-norm as in the 4.6/4.7 config)"),
    Form("glm4_moe_air", "glm4_moe", "bf16", "GLM-4.5-Air (no qk-norm; names inferred)", {"use_qk_norm": False}),
    Form("glm4_moe_lite", "glm4_moe_lite", "bf16", "GLM-4.7-Flash (MLA attention)"),
    Form("qwen3_next", "qwen3_next", "bf16", "Qwen3-Next-80B-A3B: experts per expert"),
    Form("qwen3_5_dense", "qwen3_5", "bf16", "Qwen3.5-27B / Qwen3.6-27B: 15 mtp.* tensors"),
    Form("qwen3_5_moe", "qwen3_5_moe", "bf16-fused", "Qwen3.5/3.6 MoE BF16 release: fused experts"),
    Form("qwen3_5_moe", "qwen3_5_moe", "fp8-per-expert", "Qwen3.6-35B-A3B-FP8: per-expert FP8 experts, "
         "head in mtp.safetensors"),
    Form("mimo", "mimo", "bf16", "MiMo-7B-Base / RL / SFT"),
    Form("step3p5", "step3p5", "bf16", "Step-3.5-Flash: 3 heads with their own outputs (block names unconfirmed "
         "in the reference: the writer's dense block)"),
]}
MTP_FORMS = sorted(FORMS)


def experts(tc: dict) -> int:
    return int(tc.get("n_routed_experts") or tc.get("num_experts") or tc.get("moe_num_experts") or 0)


def published_names(form: Form, tc: dict) -> tuple[set[str], set[str]]:
    """(head names the reference lists, moved to the tiny model; names among them stored as FP8)."""
    entry = KEYS[form.ref]
    first, n = int(entry["config"]["num_hidden_layers"]), int(tc["num_hidden_layers"])
    names = set()
    for key in entry["keys"]:
        if "{N}" in key or "|" in key:  # Step-3.5's block: names not confirmed (null shapes in the reference)
            continue
        key = re.sub(r"^model\.layers\.(\d+)\.", lambda m: f"model.layers.{int(m.group(1)) - first + n}.", key)
        if "{E}" in key:
            names.update(key.replace("{E}", str(e)) for e in range(experts(tc)))
        else:
            names.add(key)
    fp8 = {k[: -len("_scale_inv")] for k in names if k.endswith("_scale_inv")}
    if form.storage == "bf16":
        names -= {k + "_scale_inv" for k in fp8}
        fp8 = set()
    if form.storage == "fp8-per-expert":  # the FP8 release (reference notes): per expert, block scales
        names -= {"mtp.layers.0.mlp.experts.gate_up_proj", "mtp.layers.0.mlp.experts.down_proj"}
        fp8 = {f"mtp.layers.0.mlp.experts.{e}.{p}.weight" for e in range(experts(tc))
               for p in ("gate_proj", "up_proj", "down_proj")}
        fp8 |= {f"mtp.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"}
        fp8 |= {f"mtp.layers.0.mlp.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
        names |= fp8 | {k + "_scale_inv" for k in fp8}
    return names, fp8


def per_expert(tensors: dict) -> dict:
    """Fused Qwen3.5-MoE experts -> per-expert tensors (the FP8 release's layout)."""
    out = {}
    for k, v in tensors.items():
        if k.endswith(".experts.gate_up_proj"):
            pre, mid = k[: -len("gate_up_proj")], v.shape[-2] // 2
            for e in range(v.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"], out[f"{pre}{e}.up_proj.weight"] = v[e, :mid], v[e, mid:]
        elif k.endswith(".experts.down_proj"):
            pre = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    return out


_TARGET_FP8 = re.compile(r"(self_attn\.(q|k|v|o|q_a|q_b|kv_a_proj_with_mqa|kv_b)_proj|experts\.\d+\.\w+_proj|"
                         r"shared_experts?\.\w+_proj)\.weight$")


def build(form: Form, seed: int = 0):
    """(config, target tensors, head tensors, FP8 names): HF names, float32 values."""
    cfg = config(form.family, **form.overrides)
    tc = text_cfg(cfg)
    target = to_hf(form.family, _mlx_model(cfg, seed), cfg)
    head = head_tensors(form.family, cfg, target, seed, block_from_target=False)
    if form.storage == "fp8-per-expert":
        target, head = per_expert(target), per_expert(head)
    want, fp8 = published_names(form, tc)
    base = {k for k in want if not k.endswith("_scale_inv")}
    lacking = sorted(base - set(head))
    if lacking:
        raise AssertionError(f"{form.ref}/{form.storage}: the writer has no tensor for published names {lacking[:6]}")
    unconfirmed = set(head) - base
    if form.ref != "step3p5" and unconfirmed:
        raise AssertionError(f"{form.ref}/{form.storage}: the writer made head tensors the reference does not "
                             f"list: {sorted(unconfirmed)[:6]}")
    head = {k: v for k, v in head.items() if k in base or form.ref == "step3p5"}
    if form.storage.startswith("fp8"):
        cfg_q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        cfg["quantization_config"] = cfg_q
        fp8 = set(fp8) | {k for k in target if _TARGET_FP8.search(k) and target[k].ndim == 2}
    return cfg, target, head, fp8


def write_real(folder, key: str, seed: int = 0, shards: int = 3, extra: dict | None = None,
               drop: tuple = ()) -> dict:
    """Write the checkpoint of FORMS[key] into `folder`; `extra` adds head tensors, `drop` removes some.
    Returns {config, head (names as written), files, tensors (as stored: BF16-rounded floats, FP8 bytes)}."""
    form = FORMS[key]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg, target, head, fp8 = build(form, seed)
    head.update(extra or {})
    for k in drop:
        head.pop(k, None)
    stored, fp8_names = {}, set()
    for part in (target, head):
        for k, v in part.items():
            if k in fp8:
                q, s = fp8_quantize(np.asarray(v, np.float32))
                stored[k], stored[k + "_scale_inv"] = q, s
                fp8_names.add(k)
            else:
                stored[k] = np.asarray(v, np.float32)
    for k in drop:  # FP8 block scales: dropped once written
        stored.pop(k, None)
    head_names = {k for k in stored if k.removesuffix("_scale_inv") in head}
    head_file = "mtp.safetensors" if form.storage == "fp8-per-expert" else f"model-{shards:05d}-of-{shards:05d}.safetensors"
    target_names = sorted(set(stored) - head_names)
    weight_map = {k: f"model-{i % (shards - 1) + 1:05d}-of-{shards:05d}.safetensors" for i, k in enumerate(target_names)}
    weight_map.update({k: head_file for k in head_names})
    # F32 as published: FP8 block scales, and DeepSeek-V3's router biases (its header dump's total,
    # 688,574,839,360 bytes, is the config's tensors with e_score_correction_bias in F32, the rest as listed)
    keep_f32 = ("_scale_inv", "e_score_correction_bias") if form.storage == "fp8" else ("_scale_inv",)
    bf16 = {k for k, v in stored.items() if v.dtype == np.float32 and not k.endswith(keep_f32)}
    for fname in sorted(set(weight_map.values())):
        part = {k: stored[k] for k, f in weight_map.items() if f == fname}
        write_safetensors(folder / fname, part, fp8_names & set(part), bf16 & set(part))
    total = sum(stored[k].nbytes // (2 if k in bf16 else 1) for k in stored)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    cfg["architectures"] = [form.family]
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer(folder, text_cfg(cfg)["vocab_size"])
    values = {k: hf_writer.from_bf16(hf_writer.to_bf16(v)) if k in bf16 else v for k, v in stored.items()}
    return {"config": cfg, "head": sorted(head_names), "files": sorted(set(weight_map.values())),
            "head_file": head_file, "tensors": values, "form": form}
