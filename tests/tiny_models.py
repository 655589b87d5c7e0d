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
    # the caches agents' models bring (issue 51): a hybrid's GatedDeltaNet layers beside attention ones (dense),
    # alternating sliding windows (gpt-oss: window 8, so a 40-token prompt wraps it; attention sinks; MoE),
    # Gemma 4's sliding windows with KV-shared layers (its last two layers read the first two's entries)
    "qwen3_5": dict(
        model_type="qwen3_5", hidden_size=48, num_hidden_layers=4, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, full_attention_interval=2,
        tie_word_embeddings=False,
        rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    "qwen3_5_moe": dict(
        model_type="qwen3_5_moe", hidden_size=48, num_hidden_layers=4, intermediate_size=96,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
        full_attention_interval=2, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[],
        rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    "gpt_oss": dict(
        model_type="gpt_oss", hidden_size=48, num_hidden_layers=4, intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2, rms_norm_eps=1e-5, rope_theta=10000,
    ),
    "gemma4_text": dict(
        model_type="gemma4_text", hidden_size=32, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        head_dim=8, global_head_dim=16, num_key_value_heads=2, num_kv_shared_layers=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=VOCAB, use_double_wide_mlp=False, final_logit_softcapping=30.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    # a CacheList per layer (two MLA attentions a layer, each with its own KV cache)
    "longcat_flash": dict(
        model_type="longcat_flash", attention_method="MLA", zero_expert_type="identity", hidden_size=48,
        ffn_hidden_size=96, moe_topk=2, expert_ffn_hidden_size=32, n_routed_experts=4, zero_expert_num=1,
        num_layers=2, max_position_embeddings=2048, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, routed_scaling_factor=1.0, rms_norm_eps=1e-6,
        rope_theta=10000.0, mla_scale_q_lora=True, mla_scale_kv_lora=True, attention_bias=False,
    ),
    # a recurrent kind the batch engine does not run (LFM2's short convolutions): served one at a time, saying why
    "lfm2": dict(
        model_type="lfm2", hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=48,
        block_multiple_of=16, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False, block_ff_dim=96,
        full_attn_idxs=[1, 3],
    ),
}

FAMILIES = ("llama", "qwen3", "deepseek_v3", "qwen3_next")  # the families every plain-cache test runs
AGENT_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "gpt_oss", "gemma4_text")  # not plain KV caches


WRAPPED = ("qwen3_5", "qwen3_5_moe")  # mlx-lm builds these from a text_config (the VLM checkpoints' layout)


def config(family: str, vocab: int = VOCAB, **overrides) -> dict:
    cfg = {**CONFIGS[family], "vocab_size": vocab, **overrides}
    if family in WRAPPED:
        return {"model_type": family, "text_config": {**cfg, "model_type": family + "_text"}}
    return cfg


def build(family: str, seed: int = 0, vocab: int = VOCAB, **overrides):
    """A random model of `family`, fp32, parameters evaluated. Returns (model, config)."""
    cfg = config(family, vocab, **overrides)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(cfg))
    model.eval()
    mx.eval(model.parameters())
    return model, cfg
