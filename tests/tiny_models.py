"""Tiny random models of several mlx-lm families, seeded, built in memory (no downloads)."""

import mlx.core as mx
from mlx_lm.utils import _get_classes

VOCAB = 256

CONFIGS = {
    "llama": dict(
        model_type="llama", hidden_size=48, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    ),
    "qwen3": dict(
        model_type="qwen3", hidden_size=48, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3", hidden_size=48, num_hidden_layers=2, intermediate_size=96,
        moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, num_experts_per_tok=2, routed_scaling_factor=1.0, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, n_group=1, topk_group=1, moe_layer_freq=1, first_k_dense_replace=1,
        rms_norm_eps=1e-6, rope_theta=10000.0,
    ),
    "qwen3_next": dict(
        model_type="qwen3_next", hidden_size=48, num_hidden_layers=4, intermediate_size=96,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=32,
        mlp_only_layers=[], moe_intermediate_size=32, rms_norm_eps=1e-6, rope_theta=10000.0,
        partial_rotary_factor=0.5, max_position_embeddings=2048, full_attention_interval=2,
        tie_word_embeddings=False,
    ),
}

FAMILIES = tuple(CONFIGS)


def config(family: str, vocab: int = VOCAB, **overrides) -> dict:
    return {**CONFIGS[family], "vocab_size": vocab, **overrides}


def build(family: str, seed: int = 0, vocab: int = VOCAB, **overrides):
    """A random model of `family`, fp32, parameters evaluated. Returns (model, config)."""
    cfg = config(family, vocab, **overrides)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(cfg))
    model.eval()
    mx.eval(model.parameters())
    return model, cfg
