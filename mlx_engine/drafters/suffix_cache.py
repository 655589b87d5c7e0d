"""The suffix structure of the `suffix` drafter: one depth-limited suffix trie over many token texts (the
current requests' prompts and outputs, and earlier requests'), with occurrence counts, shared by every
request of a process and bounded by memory (least recently written texts evicted first).

Node s (the path from the root spells a string s of at most `depth` tokens) holds count(s) = the number
of positions where s occurs in the cached texts, and where its most recent occurrence ends. Appending a
token to a text adds one occurrence of each of its last 1..depth suffixes: `depth` steps, kept incremental
by the text's `active` list (active[l] = the node of its last l tokens). So for a context whose last m
tokens spell s, the continuations of s and their counts are s's subtree: count(s + c) occurrences of s
followed by c, read off without scanning the texts (what SuffixDecoding, arXiv 2411.04975, reads its
speculation trees from).

Why a suffix trie cut at a fixed depth, not a suffix automaton or a full suffix tree:
- counts: a trie node's count is exactly its string's occurrence count, kept exact under appends by
  `depth` increments per token; a suffix automaton's occurrence counts (|endpos|) need suffix-link
  propagation to stay right while the text grows;
- deletion: an evicted text is taken out by decrementing the same `depth` nodes per token (a node that
  reaches 0 goes with its subtree, whose counts cannot exceed its own); neither an automaton nor an
  Ukkonen tree can remove a text;
- the continuation tree a draft needs is the node's subtree itself.
The cost is memory, about `depth` nodes per token of text never seen before (~80 bytes each; texts that
repeat share nodes), which is what the byte budget bounds.

A text evicted while its request still writes to it (many requests at once, or a later request whose
prompt supersedes it) is inserted again, whole, at its next write.
"""

from __future__ import annotations

import heapq
from array import array
import itertools
import sys
import threading

DEFAULT_DEPTH = 24
DEFAULT_BYTES = 128 << 20


class _Node:
    """count: occurrences of this node's string; ltext / lpos: the text and index where its most recent
    occurrence ends (None once that text was evicted); one child inline (tok -> kid), further ones in
    `more` (most nodes of a suffix trie over new text have exactly one child)."""

    __slots__ = ("count", "ltext", "lpos", "tok", "kid", "more")

    def __init__(self):
        self.count = 0
        self.ltext = None
        self.lpos = 0
        self.tok = -1
        self.kid = None
        self.more = None

    def child(self, t: int):
        if self.tok == t:
            return self.kid
        return self.more.get(t) if self.more else None

    def children(self):
        if self.kid is not None:
            yield self.tok, self.kid
        if self.more:
            yield from self.more.items()

    def has_children(self) -> bool:
        return self.kid is not None or bool(self.more)

    def recency(self) -> tuple:
        return (self.ltext.order, self.lpos) if self.ltext is not None else (-1, -1)


NODE_BYTES = sys.getsizeof(_Node())
DICT_BYTES = sys.getsizeof({1: None, 2: None})


class Text:
    """One cached token sequence: a request's prompt and output so far."""

    __slots__ = ("tokens", "order", "active", "evicted", "written")

    def __init__(self, order: int):
        self.tokens: list[int] = []
        self.order = order  # creation order: the more recent occurrence wins a tie
        self.active: list = []  # active[l]: the node of the last l tokens, l < depth
        self.evicted = False
        self.written = 0  # the cache's write clock at this text's last write (LRU)


