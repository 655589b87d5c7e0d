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


def decode(tokenizer, tokens, special: frozenset[int] | None = None) -> str:
    """The text of `tokens` without special tokens."""
    special = special_ids(tokenizer) if special is None else special
    ids = visible(tokens, special)
    try:
        return tokenizer.decode(ids, skip_special_tokens=True)
    except TypeError:  # a tokenizer without the keyword
        return tokenizer.decode(ids)
