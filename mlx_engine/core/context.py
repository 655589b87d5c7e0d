"""A request checked before any work: token ids the model has, a prompt plus the tokens asked for that fit
its context window, and the memory budget."""


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


def check_request(prompt: list[int], max_tokens: int, vocab_size: int, context_length: int | None,
                  memory=None) -> None:
    """ValueError for an empty prompt or a token id outside [0, vocab_size), ContextLengthError for a
    request over the window, and whatever `memory.check_sequence` raises (None: no budget)."""
    if not prompt:
        raise ValueError("the prompt is empty")
    if max(prompt) >= vocab_size or min(prompt) < 0:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    check_context(len(prompt), max_tokens, context_length)
    if memory is not None:
        memory.check_sequence(len(prompt) + max_tokens)
