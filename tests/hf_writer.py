"""Tiny checkpoints in TRUE Hugging Face layout (the names and conventions of the original repos).

The target's tensors come from a random mlx-lm model of the family, mapped BACK to HF layout (per-expert
tensors, zero-centred norms stored as w - 1 where the family has them, HF conv1d layout, DeepSeek MLA
kv_b_proj, Qwen3.5's model.language_model.* prefix). The MTP head's tensors are written with HF names:
its decoder block is a random layer of the family (a donor model's layer, or a copy of one of the
target's own layers with `block_from_target`), plus the projection and norms. Optional FP8 (e4m3 bytes
tagged F8_E4M3 + weight_scale_inv per 128x128 block). A WordLevel tokenizer.json completes the folder.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

VOCAB = 256
H = 64

TEXT_CONFIGS = {
    "qwen3_5": dict(
        model_type="qwen3_5_text", hidden_size=H, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        full_attention_interval=2, rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        mtp_num_hidden_layers=1,
    ),
    "qwen3_next": dict(
        model_type="qwen3_next", hidden_size=H, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=32,
        mlp_only_layers=[], moe_intermediate_size=32, rms_norm_eps=1e-6, rope_theta=10000.0,
        partial_rotary_factor=0.25, max_position_embeddings=4096, full_attention_interval=2,
        tie_word_embeddings=False, norm_topk_prob=True, num_nextn_predict_layers=1,
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3", hidden_size=H, num_hidden_layers=2, intermediate_size=128,
        moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, num_experts_per_tok=2, routed_scaling_factor=1.0, kv_lora_rank=32, q_lora_rank=32,
        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, n_group=1, topk_group=1, moe_layer_freq=1, first_k_dense_replace=1,
        rms_norm_eps=1e-6, rope_theta=10000.0, num_nextn_predict_layers=1, max_position_embeddings=4096,
    ),
    "glm4_moe": dict(
        model_type="glm4_moe", hidden_size=H, num_hidden_layers=2, intermediate_size=128,
        max_position_embeddings=4096, moe_intermediate_size=32, norm_topk_prob=True, num_attention_heads=4,
        n_group=1, head_dim=16, topk_group=1, n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0,
        num_experts_per_tok=2, first_k_dense_replace=1, num_key_value_heads=2, rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling=None, use_qk_norm=True, tie_word_embeddings=False,
        attention_bias=True, partial_rotary_factor=0.5, num_nextn_predict_layers=1,
    ),
    "mimo": dict(
        model_type="mimo", hidden_size=H, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=4096, rope_theta=10000.0,
        tie_word_embeddings=False, num_nextn_predict_layers=1,
    ),
    "step3p5": dict(
        model_type="step3p5", hidden_size=H, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_attention_groups=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=4096, sliding_window=32, use_head_wise_attn_gate=True,
        moe_num_experts=4, moe_top_k=2, moe_intermediate_size=32, share_expert_dim=32,
        moe_router_scaling_factor=1.0, norm_expert_weight=True, tie_word_embeddings=False,
        num_nextn_predict_layers=3,
        # per-layer lists: N target layers + 3 trailing MTP entries (dense MLP, sliding attention)
        layer_types=["full_attention", "sliding_attention"] + ["sliding_attention"] * 3,
        partial_rotary_factors=[0.5] * 5,
    ),
}
TEXT_CONFIGS["glm4_moe_lite"] = {**TEXT_CONFIGS["deepseek_v3"], "model_type": "glm4_moe_lite"}
TEXT_CONFIGS["qwen3_5_moe"] = {
    **TEXT_CONFIGS["qwen3_5"], "model_type": "qwen3_5_moe_text", "num_experts": 4, "num_experts_per_tok": 2,
    "shared_expert_intermediate_size": 32, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
}
FAMILIES = tuple(TEXT_CONFIGS)
ZERO_CENTRED = {"qwen3_5", "qwen3_next", "qwen3_5_moe", "step3p5"}
MLA = ("deepseek_v3", "glm4_moe_lite")
# mlx-lm step3p5 name -> HF name (inverse of mlx-lm's step3p5 sanitize remappings)
_STEP_REMAP = [
    (".mlp.switch_mlp.gate_proj.", ".moe.gate_proj."), (".mlp.switch_mlp.up_proj.", ".moe.up_proj."),
    (".mlp.switch_mlp.down_proj.", ".moe.down_proj."), (".mlp.gate.gate.", ".moe.gate."),
    (".mlp.gate.router_bias", ".moe.router_bias"), (".mlp.share_expert.", ".share_expert."),
]
QWEN35 = ("qwen3_5", "qwen3_5_moe")
_QWEN_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
               ".q_norm.weight", ".k_norm.weight")


def config(family: str, vocab: int = VOCAB, **overrides) -> dict:
    tc = {**TEXT_CONFIGS[family], "vocab_size": vocab, **overrides}
    if family in QWEN35:
        return {"model_type": family, "text_config": tc, "tie_word_embeddings": tc["tie_word_embeddings"]}
    return tc


def text_cfg(cfg: dict) -> dict:
    return cfg.get("text_config", cfg)


def _mlx_model(cfg: dict, seed: int):
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(cfg))
    params = dict(tree_flatten(model.parameters()))
    rng = np.random.default_rng(seed)
    out = {}
    for k, v in params.items():
        a = np.array(v.astype(mx.float32))
        if a.ndim == 1 and "norm" in k:  # perturb norms so a missing/double +1 shows
            a = a + rng.normal(0, 0.1, a.shape).astype(np.float32)
        out[k] = a
    return out


def _unstack(out: dict, k: str, v: np.ndarray) -> bool:
    if ".switch_mlp." not in k:
        return False
    pre, rest = k.split(".switch_mlp.")
    for e in range(v.shape[0]):
        out[f"{pre}.experts.{e}.{rest}"] = v[e]
    return True


def to_hf(family: str, params: dict, cfg: dict) -> dict:
    """MLX-layout parameters of the family's mlx-lm model -> HF names and conventions."""
    tc = text_cfg(cfg)
    out: dict = {}
    for k, v in params.items():
        orig = k
        if family in QWEN35:
            k = k.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head.", "lm_head.")
        if family == "step3p5":  # HF: stacked experts under .moe., all norms zero-centred
            for src, dst in _STEP_REMAP:
                if src in k:
                    k = k.replace(src, dst)
                    break
            if k.endswith(".weight") and "norm" in k:
                v = v - 1.0
            out[k] = v
            continue
        if family in ZERO_CENTRED:
            if "conv1d.weight" in k:
                v = np.swapaxes(v, 1, 2)  # [C, K, 1] -> HF [C, 1, K]
            if v.ndim == 1 and k.endswith(_QWEN_NORMS):
                v = v - 1.0
        if family == "qwen3_5_moe" and ".switch_mlp." in k:  # HF Qwen3.5-MoE: fused experts
            pre = k.split(".switch_mlp.")[0]
            if k.endswith("gate_proj.weight"):
                up = params[orig.replace("gate_proj", "up_proj")]
                out[pre + ".experts.gate_up_proj"] = np.concatenate([v, up], axis=-2)
            elif k.endswith("down_proj.weight"):
                out[pre + ".experts.down_proj"] = v
            continue
        if _unstack(out, k, v):
            continue
        if family in MLA and (k.endswith("embed_q.weight") or k.endswith("unembed_out.weight")):
            if k.endswith("unembed_out.weight"):
                continue
            pre = k[: -len("embed_q.weight")]
            wk = np.swapaxes(v, -1, -2)  # [heads, nope, kv_lora]
            wv = params[pre + "unembed_out.weight"]  # [heads, v_head, kv_lora]
            out[pre + "kv_b_proj.weight"] = np.concatenate([wk, wv], axis=1).reshape(-1, tc["kv_lora_rank"])
            continue
        out[k] = v
    return out


