"""Random models shaped like real ones, built on the device in seconds (no download).

    model = build("llama-8b")            # Llama-3-8B shape, 4-bit g64, bf16 activations
    model = build("qwen3-30b-a3b", layers=8)

Weights are random codes with plausible scales (timing does not depend on their values); the model
classes are mlx-lm's, so the forward pass is the one a real checkpoint of that family runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class Shape:
    family: str  # mlx-lm model module
    args: dict
    bits: int = 4  # 0 = unquantized
    group_size: int = 64
    dtype: str = "bfloat16"
    notes: str = ""
    extra: dict = field(default_factory=dict)


SHAPES: dict[str, Shape] = {
    "llama-8b": Shape(
        "llama",
        dict(
            model_type="llama",
            hidden_size=4096,
            num_hidden_layers=32,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            rms_norm_eps=1e-5,
            vocab_size=128256,
            rope_theta=500000.0,
            tie_word_embeddings=False,
        ),
        notes="Llama-3-8B: hidden 4096, 32 layers, 32/8 heads, MLP 14336, vocab 128256",
    ),
    "qwen3-30b-a3b": Shape(
        "qwen3_moe",
        dict(
            model_type="qwen3_moe",
            hidden_size=2048,
            num_hidden_layers=48,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            rms_norm_eps=1e-6,
            vocab_size=151936,
            rope_theta=1000000.0,
            max_position_embeddings=32768,
            tie_word_embeddings=False,
        ),
        notes="Qwen3-30B-A3B: hidden 2048, 48 layers, 128 experts (8 active, 768 wide), 32/4 heads",
    ),
    "deepseek-mla-16b": Shape(
        "deepseek_v3",
        dict(
            model_type="deepseek_v3",
            hidden_size=2048,
            num_hidden_layers=27,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_attention_heads=16,
            num_key_value_heads=16,
            n_shared_experts=2,
            n_routed_experts=64,
            num_experts_per_tok=6,
            routed_scaling_factor=1.0,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            v_head_dim=128,
            qk_nope_head_dim=128,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            norm_topk_prob=True,
            n_group=1,
            topk_group=1,
            moe_layer_freq=1,
            first_k_dense_replace=1,
            rms_norm_eps=1e-6,
            vocab_size=102400,
            rope_theta=10000.0,
            max_position_embeddings=32768,
        ),
        notes="DeepSeek-V2-Lite sizes in mlx-lm's deepseek_v3 classes: MLA (latent 512, rope 64), hidden 2048, "
              "27 layers, 64 experts (6 active, 1408 wide) + 2 shared, 16 heads",
    ),
    "smollm2-135m": Shape(
        "llama",
        dict(
            model_type="llama",
            hidden_size=576,
            num_hidden_layers=30,
            intermediate_size=1536,
            num_attention_heads=9,
            num_key_value_heads=3,
            rms_norm_eps=1e-5,
            vocab_size=49152,
            rope_theta=100000.0,
            tie_word_embeddings=True,
        ),
        bits=0,
        dtype="float32",
        notes="SmolLM2-135M: hidden 576, 30 layers, 9/3 heads, vocab 49152, fp32",
    ),
}


def _randomise_quantized(model: nn.Module, bits: int, seed: int) -> None:
    """Replace the (lazy) quantized parameters by random codes and scales, before anything is
    evaluated: mx.quantize of random floats would cost a full-precision copy of the model."""
    key = mx.random.key(seed)
    for _, m in model.named_modules():
        params = m.parameters()
        if "scales" not in params or not isinstance(params.get("weight"), mx.array):
            continue
        key, k1, k2, k3 = mx.random.split(key, 4)
        w, s = m.weight, m.scales
        hi = mx.random.randint(0, 1 << 16, w.shape, dtype=mx.uint32, key=k1)
        lo = mx.random.randint(0, 1 << 16, w.shape, dtype=mx.uint32, key=k3)
        m.weight = (hi << 16) | lo
        scales = mx.random.uniform(0.5, 1.5, s.shape, key=k2) * (2.0 / (2**bits - 1)) * 0.02
        m.scales = scales.astype(s.dtype)
        if params.get("biases") is not None:
            m.biases = (-scales * (2 ** (bits - 1))).astype(s.dtype)


def build(name: str, layers: int | None = None, bits: int | None = None, seed: int = 0) -> nn.Module:
    """The random model of SHAPES[name] (fewer layers with `layers`; another bit width with `bits`)."""
    import importlib

    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    shape = SHAPES[name]
    module = importlib.import_module(f"mlx_lm.models.{shape.family}")
    args = dict(shape.args)
    if layers is not None:
        args["num_hidden_layers"] = layers
    model = module.Model(module.ModelArgs.from_dict(args))
    dtype = getattr(mx, shape.dtype)
    bits = shape.bits if bits is None else bits
    mx.random.seed(seed)
    if bits:
        nn.quantize(model, group_size=shape.group_size, bits=bits)
        _randomise_quantized(model, bits, seed)
    model.set_dtype(dtype)
    # evaluate layer by layer (bounded peak memory); the float initialisers of quantized modules
    # were replaced above and are never materialised
    for layer in getattr(getattr(model, "model", model), "layers", []):
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    return model


def describe(name: str, layers: int | None = None, bits: int | None = None) -> str:
    shape = SHAPES[name]
    b = shape.bits if bits is None else bits
    q = f"{b}-bit g{shape.group_size}" if b else "unquantized"
    n = layers if layers is not None else shape.args["num_hidden_layers"]
    return f"{name} ({shape.notes}; {n} layers, {q}, {shape.dtype} activations, random weights)"
