"""Reading a checkpoint's config.json the way every loader here needs it."""


def text_config(config: dict) -> dict:
    """The language model's config (Qwen3.5 nests it under text_config)."""
    tc = config.get("text_config")
    if isinstance(tc, dict) and tc:
        return {**tc, "model_type": tc.get("model_type", config.get("model_type"))}
    return config


def context_length(config: dict) -> int | None:
    """The model's context window from its config (None when the config names none)."""
    tc = text_config(config)
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length", "n_ctx"):
        value = tc.get(key) or config.get(key)
        if value:
            return int(value)
    return None