def _layer(hf: dict, prefix: str, new_prefix: str) -> dict:
    return {new_prefix + k[len(prefix):]: v for k, v in hf.items() if k.startswith(prefix)}


def head_tensors(family: str, cfg: dict, target_hf: dict, seed: int, block_from_target: bool) -> dict:
    """HF-named MTP head tensors."""
    tc = text_cfg(cfg)
    rng = np.random.default_rng(seed + 1000)
    hdim = tc["hidden_size"]
    donor = target_hf if block_from_target else to_hf(family, _mlx_model(cfg, seed + 1), cfg)
    zc = family in ZERO_CENTRED

    def norm():
        return (rng.normal(0, 0.1, (hdim,)) + (0.0 if zc else 1.0)).astype(np.float32)

    proj = (rng.normal(0, 1, (hdim, 2 * hdim)) / np.sqrt(2 * hdim)).astype(np.float32)
    n = tc["num_hidden_layers"]
    if family in ("qwen3_5", "qwen3_next", "qwen3_5_moe"):
        base = "model.language_model.layers." if family in QWEN35 else "model.layers."
        src = f"{base}{tc['full_attention_interval'] - 1}."
        out = _layer(donor, src, "mtp.layers.0.")
        out.update({"mtp.fc.weight": proj, "mtp.pre_fc_norm_embedding.weight": norm(),
                    "mtp.pre_fc_norm_hidden.weight": norm(), "mtp.norm.weight": norm()})
        return out
    if family in ("deepseek_v3", "glm4_moe", "glm4_moe_lite"):
        pre = f"model.layers.{n}."
        out = _layer(donor, f"model.layers.{n - 1}.", pre)
        out.update({pre + "enorm.weight": norm(), pre + "hnorm.weight": norm(), pre + "eh_proj.weight": proj,
                    pre + "shared_head.norm.weight": norm(),
                    pre + "shared_head.head.weight": target_hf["lm_head.weight"],
                    pre + "embed_tokens.weight": target_hf["model.embed_tokens.weight"]})
        return out
    if family == "mimo":
        pre = "model.mtp_layers.0."
        out = _layer(donor, f"model.layers.{n - 1}.", pre)
        out.update({pre + "token_layernorm.weight": norm(), pre + "hidden_layernorm.weight": norm(),
                    pre + "input_proj.weight": proj, pre + "final_layernorm.weight": norm()})
        return out
    if family == "step3p5":  # 3 heads; block = the (dense) layer 0 under a .transformer.-less prefix
        out = {}
        vocab = tc["vocab_size"]
        for i in range(tc["num_nextn_predict_layers"]):
            pre = f"model.layers.{n + i}."
            out.update(_layer(donor, "model.layers.0.", pre))
            out.update({pre + "enorm.weight": norm(), pre + "hnorm.weight": norm(),
                        pre + "eh_proj.weight": (rng.normal(0, 1, (hdim, 2 * hdim)) / np.sqrt(2 * hdim)).astype(np.float32),
                        pre + "shared_head.norm.weight": norm(),
                        pre + "shared_head.output.weight": (rng.normal(0, 1, (vocab, hdim)) / np.sqrt(hdim)).astype(np.float32)})
        return out
    raise ValueError(family)


