"""The `suffix` drafter (SuffixDecoding, arXiv 2411.04975): continuations of the longest suffix of the
context found in a suffix trie over this request's prompt and output and earlier requests' prompts and
outputs (drafters/suffix_cache.py, shared by every request of the process), scored by how often each
continuation followed the match.

- The match: the longest suffix of the committed tokens (min_match..max_match tokens) that occurred
  somewhere in the cache followed by a token. No match, no draft: `next_member()` is None and the engine
  decodes plainly until one appears (as prompt lookup does).
- A linear draft (`propose`, `lookup`): the most frequent continuation, token by token (the more recent
  occurrence on a tie); past the trie's depth it goes on along the text of the most recent occurrence.
- A tree draft (`propose_tree`, core/tree_verify.py): the match's subtree best first, a node scoring the
  empirical probability of its path (product of count(child) / count of all its siblings), up to the
  budget the draft-length policy gives (its `tree` mode: the size from each rank's measured acceptance and
  the measured cost of a pass of that many rows), nodes below `min_prob` left out (SuffixDecoding's
  min_token_prob); a tree with no branch goes on as the best path past the trie's depth.
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
from .tree_draft import TokenTree, chain, is_chain


class SuffixDrafter:
    name = "suffix"
    long_name = "suffix:long"
    needs_hidden = False
    # drafts cost nothing on the device: up to 16, the first burst at 16 (as prompt lookup); k counts tree
    # nodes, its acceptance is each rank's (policy `tree`: E(n) = 1 + the sum of the ranks' acceptance)
    policy_settings = {"max_k": 16, "bootstrap_k": 16, "tree": True}
    member_settings = {long_name: {"prior_acceptance": 0.9}}

    def __init__(self, cache: SuffixCache | None = None, min_match: int = 2, max_match: int = 12,
                 long_match: int = 8, min_prob: float = 0.1, trees: bool = True):
        """cache: the suffix cache (None: the process's shared one); min_match / max_match: the shortest
        match that drafts and the longest compared (at most the trie's depth - 1); long_match: where "suffix:long" starts; min_prob: tree nodes
        whose path probability is lower are not drafted; trees: draft trees where the engine verifies them
        (False: always the best path)."""
        self.cache = cache if cache is not None else shared_cache()
        max_match = min(max_match, self.cache.depth - 1)  # a match needs room for a continuation in the trie
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match < the trie's depth, got {min_match}, {max_match}")
        if long_match < min_match:
            raise ValueError(f"need long_match >= min_match, got {long_match} < {min_match}")
        self.min_match, self.max_match, self.long_match = min_match, max_match, long_match
        self.min_prob, self.trees = min_prob, trees
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

    def drafts_tree(self, member: str | None = None) -> bool:
        return self.trees

    def propose_tree(self, budget: int, sampling: SamplingConfig, key: mx.array) -> TokenTree:
        """The match's continuations best first, up to `budget` nodes; a tree without a branch goes on as
        the best path (past the trie's depth, and past min_prob: as a linear draft does)."""
        found = self.match() if budget > 0 else None
        if not found:
            return chain([])
        tokens, parents, counts, _ = self.cache.tree(found[1], budget, self.min_prob)
        if len(tokens) < budget and is_chain(parents):
            path = self.lookup(budget)
            if len(path) > len(tokens):
                return chain(path)
        return TokenTree(mx.array(tokens, dtype=mx.int32), parents, host_tokens=tokens, counts=counts)

    def max_draft(self) -> int | None:
        return None


def private_cache(drafter, caches: list):
    """Give `drafter`'s suffix member (itself, or a chain's lookup member) a suffix cache of its own, added to
    `caches`; other drafters are returned as they are. The bench runs each mode over its own cache."""
    suffix = drafter if isinstance(drafter, SuffixDrafter) else getattr(drafter, "ngram", None)
    if isinstance(suffix, SuffixDrafter):
        suffix.cache = SuffixCache(suffix.cache.max_bytes, suffix.cache.depth)
        caches.append(suffix.cache)
    return drafter
