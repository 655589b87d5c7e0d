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
    ids = visible(tokens, special)
    try:
        return tokenizer.decode(ids, skip_special_tokens=not keep_special)
    except TypeError:  # a tokenizer without the keyword
        return tokenizer.decode(ids)