# -- FP8 -----------------------------------------------------------------------------------------------
def _e4m3_table() -> np.ndarray:
    t = np.zeros(256, np.float32)
    for b in range(256):
        s, e, m = b >> 7, (b >> 3) & 0xF, b & 7
        if e == 0xF and m == 7:
            v = np.nan
        elif e == 0:
            v = (m / 8.0) * 2.0 ** -6
        else:
            v = (1 + m / 8.0) * 2.0 ** (e - 7)
        t[b] = -v if s else v
    return t


E4M3 = _e4m3_table()


def fp8_quantize(w: np.ndarray, block: int = 128):
    """-> (e4m3 bytes uint8 [m, n], scale_inv float32 [ceil(m/b), ceil(n/b)])."""
    m, n = w.shape
    bm, bn = -(-m // block), -(-n // block)
    scale = np.zeros((bm, bn), np.float32)
    q = np.zeros((m, n), np.uint8)
    for i in range(bm):
        for j in range(bn):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s = max(float(np.abs(blk).max()) / 448.0, 1e-12)
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = np.array(
                mx.to_fp8(mx.array(blk / s)))
    return q, scale


def fp8_dequantize(q: np.ndarray, scale_inv: np.ndarray, block: int = 128) -> np.ndarray:
    w = E4M3[q]
    return w * np.repeat(np.repeat(scale_inv, block, 0), block, 1)[: w.shape[0], : w.shape[1]]


def _fp8_eligible(k: str, v: np.ndarray) -> bool:
    return (v.ndim == 2 and k.endswith(".weight") and "embed_tokens" not in k and "lm_head" not in k
            and "shared_head.head" not in k and not k.endswith("mlp.gate.weight") and "norm" not in k)


# -- files ---------------------------------------------------------------------------------------------
_DT = {np.dtype(np.float32): "F32", np.dtype(np.int32): "I32", np.dtype(np.float16): "F16",
       np.dtype(np.int64): "I64", np.dtype(np.bool_): "BOOL"}


def to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even as torch does."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def write_safetensors(path: Path, tensors: dict, fp8: set = frozenset(), bf16: set = frozenset()) -> None:
    """Raw safetensors writer (names in `fp8` are uint8 bytes tagged F8_E4M3, as in HF FP8 checkpoints;
    names in `bf16` are float32 arrays stored as BF16, as most checkpoints are published)."""
    header, blobs, off = {}, [], 0
    for k in sorted(tensors):
        a = np.ascontiguousarray(tensors[k])
        if k in bf16:
            a = to_bf16(a)
        dt = "F8_E4M3" if k in fp8 else "BF16" if k in bf16 else _DT[a.dtype]
        b = a.tobytes()
        header[k] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def read_safetensors(path: Path) -> dict:
    """-> {name: numpy array} (F8_E4M3 as uint8 bytes)."""
    raw = Path(path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    dts = {"F32": np.float32, "F16": np.float16, "I32": np.int32, "F8_E4M3": np.uint8, "U8": np.uint8,
           "BF16": np.uint16, "I64": np.int64, "BOOL": np.bool_}
    out = {}
    for k, info in header.items():
        if k == "__metadata__":
            continue
        a, b = info["data_offsets"]
        v = np.frombuffer(data[a:b], dtype=dts[info["dtype"]]).reshape(info["shape"])
        out[k] = from_bf16(v) if info["dtype"] == "BF16" else v
    return out


def read_hf(folder: Path) -> dict:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    out = {}
    for f in files:
        out.update(read_safetensors(folder / f))
    return out


def write_tokenizer(folder: Path, vocab: int = VOCAB) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t1", "unk_token": "t0"}))


def write_checkpoint(folder, family: str, seed: int = 0, with_head: bool = True, fp8: bool = False,
                     block_from_target: bool = False, shards: int = 1, head_file: Path | None = None,
                     **overrides) -> Path:
    """Write config.json, safetensors shard(s) (+ index when shards > 1) and a tokenizer into `folder`.

    head_file: write the head's tensors there instead (a separate --mtp-weights file).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = config(family, **overrides)
    tensors = to_hf(family, _mlx_model(cfg, seed), cfg)
    head = head_tensors(family, cfg, tensors, seed, block_from_target) if (with_head or head_file) else {}
    if head_file is not None:
        write_safetensors(Path(head_file), head)
        head = {}
    tensors.update(head)
    fp8_names = set()
    if fp8:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
        for k in [k for k, v in tensors.items() if _fp8_eligible(k, v)]:
            q, s = fp8_quantize(tensors[k])
            tensors[k] = q
            tensors[k + "_scale_inv"] = s
            fp8_names.add(k)
    cfg["architectures"] = [family]
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    names = sorted(tensors)
    if shards == 1:
        write_safetensors(folder / "model.safetensors", tensors, fp8_names)
    else:
        weight_map = {}
        for s in range(shards):
            part = names[s::shards]
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            write_safetensors(folder / fname, {k: tensors[k] for k in part}, fp8_names & set(part))
            weight_map.update({k: fname for k in part})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    write_tokenizer(folder, text_cfg(cfg)["vocab_size"])
    return folder
