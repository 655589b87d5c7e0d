"""Where each family's checkpoint keeps its MTP head: the one table both model loading (which sets the
head's tensors aside so the target loads) and the MTP drafter (which builds the head from them) read.

    FAMILIES[model_type] -> the family (one drafter file per family in drafters/mtp/)
    head_key_predicate(config)(hf_name) -> True for the head's tensors
    copy_predicate(config)(hf_name) -> True for the head's copies of the target's own tensors
"""

from __future__ import annotations

from .config import text_config

HEAD_FILE = "mtp.safetensors"  # a head kept beside the model (converted or trained here)
HEAD_JSON = "mtp.json"  # its description (family, quantization, ...)
HEAD_FORMAT = "mlx-engine-mtp-v1"  # metadata "format" of a head file in MLX names


class MTPWeightsError(ValueError):
    """The MTP head's weights are missing, of an unsupported family, or do not fit the target."""


class UnsupportedFamilyError(MTPWeightsError):
    """The model family has no MTP support here."""


class MissingHeadError(MTPWeightsError):
    """The checkpoint holds no MTP head weights."""


class HeadMismatchError(MTPWeightsError):
    """The head's tensors do not fit the target (missing, unexpected or wrongly shaped)."""


FAMILIES = {  # model_type -> family
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "qwen3_next": "qwen3_next",
    "deepseek_v3": "deepseek_v3",
    "glm4_moe": "glm4_moe",
    "glm4_moe_lite": "glm4_moe_lite",
    "mimo": "mimo",
    "step3p5": "step3p5",
}

MIMO_PREFIX = "model.mtp_layers."
QWEN_PREFIXES = ("mtp.", "model.mtp.", "model.language_model.mtp.", "language_model.mtp.")
STEP_PREFIXES = ("mtp.", "model.mtp.")


def family_of(config: dict, model_path=None) -> str:
    mt = config.get("model_type")
    if mt not in FAMILIES:
        where = f"{model_path} has no MTP head: " if model_path is not None else ""
        raise UnsupportedFamilyError(
            f"{where}model family {mt!r} ships no MTP head (native heads supported: "
            f"{', '.join(sorted(FAMILIES))}). Train one with `python -m mlx_engine train-mtp --model MODEL "
            f"--out DIR` and pass --mtp-weights DIR/{HEAD_FILE}"
        )
    return FAMILIES[mt]


def _layers_past(n: int):
    """DeepSeek-style placement: the head's layers are model.layers.{n}.. after the n decoder layers."""

    def pred(k: str) -> bool:
        parts = k.split(".")
        return len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit() \
            and int(parts[2]) >= n

    return pred


def head_key_predicate(config: dict, model_path=None):
    """A predicate on HF tensor names selecting the family's head tensors (raises for unknown families)."""
    family = family_of(config, model_path)
    tc = text_config(config)
    if family in ("deepseek_v3", "glm4_moe", "glm4_moe_lite"):
        return _layers_past(int(tc["num_hidden_layers"]))
    if family == "step3p5":
        layers = _layers_past(int(tc["num_hidden_layers"]))
        return lambda k: layers(k) or k.startswith(STEP_PREFIXES)
    if family == "mimo":
        return lambda k: k.startswith(MIMO_PREFIX)
    return lambda k: k.startswith(QWEN_PREFIXES)  # qwen3_5, qwen3_next


# Tensors stored in the head's prefix that are copies of the target's own (DeepSeek-V3 README_WEIGHTS.md:
# "embed_tokens and shared_head share params with the main embedding and lm_head"): never read into the head
# (the target's are used), never downloaded on their own. Step-3.5's shared_head.output is NOT one: each of
# its heads has its own output layer.
_COPIES = {
    "deepseek_v3": ("embed_tokens.weight", "shared_head.head.weight"),
    "glm4_moe": ("embed_tokens.weight", "shared_head.head.weight"),
    "glm4_moe_lite": ("embed_tokens.weight", "shared_head.head.weight"),
    "step3p5": ("embed_tokens.weight",),
}


def copy_predicate(config: dict):
    """A predicate on HF names: the head's copies of the target's embedding / output layer."""
    names = _COPIES.get(family_of(config), ())
    is_head = head_key_predicate(config)

    def pred(k: str) -> bool:
        parts = k.split(".")
        return is_head(k) and len(parts) > 3 and ".".join(parts[3:]) in names

    return pred


def head_predicate(config: dict):
    """Like head_key_predicate, or None when the family has no known head."""
    try:
        return head_key_predicate(config)
    except UnsupportedFamilyError:
        return None


def split_head(weights: dict, config: dict) -> tuple[dict, dict]:
    """(target weights, head weights) by the family's head placement."""
    is_head = head_key_predicate(config)
    target, head = {}, {}
    for k, v in weights.items():
        (head if is_head(k) else target)[k] = v
    return target, head
