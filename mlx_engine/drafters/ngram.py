"""Prompt lookup: draft the continuation of the latest earlier occurrence of the current suffix n-gram."""

import mlx.core as mx

from ..sampling import SamplingConfig
from .base import Draft, Verdict


class NgramDrafter:
    name = "ngram"
    needs_hidden = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self.tokens: list[int] = []
        self.index: dict[tuple, int] = {}  # n-gram -> end position of its latest occurrence with a successor
        self._indexed = 0

    def begin(self, tokens: list[int], hidden: mx.array | None = None) -> None:
        self.tokens = list(tokens)
        self.index = {}
        self._indexed = 0

    def _update_index(self) -> None:
        # index n-grams ending at positions that already have a successor token
        for end in range(self._indexed, len(self.tokens) - 1):
            for n in self.sizes:
                if end + 1 >= n:
                    self.index[tuple(self.tokens[end + 1 - n : end + 1])] = end
        self._indexed = max(self._indexed, len(self.tokens) - 1)

    def lookup(self, k: int) -> list[int]:
        self._update_index()
        for n in self.sizes:
            if len(self.tokens) < n:
                continue
            end = self.index.get(tuple(self.tokens[-n:]))
            if end is not None:
                return self.tokens[end + 1 : end + 1 + k]
        return []

    def propose(self, k: int, sampling: SamplingConfig, key: mx.array) -> Draft:
        found = self.lookup(k) if k > 0 else []
        return Draft(mx.array(found, dtype=mx.int32), None, host_tokens=found)

    def commit(self, verdict: Verdict, hidden: mx.array | None = None) -> None:
        self.tokens += verdict.tokens

    def max_draft(self) -> int | None:
        return None