class SuffixCache:
    """Texts and the suffix trie over all of them. Thread safe (one lock): the server's requests share it."""

    def __init__(self, max_bytes: int = DEFAULT_BYTES, depth: int = DEFAULT_DEPTH):
        if depth < 2:
            raise ValueError(f"the suffix trie's depth must be >= 2, got {depth}")
        self.max_bytes, self.depth = max_bytes, depth
        self.root = _Node()
        self.texts: dict[int, Text] = {}  # by order, oldest first
        self.nodes = 0
        self.dicts = 0
        self.tokens = 0
        self._orders = itertools.count()
        self._clock = itertools.count(1)
        self.version = 0  # bumped by every write and removal: a match found before is stale after it
        self.lock = threading.RLock()

    @property
    def nbytes(self) -> int:
        """Estimated bytes held: trie nodes, their child dicts, and the texts' token lists."""
        return self.nodes * NODE_BYTES + self.dicts * DICT_BYTES + 8 * self.tokens

    # -- writing -----------------------------------------------------------------------------------
    def new_text(self, tokens: list[int]) -> Text:
        """A new text holding `tokens`; cached texts that are a prefix of it (a conversation's earlier
        request, whose prompt and answer this one resends) are dropped: their occurrences are in it."""
        with self.lock:
            superseded = [t for t in self.texts.values() if len(t.tokens) <= len(tokens)
                          and tokens[: len(t.tokens)] == t.tokens]
            text = Text(next(self._orders))
            self.texts[text.order] = text
            self.append(text, tokens)  # first: every shared string's most recent occurrence is now in it
            for old in superseded:
                if not old.evicted:
                    self._remove(old)
            return text

    def append(self, text: Text, tokens: list[int]) -> None:
        with self.lock:
            if text.evicted:  # written to after an eviction: back in, whole
                text.evicted, old = False, text.tokens
                text.tokens, text.active = [], []
                self.texts[text.order] = text
                tokens = old + list(tokens)
            for t in tokens:
                self._add(text, t)
            text.written = next(self._clock)
            self.version += 1
            self._evict(keep=text)

    def _add(self, text: Text, t: int) -> None:
        pos = len(text.tokens)
        text.tokens.append(t)
        self.tokens += 1
        new = [self.root]
        last = self.depth - 1
        for length, node in enumerate(text.active or [self.root]):
            c = node.child(t)
            if c is None:
                c = self._link(node, t)
            c.count += 1
            if c.count == 1 or (c.ltext is not None and c.ltext.order <= text.order):  # (None: found on demand)
                c.ltext, c.lpos = text, pos
            if length < last:
                new.append(c)
        text.active = new

    def _link(self, parent: _Node, t: int) -> _Node:
        c = _Node()
        self.nodes += 1
        if parent.kid is None:
            parent.tok, parent.kid = t, c
        else:
            if parent.more is None:
                parent.more = {}
                self.dicts += 1
            parent.more[t] = c
        return c

    def _unlink(self, parent: _Node, t: int) -> None:
        if parent.tok == t and parent.kid is not None:
            if parent.more:  # promote one of the others to the inline slot
                tok = next(iter(parent.more))
                parent.tok, parent.kid = tok, parent.more.pop(tok)
            else:
                parent.tok, parent.kid = -1, None
        else:
            del parent.more[t]
        if parent.more is not None and not parent.more:
            parent.more = None
            self.dicts -= 1

    def clear(self) -> None:
        """Forget every text (a bench pass that must not see answers of an earlier pass); a text still
        written to afterwards goes back in whole, as after an eviction."""
        with self.lock:
            for text in self.texts.values():
                text.evicted, text.active = True, []
            self.root, self.texts = _Node(), {}
            self.nodes = self.dicts = self.tokens = 0
            self.version += 1

    # -- eviction ----------------------------------------------------------------------------------
    def _evict(self, keep: Text | None = None) -> None:
        """Drop the least recently written texts (never `keep`) while over the byte budget."""
        if self.nbytes <= self.max_bytes:
            return
        for text in sorted(self.texts.values(), key=lambda t: t.written):
            if self.nbytes <= self.max_bytes:
                break
            if text is not keep:
                self._remove(text)

    def remove(self, text: Text) -> None:
        with self.lock:
            if not text.evicted:
                self._remove(text)

    def _remove(self, text: Text) -> None:
        """Take one occurrence per suffix of `text` out of the trie (it stays readable by its owner, who
        writes it back whole at its next append)."""
        toks, depth = text.tokens, self.depth
        for start in range(len(toks)):
            node = self.root
            end = min(len(toks), start + depth)
            for i in range(start, end):
                c = node.child(toks[i])
                c.count -= 1
                if c.count == 0:  # its subtree held only this occurrence: a chain to the depth limit
                    self._unlink(node, toks[i])
                    self.nodes -= end - i
                    self._drop_dicts(c)
                    break
                if c.ltext is text:
                    c.ltext = None  # its most recent occurrence is gone; recency unknown
                node = c
        del self.texts[text.order]
        self.version += 1
        self.tokens -= len(toks)
        text.evicted, text.active = True, []

    def _drop_dicts(self, node: _Node) -> None:
        while node is not None:  # a count-1 subtree is a chain: no child dicts, but stay exact anyway
            if node.more:
                self.dicts -= 1
            node = node.kid

    # -- reading -----------------------------------------------------------------------------------
    def match(self, text: Text, min_match: int, max_match: int) -> tuple[int, _Node] | None:
        """(m, node): the longest suffix of `text` (min_match <= m <= max_match, m < depth) that occurred
        followed by a token somewhere in the cache, and its node; None without one."""
        with self.lock:
            if text.evicted:
                self.append(text, [])
            active = text.active
            for m in range(min(max_match, len(active) - 1), min_match - 1, -1):
                if active[m].has_children():
                    return m, active[m]
            return None

    def best_path(self, node: _Node, k: int, context: list[int], m: int) -> tuple[list[int], list[int]]:
        """(tokens, counts): the most frequent continuation of `node`, the string context[-m:], k tokens at
        most, the most recent occurrence (latest text, then latest position) on a tie. Where the trie ends
        (its depth) the path goes on along the text after the last string's most recent occurrence (count
        0 = not counted), `context` (the drafting text's tokens) extended by the path itself when that
        occurrence runs into its end (text repeating with a period)."""
        with self.lock:
            s, toks, counts = list(context[-m:]), [], []
            while len(toks) < k and node.has_children():
                kids = list(node.children())
                top = max(c.count for _, c in kids)
                tied = [(t, c) for t, c in kids if c.count == top]
                t, node = max(tied, key=lambda tc: self._recency(tc[1], s + [tc[0]])) if len(tied) > 1 else tied[0]
                s.append(t)
                toks.append(t)
                counts.append(node.count)
            if len(toks) < k and toks and self._recency(node, s)[0] >= 0:
                src = node.ltext.tokens
                ext = context + toks if src is context else None
                pos = node.lpos + 1
                while len(toks) < k:
                    seq = ext if ext is not None else src
                    if pos >= len(seq):
                        break
                    toks.append(seq[pos])
                    counts.append(0)
                    if ext is not None:
                        ext.append(seq[pos])
                    pos += 1
            return toks, counts

    def _recency(self, node: _Node, string: list[int]) -> tuple:
        """(text order, end index) of the node's most recent occurrence (the latest text, then the latest
        position). When the one it knew was evicted, found again by a search of the texts, newest first
        (rare: a superseding text is written before the texts it replaces go, so only an LRU eviction
        leaves older occurrences to find)."""
        if node.ltext is None:
            pattern = array("i", string).tobytes()
            for text in sorted(self.texts.values(), key=lambda t: -t.order):
                hay = array("i", text.tokens).tobytes()
                at = hay.rfind(pattern)
                while at >= 0 and at % 4:  # a match across token boundaries: look further back
                    at = hay.rfind(pattern, 0, at + len(pattern) - 1)
                if at >= 0:
                    node.ltext, node.lpos = text, at // 4 + len(string) - 1
                    break
        return node.recency()

    def tree(self, node: _Node, budget: int, min_prob: float = 0.0) -> tuple[list[int], list[int], list[int], list[float]]:
        """A speculation tree from `node`'s subtree, best first: (tokens, parents, counts, scores) of up to
        `budget` nodes in decreasing score (a node's parent comes before it; parent -1 = `node` itself).
        score = the product of count(child) / (sum of its siblings' counts) along the path: the empirical
        probability of the path given the match. Nodes scoring below min_prob are left out."""
        with self.lock:
            heap = []
            tie = itertools.count()

            def push(parent_node, parent_idx, score):
                kids = list(parent_node.children())
                total = sum(c.count for _, c in kids)
                for t, c in kids:
                    s = score * c.count / total
                    if s >= min_prob:
                        heapq.heappush(heap, (-s, next(tie), t, c, parent_idx))

            push(node, -1, 1.0)
            tokens, parents, counts, scores = [], [], [], []
            while heap and len(tokens) < budget:
                s, _, t, c, parent = heapq.heappop(heap)
                tokens.append(t)
                parents.append(parent)
                counts.append(c.count)
                scores.append(-s)
                push(c, len(tokens) - 1, -s)
            return tokens, parents, counts, scores


_shared: SuffixCache | None = None
_shared_lock = threading.Lock()


def shared_cache() -> SuffixCache:
    """The process's suffix cache: every suffix drafter built by the registry (CLI, chat, bench, server)
    reads and writes this one, so a request drafts from earlier requests' prompts and outputs."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = SuffixCache()
        return _shared
