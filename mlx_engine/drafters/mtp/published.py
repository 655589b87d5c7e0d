"""The names each family's makers publish the MTP head under, for every parameter of the head built here.

A head read from a checkpoint in its published (Hugging Face) layout is accounted for tensor by tensor:
every tensor in the head's namespace must feed a parameter of the head, be one of the target's own tensors
stored again in the head's prefix (DeepSeek's `embed_tokens` / `shared_head.head`), or be a derived buffer
(`rotary_emb.inv_freq`). Anything else is refused by its published name, never dropped; a parameter nothing
feeds is reported under the published name that should have fed it.

    published_names(family, mlx_key, tc) -> alternatives, each a list of HF names that together feed it
    check_consumed(family, mlx_keys, hf_keys, config, source)  # raises HeadMismatchError naming strays

Layouts (../shared/reference/real-checkpoint-keys.json lists them per family):
- DeepSeek-V3 / GLM-4.x / GLM-4.7-Flash / Step-3.5: model.layers.{N+i}.{enorm, hnorm, eh_proj,
  shared_head.norm, shared_head.head|output, embed_tokens, <decoder block>}; experts per expert
  (mlp.experts.{E}.*; Step-3.5: fused moe.{gate,up,down}_proj); MLA's kv_b_proj (split here in two).
- Qwen3-Next / Qwen3.5 / 3.6: mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm}, mtp.layers.0.*;
  experts per expert or fused (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj, no .weight).
- MiMo-7B: model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj, final_layernorm, <block>}.
FP8 checkpoints add `<name>_scale_inv` beside each FP8 `<name>` (`weight_scale_inv`).
"""

from __future__ import annotations

from ...models.mtp_tensors import MIMO_PREFIX, QWEN_PREFIXES, HeadMismatchError, copy_predicate

DEEPSEEK_TOP = {"enorm": ["enorm.weight"], "hnorm": ["hnorm.weight"], "eh_proj": ["eh_proj.weight"],
                "norm": ["shared_head.norm.weight"], "head": ["shared_head.output.weight", "shared_head.head.weight"]}
QWEN_TOP = {"eh_proj": ["fc.weight"], "enorm": ["pre_fc_norm_embedding.weight"],
            "hnorm": ["pre_fc_norm_hidden.weight"], "norm": ["norm.weight"]}
MIMO_TOP = {"enorm": ["token_layernorm.weight"], "hnorm": ["hidden_layernorm.weight"],
            "eh_proj": ["input_proj.weight"], "norm": ["final_layernorm.weight"]}
STEP_BLOCK = [("mlp.switch_mlp.", "moe."), ("mlp.gate.gate.", "moe.gate."), ("mlp.gate.router_bias", "moe.router_bias"),
              ("mlp.share_expert.", "share_expert.")]
DERIVED = ("rotary_emb.inv_freq",)  # buffers some exports carry; computed from the config here
PROJS = ("gate_proj", "up_proj", "down_proj")


def _experts(tc: dict) -> int:
    for key in ("n_routed_experts", "num_experts", "moe_num_experts"):
        if tc.get(key):
            return int(tc[key])
    return 0


def _block(family: str, rest: str, tc: dict) -> list[list[str]]:
    """HF alternatives (relative to the block's prefix) of the block parameter `rest` (MLX name)."""
    if rest in ("self_attn.embed_q.weight", "self_attn.unembed_out.weight"):  # MLA: kv_b_proj split in two
        return [["self_attn.kv_b_proj.weight"]]
    if family == "step3p5":
        for mlx, hf in STEP_BLOCK:
            if rest.startswith(mlx):
                return [[hf + rest[len(mlx):]]]
        return [[rest]]
    if rest.startswith("mlp.switch_mlp."):
        proj, _, suffix = rest[len("mlp.switch_mlp."):].partition(".")
        alts = [[f"mlp.experts.{e}.{proj}.{suffix}" for e in range(_experts(tc))], [rest]]  # or stacked (GGUF)
        if family in ("qwen3_5", "qwen3_next") and proj in PROJS:  # Qwen3.5 MoE BF16: fused, no .weight
            alts.append(["mlp.experts.down_proj" if proj == "down_proj" else "mlp.experts.gate_up_proj"])
        return alts
    return [[rest]]


def _prefixes(family: str, i: int, tc: dict) -> tuple[list[str], list[str]]:
    """(prefixes of the layer's own tensors, prefixes of its block's tensors), HF names."""
    if family in ("qwen3_5", "qwen3_next"):
        return list(QWEN_PREFIXES), [p + f"layers.{i}." for p in QWEN_PREFIXES]
    if family == "mimo":
        return [f"{MIMO_PREFIX}{i}."], [f"{MIMO_PREFIX}{i}."]
    pre = f"model.layers.{int(tc['num_hidden_layers']) + i}."
    return [pre], [pre, pre + "transformer."] if family == "step3p5" else [pre]


def published_names(family: str, mlx_key: str, tc: dict) -> list[list[str]]:
    """The HF names that feed one head parameter (`layers.{i}.<name>`), as alternatives."""
    parts = mlx_key.split(".")
    i, name = int(parts[1]), ".".join(parts[2:])
    own, block = _prefixes(family, i, tc)
    if name.startswith("block."):
        rest = name[len("block."):]
        return [[p + n for n in alt] for alt in _block(family, rest, tc) for p in block]
    top = {"qwen3_5": QWEN_TOP, "qwen3_next": QWEN_TOP, "mimo": MIMO_TOP}.get(family, DEEPSEEK_TOP)
    field = name.rsplit(".", 1)[0]
    return [[p + n] for n in top.get(field, [name]) for p in own]


def first_name(family: str, mlx_key: str, tc: dict) -> str:
    """The published name a missing parameter should have come from (the first alternative)."""
    alts = published_names(family, mlx_key, tc)
    names = alts[0]
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"


def check_consumed(family: str, mlx_keys, hf_keys, config: dict, tc: dict, source: str) -> None:
    """Every HF tensor of the head feeds a parameter, is a copy of the target's, or a derived buffer."""
    accepted = set()
    for key in mlx_keys:
        for alt in published_names(family, key, tc):
            accepted.update(alt)
    accepted |= {k + "_scale_inv" for k in accepted}  # FP8 block scales of any FP8 tensor
    is_copy = copy_predicate(config)
    stray = sorted(k for k in hf_keys if k not in accepted and not is_copy(k) and not k.endswith(DERIVED))
    if stray:
        more = f" (+{len(stray) - 8} more)" if len(stray) > 8 else ""
        raise HeadMismatchError(
            f"{family}: the MTP head in {source} has tensors this engine does not use: {', '.join(stray[:8])}{more}. "
            "Refused rather than ignored: a head missing part of its computation drafts wrongly")
