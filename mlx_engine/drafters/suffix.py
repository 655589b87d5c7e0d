"""The `suffix` drafter (SuffixDecoding, arXiv 2411.04975): continuations of the longest suffix of the
context found in a suffix trie over this request's prompt and output and earlier requests' prompts and
outputs (drafters/suffix_cache.py, shared by every request of the process), scored by how often each
continuation followed the match.

- The match: the longest suffix of the committed tokens (min_match..max_match tokens) that occurred
  somewhere in the cache followed by a token. No match, no draft: `next_member()` is None and the engine
  decodes plainly until one appears (as prompt lookup does).
- A linear draft (`propose`, `lookup`): the most frequent continuation, token by token (the more recent
  occurrence on a tie); past the trie's depth it goes on along the text of the most recent occurrence.
- Two members by match length, each with its own draft-length policy (core/members.py): "suffix" and
  "suffix:long" (from `long_match` tokens), as prompt lookup's classes: a long match's continuation is
  accepted almost whole, a short one's mostly not.

Every committed token is appended to this request's text in the cache; `begin` starts a new text (and
drops cached texts its prompt starts with: a conversation's earlier request, which this one resends).
"""

from __future__ import annotations

import mlx.core as mx

from ..sampling import SamplingConfig
from .base import Draft, Verdict
from .suffix_cache import SuffixCache, Text, shared_cache


class SuffixDrafter:
    name = "suffix"
    long_name = "suffix:long"
    needs_hidden = False
    # drafts cost nothing on the device: up to 16, the first burst at 16 (as prompt lookup)
    policy_settings = {"max_k": 16, "bootstrap_k": 16}
    member_settings = {long_name: {"prior_acceptance": 0.9}}

    def __init__(self, cache: SuffixCache | None = None, min_match: int = 2, max_match: int = 12,
                 long_match: int = 8):
        """cache: the suffix cache (None: the process's shared one); min_match / max_match: the shortest
        match that drafts and the longest compared (at most the trie's depth - 1); long_match: where "suffix:long" starts."""
        self.cache = cache if cache is not None else shared_cache()
        max_match = min(max_match, self.cache.depth - 1)  # a match needs room for a continuation in the trie
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match < the trie's depth, got {min_match}, {max_match}")
        if long_match < min_match:
            raise ValueError(f"need long_match >= min_match, got {long_match} < {min_match}")
        self.min_match, self.max_match, self.long_match = min_match, max_match, long_match
        self.members = {self.name: self, self.long_name: self}
        self.primary = self.name
        self.text: Text | None = None
        self._match: tuple = (None, -1, None)  # (text, the cache's version, the match) cached

    @property
    def tokens(self) -> list[int]:
        return self.text.tokens if self.text is not None else []

    def begin(self, tokens: list[int], hidden: mx.array | None = None) -> None:
        self.text = self.cache.new_text(list(tokens))
        self._match = (None, -1, None)

    def commit(self, verdict: Verdict, hidden: mx.array | None = None) -> None:
        self.cache.append(self.text, verdict.tokens)

    def match(self):
        """(length, trie node) of the longest suffix with a continuation in the cache, or None."""
        if self.text is None:
            return None
        key = (self.text, self.cache.version)
        if self._match[:2] != key:
            found = self.cache.match(self.text, self.min_match, self.max_match)
            self._match = (self.text, self.cache.version, found)  # (a re-insertion bumps the version)
        return self._match[2]

    def next_member(self) -> str | None:
        found = self.match()
        if found is None:
            return None
        return self.long_name if found[0] >= self.long_match else self.name

    def lookup(self, k: int) -> list[int]:
        """The k tokens of the most frequent continuation (fewer where it ends), [] without a match."""
        found = self.match() if k > 0 else None
        return self.cache.best_path(found[1], k, self.text.tokens, found[0])[0] if found else []

    def propose(self, k: int, sampling: SamplingConfig, key: mx.array) -> Draft:
        found = self.lookup(k)
        return Draft(mx.array(found, dtype=mx.int32), None, host_tokens=found)

    def max_draft(self) -> int | None:
        return None
