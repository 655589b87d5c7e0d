"""Token ids -> the text a user reads: special tokens (`<|im_end|>`, `<|endoftext|>`, chat markers) never
reach it. The token ids themselves (JSON "tokens", the trace) keep every token."""

from __future__ import annotations


def special_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's special tokens: its declared ones, added tokens marked special, and EOS."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    for i, token in (getattr(inner, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            ids.add(int(i))
    ids |= set(getattr(tokenizer, "eos_token_ids", None) or ())
    return frozenset(int(i) for i in ids)


def visible(tokens, special: frozenset[int]) -> list[int]:
    return [t for t in tokens if t not in special]


def decode(tokenizer, tokens, special: frozenset[int] | None = None, keep_special: bool = False) -> str:
    """The text of `tokens` without the `special` ones (default: every special token); keep_special: special
    tokens not in `special` are decoded as their text (markers a reader looks for)."""
    special = special_ids(tokenizer) if special is None else special
    return decode_visible(tokenizer, visible(tokens, special), keep_special)


def decode_visible(tokenizer, ids: list[int], keep_special: bool = False) -> str:
    """decode() of ids already rid of the dropped special tokens (a stream keeps them so, every step)."""
    direct = _direct_decode(tokenizer)
    if direct is not None:
        return direct(token_ids=ids, skip_special_tokens=not keep_special)
    try:
        return tokenizer.decode(ids, skip_special_tokens=not keep_special)
    except TypeError:  # a tokenizer without the keyword
        return tokenizer.decode(ids)


def _direct_decode(tokenizer):
    """A transformers tokenizer's own `_decode`, where its `decode` only converts the ids first: the same text,
    without transformers' walk over every id's type (most of a stream's decode time: the stream decodes its whole
    answer each step). None for anything else (a tokenizer that overrides decode keeps its own)."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    cls = type(inner)
    cached = _DIRECT.get(cls)
    if cached is None:
        try:
            from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        except ImportError:  # (not installed: mlx-lm needs it, but a bare tokenizer object may do)
            PreTrainedTokenizerBase = None
        cached = _DIRECT[cls] = bool(PreTrainedTokenizerBase is not None and issubclass(cls, PreTrainedTokenizerBase)
                                     and cls.decode is PreTrainedTokenizerBase.decode)
    return inner._decode if cached else None


_DIRECT: dict[type, bool] = {}
