"""The grammar engine's view of a model's tokenizer: llguidance's LLTokenizer, built once per tokenizer.

llguidance reads the tokenizer's whole `tokenizer.json` (the Rust `tokenizers` serialisation), so byte-level
BPE, SentencePiece byte fallback and added special tokens are all known to it. Building one walks the
vocabulary into a token trie (~0.8 s for SmolLM2's 49,152 tokens on this CPU), hence the cache.

`n_vocab` is the model's output size, which may exceed the tokenizer's (padded embeddings): the extra ids
are never allowed by a grammar. `eos` are the ids that end an answer: a grammar allows them exactly where
its text is complete.
"""

from __future__ import annotations

import copy
import weakref

import llguidance

_built: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def backend_json(tokenizer) -> str:
    """The `tokenizer.json` text of a `tokenizers.Tokenizer`, a Hugging Face fast tokenizer or mlx-lm's
    TokenizerWrapper around one."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper
    backend = getattr(inner, "backend_tokenizer", inner)  # transformers' fast tokenizer
    if not hasattr(backend, "to_str"):
        raise ValueError(f"structured output needs a fast (tokenizers) tokenizer, got {type(inner).__name__}")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


def grammar_tokenizer(tokenizer, n_vocab: int, eos: list[int] | tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for `tokenizer`, with the model's output size and end-of-answer ids (cached)."""
    key = (int(n_vocab), tuple(sorted(int(e) for e in eos)))
    try:
        per = _built.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: build every time
        per = {}
    if key not in per:
        if not key[1]:
            raise ValueError("structured output needs the model's end-of-answer token ids")
        per[key] = llguidance.LLTokenizer(backend_json(tokenizer), n_vocab=key[0], eos_token=list(key[1]))
    return per[key]
