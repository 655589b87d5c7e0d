"""The context window: a prompt plus the tokens asked for must fit, checked before any work."""


class ContextLengthError(ValueError):
    """A prompt plus the tokens asked for do not fit the model's context window."""


def check_context(prompt_tokens: int, max_tokens: int, context_length: int | None) -> None:
    """Raise ContextLengthError when prompt_tokens + max_tokens > context_length (None: not checked)."""
    if context_length is None:
        return
    if prompt_tokens >= context_length:
        raise ContextLengthError(f"the prompt has {prompt_tokens} tokens; this model's context window is "
                                 f"{context_length} tokens")
    if prompt_tokens + max_tokens > context_length:
        raise ContextLengthError(
            f"the prompt ({prompt_tokens} tokens) plus {max_tokens} new tokens exceed this model's context "
            f"window of {context_length} tokens: ask for at most {context_length - prompt_tokens} new tokens")
