"""The target model: any mlx-lm model, plus capture of the hidden state its lm_head scores.

mlx-lm models are `Model(inputs, cache) -> logits` with an inner `model` whose output is the
final-normed hidden state. We never fork a model class: to capture that hidden state we swap the inner
module's class for a subclass whose __call__ records its output (parameters and names are untouched).
"""

import mlx.core as mx
import mlx.nn as nn

from .cache import make_cache
from .hybrid import enable_per_token_states


def _text_model(model: nn.Module) -> nn.Module:
    """The module holding `.model` (+ `.lm_head`): the model itself, or its language model (VLM wrappers)."""
    for candidate in (getattr(model, "language_model", None), model):
        if candidate is not None and isinstance(getattr(candidate, "model", None), nn.Module):
            return candidate
    raise ValueError(f"cannot find the inner decoder of {type(model).__name__}")


def _install_capture(module: nn.Module) -> None:
    cls = type(module)
    if getattr(cls, "_mlx_engine_capture", False):
        return

    def __call__(self, *args, **kwargs):
        out = cls.__call__(self, *args, **kwargs)
        if self._capture_on:  # object.__setattr__: nn.Module would store an array in its parameter dict
            object.__setattr__(self, "_captured", out)
        return out

    module.__class__ = type(cls.__name__, (cls,), {"__call__": __call__, "_mlx_engine_capture": True})
    object.__setattr__(module, "_capture_on", False)
    object.__setattr__(module, "_captured", None)


class Target:
    """Wraps an mlx-lm model. `forward(tokens, cache, hidden=True)` -> (logits [n, V], hidden [n, H] | None)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.text = _text_model(model)
        self.inner = self.text.model
        _install_capture(self.inner)
        # GatedDeltaNet layers (qwen3_next, qwen3_5) keep their state after every verified token, so a
        # rejected draft rolls back by index instead of snapshot + replay
        enable_per_token_states(self.model)

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer (may exceed the tokenizer's vocabulary when padded)."""
        args = getattr(self.text, "args", None) or getattr(self.model, "args", None)
        return int(args.vocab_size)

    @property
    def embed_tokens(self) -> nn.Module:
        return self.inner.embed_tokens

    def make_cache(self) -> list:
        return make_cache(self.model)

    def forward(self, tokens: mx.array, cache: list, hidden: bool = False):
        object.__setattr__(self.inner, "_capture_on", hidden)
        logits = self.model(tokens[None], cache=cache)[0]
        h = None
        if hidden:
            h = self.inner._captured[0]
            object.__setattr__(self.inner, "_captured", None)
        return logits, h

    def lm_head(self, h: mx.array) -> mx.array:
        """Logits from final-normed hidden states (what MTP heads feed their output through)."""
        if hasattr(self.text, "lm_head"):
            return self.text.lm_head(h)
        return self.inner.embed_tokens.as_linear(h)
