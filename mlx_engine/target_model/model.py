"""The target model: any mlx-lm model, plus capture of the hidden states a drafter reads.

mlx-lm models are `Model(inputs, cache) -> logits` with an inner `model` whose output is the
final-normed hidden state and whose `layers` are the decoder layers. We never fork a model class: to
capture a module's output we swap that instance's class for a subclass whose __call__ records it
(parameters and names are untouched). What is captured is a HiddenRequest (target_model/hidden.py): the
outputs of chosen decoder layers (EAGLE-3, DFlash) and/or the final-normed state (MTP heads).
"""

import mlx.core as mx
import mlx.nn as nn

from .. import host
from .cache import make_cache
from .hidden import FINAL_HIDDEN, HiddenRequest
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
            # a decoder layer may return (hidden, extras): keep the hidden state
            object.__setattr__(self, "_captured", out[0] if isinstance(out, tuple) else out)
        return out

    module.__class__ = type(cls.__name__, (cls,), {"__call__": __call__, "_mlx_engine_capture": True})
    object.__setattr__(module, "_capture_on", False)
    object.__setattr__(module, "_captured", None)


class Target:
    """Wraps an mlx-lm model. `forward(tokens, cache, request)` -> (logits [n, V], hidden [n, H'] | None)."""

    def __init__(self, model: nn.Module, kv_bits: int | None = None, kv_group_size: int = 64):
        """kv_bits: the caches it makes quantize keys and values to that many bits (target_model/cache.py)."""
        self.model = model
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
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
        return make_cache(self.model, self.kv_bits, self.kv_group_size)

    def check_cache(self) -> None:
        """One token through a fresh cache: a quantization the model's heads do not allow fails here, at load,
        with the reason (e.g. a head dimension that is no multiple of the group size)."""
        if self.kv_bits is None:
            return
        try:
            logits, _ = self.forward(mx.array([0]), self.make_cache())
            host.wait(logits)
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"this model's KV cache cannot be quantized to {self.kv_bits} bits in groups of "
                             f"{self.kv_group_size}: {e}") from None

    @property
    def layers(self) -> list:
        return list(self.inner.layers)

    def _capture_modules(self, request: HiddenRequest) -> list[nn.Module]:
        n = len(self.inner.layers)
        mods = []
        for i in request.layers:
            if not -n <= i < n:
                raise ValueError(f"hidden state of layer {i} requested; the target has {n} layers")
            mods.append(self.inner.layers[i])
        if request.final:
            mods.append(self.inner)
        for m in mods:
            _install_capture(m)
        return mods

    def _run_capturing(self, run, request: HiddenRequest | None):
        """(run()'s result, the hidden states `request` names [B, L, H'] or None), from one pass."""
        mods = self._capture_modules(request) if request else []
        for m in mods:
            object.__setattr__(m, "_capture_on", True)
        try:
            out = run()
        finally:
            for m in mods:
                object.__setattr__(m, "_capture_on", False)
        if not mods:
            return out, None
        parts = [m._captured for m in mods]
        for m in mods:
            object.__setattr__(m, "_captured", None)
        return out, parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)

    def forward(self, tokens: mx.array, cache: list, request: HiddenRequest | bool | None = None):
        """Logits of `tokens` [n] and, if `request` (True = the final-normed state), the hidden states it
        asks for, concatenated along the last axis: [n, H * (len(layers) + final)]."""
        if request is True:
            request = FINAL_HIDDEN
        logits, hidden = self._run_capturing(lambda: self.model(tokens[None], cache=cache), request)
        # hidden rows past the logits' are the pad rows of a fixed-row pass (target_model/fixed_rows.py)
        return logits[0], None if hidden is None else hidden[0, : logits.shape[1]]

    def forward_batch(self, tokens: mx.array, cache: list, request: HiddenRequest | None = None):
        """Logits of `tokens` [B, T] -> [B, T, V] and the hidden states `request` asks for, [B, T, H'] or None
        (several sequences in one pass: `cache` holds one row per sequence, e.g. BatchKVCache layers)."""
        return self._run_capturing(lambda: self.model(tokens, cache=cache), request)

    def hidden_batch(self, x: mx.array, cache, request: HiddenRequest) -> mx.array:
        """The hidden states `request` names for a batch x [B, L] (no logits): [B, L, H']. Trainers use it
        to read the features a drafter will be fed at run time, from the same capture as `forward`."""
        return self._run_capturing(lambda: self.inner(x, cache=cache), request)[1]

    def lm_head(self, h: mx.array) -> mx.array:
        """Logits from final-normed hidden states (what MTP heads feed their output through)."""
        if hasattr(self.text, "lm_head"):
            return self.text.lm_head(h)
        return self.inner.embed_tokens.as_linear(h)
