"""Reading a checkpoint's config.json the way every loader here needs it."""


def text_config(config: dict) -> dict:
    """The language model's config (Qwen3.5 nests it under text_config)."""
    tc = config.get("text_config")
    if isinstance(tc, dict) and tc:
        return {**tc, "model_type": tc.get("model_type", config.get("model_type"))}
    return config
