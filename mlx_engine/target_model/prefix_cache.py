"""A prefix cache shared across requests: a radix tree over token ids whose edges hold the KV entries of
their tokens, bounded by a memory budget, least recently used leaves evicted first.

Agents resend the whole conversation every turn and editors the same file; the keys and values of a
prompt's first n tokens depend on those n tokens only, so any request whose prompt starts with a cached
run of tokens can start from a copy of their entries instead of prefilling them again.

    tree: root -> edge "sys prompt + turn 1" -> edge "turn 2 ..." (branches where two prompts part)

An edge holds, per layer, the cache state of its tokens (keys/values [1, H, n, D], or a quantized cache's
(data, scales, biases) triples: any tuple tree whose arrays have the token axis at -2) and optionally the
target hidden rows a drafter reads ([n, H']), and optionally the drafter's own cache entries of those
positions (an MTP head's or a draft model's KV, in the tree's position frame: `drafter_states` of the
drafter), so a hit costs the drafter no re-feed either. An edge stored without them (a row that left
before its drafter was fed) is filled in when a later sequence with them passes along it; a lookup
returns them for the leading edges that have them. Edges split at the token where a new sequence leaves
them, so reuse is exact to the token. Stored arrays are copies: the tree never keeps a live cache alive.

Only caches whose entries are a function of their own tokens (KVCache, QuantizedKVCache) can be cached
this way; `supported(cache)` says why not for the rest (recurrent states, rotating windows) in a single
sequence's cache (the batch engine keeps a window's every entry, target_model/batch_cache.py).

Recurrent layers (a hybrid model's GatedDeltaNet) have no per-token entries: a tree made with
`checkpoints=True` keeps, besides the other layers' entries along the edges, CHECKPOINTS of the recurrent
states at chosen node ends (`insert(..., checkpoint=...)`: the states after exactly those tokens). A lookup
then takes the deepest checkpoint at or before the longest cached prefix (`match` says where, `depth` how
far the tokens go): the caller restores it and feeds the rest. Where the checkpoints go is the caller's
choice (core/batch_rows.py: where requests part, prompt ends, a stride through long prompts).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from .. import host


def _slice(state, start: int, end: int | None = None):
    """Positions start..end of every array in a layer's state (token axis -2), as copies."""
    return tree_map(lambda a: mx.contiguous(a[..., start:end, :]), state)


def _view(state, start: int, end: int | None = None):
    """Positions start..end of every array in a layer's state, as views (no copy)."""
    return tree_map(lambda a: a[..., start:end, :], state)


def _concat(states: list):
    """Layer states of consecutive runs of tokens, joined along the token axis."""
    if len(states) == 1:
        return states[0]
    flat = [tree_flatten(s) for s in states]
    joined = [mx.concatenate([f[i][1] for f in flat], axis=-2) for i in range(len(flat[0]))]
    it = iter(joined)
    return tree_map(lambda _: next(it), states[0])


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two token lists share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _nbytes(tree) -> int:
    return sum(a.nbytes for _, a in tree_flatten(tree))


def supported(cache: list) -> str | None:
    """None when every layer of this single-sequence cache can be stored by prefix, else why not."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    for c in cache:
        if type(c) not in (KVCache, QuantizedKVCache):
            return f"its cache has {type(c).__name__} layers, whose state is not a function of a prefix's tokens alone"
    return None


def layer_states(cache: list, n: int) -> list:
    """The first n positions of each layer of a single-sequence KVCache / QuantizedKVCache (views)."""
    return [tree_map(lambda a: a[..., :n, :], (c.keys, c.values)) for c in cache]


def shifted(states: list, n: int) -> tuple[list, int]:
    """The first n entries of per-layer states moved one position on, position 0 zeros: (states, n + 1).
    For a drafter whose entry p belongs to the prefix of p + 2 tokens (an MTP head's slot p reads the
    hidden row of position p and token p + 1), so the tree slices it with the target's entries."""
    def move(a):
        pad = mx.zeros(a.shape[:-2] + (1, a.shape[-1]), a.dtype)
        return mx.concatenate([pad, a[..., :n, :]], axis=-2)
    return [tree_map(move, s) for s in states], n + 1


def fill(cache: list, states: list, n: int, start: int = 0) -> None:
    """Load positions start..start + n of layer states into fresh single-sequence caches (the inverse of
    layer_states; start 1 undoes `shifted`)."""
    for c, state in zip(cache, states):
        c.keys, c.values = tree_map(lambda a: a[..., start : start + n, :], state)
        c.offset = n


class _Node:
    __slots__ = ("tokens", "layers", "hidden", "drafter", "checkpoint", "children", "parent", "used", "nbytes")

    def __init__(self, tokens: list[int], layers: list, hidden, parent: "_Node | None", drafter: list | None = None):
        self.tokens, self.layers, self.hidden, self.parent = tokens, layers, hidden, parent
        self.drafter = drafter  # the drafter's per-layer states of these positions, or None
        self.checkpoint = None  # the recurrent layers' states after this node's last token, or None
        self.children: dict[int, _Node] = {}
        self.used = 0
        self.nbytes = _nbytes(layers) + (hidden.nbytes if hidden is not None else 0) + _nbytes(drafter or [])


@dataclass
class Hit:
    """What a lookup found: the first n tokens' layer states [1, H, n, D] (per layer) and hidden rows; the
    drafter's states of the first drafter_n of them (0: none stored)."""

    n: int
    layers: list | None = None
    hidden: mx.array | None = None
    drafter: list | None = None
    drafter_n: int = 0
    checkpoint: list | None = None  # the recurrent layers' states after the n tokens (a checkpoint tree)


class PrefixCache:
    """Radix tree of cached prefixes. Call from one thread (the engine's)."""

    def __init__(self, budget_bytes: int, with_hidden: bool = False, min_tokens: int = 16,
                 checkpoints: bool = False, disk=None):
        """budget_bytes: the most the stored entries may hold (least recently used leaves go first).
        with_hidden: store and return the target hidden rows a drafter reads along with the entries.
        min_tokens: shorter hits are not worth a copy (returned as n = 0). checkpoints: the model has
        recurrent layers: a hit ends at a checkpoint of their states. disk: a disk tier
        (target_model/disk_tier.py): what is stored goes to disk too, and a lookup the tree misses is read
        from there back into the tree."""
        self.budget = int(budget_bytes)
        self.with_hidden = with_hidden
        self.min_tokens = min_tokens
        self.checkpoints = checkpoints
        self.disk = disk
        self.root = _Node([], [], None, None)
        self.nbytes = 0
        self._tick = 0
        self.lookups = self.hits = self.hit_tokens = self.evicted_tokens = 0

    # -- reading -----------------------------------------------------------------------------------------
    def _walk(self, tokens: list[int]):
        """[(node, tokens matched on its edge)] along the longest cached prefix of tokens."""
        path, node, pos = [], self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            m = 0
            edge = child.tokens
            while m < len(edge) and pos + m < len(tokens) and edge[m] == tokens[pos + m]:
                m += 1
            path.append((child, m))
            pos += m
            if m < len(edge):
                break
            node = child
        return path

    def _usable(self, path: list) -> list:
        """The part of `path` a hit may use: all of it, or in a checkpoint tree up to the deepest node end
        holding a checkpoint."""
        if not self.checkpoints:
            return path
        end = 0
        for j, (node, m) in enumerate(path):
            if m < len(node.tokens):
                break
            if node.checkpoint is not None:
                end = j + 1
        return path[:end]

    def match(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` a hit would restore, from RAM or disk (nothing copied or read)."""
        ram = sum(m for _, m in self._usable(self._walk(tokens)))
        return max(ram, self.disk.match(tokens)) if self.disk is not None else ram

    def depth(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` the tree holds (a checkpoint tree's hit may restore fewer:
        `match`)."""
        return sum(m for _, m in self._walk(tokens))

    def lookup(self, tokens: list[int]) -> Hit:
        """The longest cached prefix of `tokens` (in a checkpoint tree: up to its deepest checkpoint): its
        layer states (lazy copies), hidden rows, drafter states and checkpoint."""
        self.lookups += 1
        path = self._usable(self._walk(tokens))
        n = sum(m for _, m in path)
        if self.disk is not None and self.disk.match(tokens) > max(n, self.min_tokens - 1):
            loaded = self.disk.load(tokens)  # read back into the tree, then found there
            if loaded is not None and loaded.n > n:
                self._from_disk(tokens, loaded)
                path = self._usable(self._walk(tokens))
                n = sum(m for _, m in path)
        if n < self.min_tokens:
            return Hit(0)
        self._tick += 1
        for node, _ in path:
            node.used = self._tick
        parts = [node.layers if m == len(node.tokens) else [_slice(s, 0, m) for s in node.layers] for node, m in path]
        layers = [_concat([p[i] for p in parts]) for i in range(len(parts[0]))]
        hidden = None
        if self.with_hidden:
            hidden = mx.concatenate([node.hidden[:m] for node, m in path]) if len(path) > 1 else path[0][0].hidden[:n]
        self.hits += 1
        self.hit_tokens += n
        kept = []  # the leading edges holding the drafter's states
        for node, m in path:
            if node.drafter is None:
                break
            kept.append(node.drafter if m == len(node.tokens) else [_slice(s, 0, m) for s in node.drafter])
        drafter = [_concat([p[i] for p in kept]) for i in range(len(kept[0]))] if kept else None
        drafter_n = sum(m for _, m in path[: len(kept)])
        checkpoint = path[-1][0].checkpoint if self.checkpoints else None
        return Hit(n, layers, hidden, drafter, drafter_n, checkpoint)

    def span(self, tokens: list[int], start: int, end: int):
        """What the tree holds of tokens[start:end] (lazy slices), for the disk tier: (per-layer states, hidden
        rows, the drafter's states of the leading positions whose edges have them (or None), the checkpoint
        after `end` when a node ends there). None when the tree does not hold tokens[:end]."""
        path = self._walk(tokens[:end])
        if not path or sum(m for _, m in path) < end:
            return None
        layers, hidden, drafter, pos, leading = [], [], [], 0, True
        for node, m in path:
            a, b = max(start, pos), min(end, pos + m)
            if a < b:
                layers.append([_view(s, a - pos, b - pos) for s in node.layers])
                if node.hidden is not None:
                    hidden.append(node.hidden[a - pos : b - pos])
                leading = leading and node.drafter is not None
                if leading:
                    drafter.append([_view(s, a - pos, b - pos) for s in node.drafter])
            pos += m
        last, m = path[-1]
        checkpoint = last.checkpoint if m == len(last.tokens) else None
        joined = [_concat([p[i] for p in layers]) for i in range(len(layers[0]))]
        rows = mx.concatenate(hidden) if self.with_hidden and hidden else None
        kept = [_concat([p[i] for p in drafter]) for i in range(len(drafter[0]))] if drafter else None
        return joined, rows, kept, checkpoint

    def _from_disk(self, tokens: list[int], loaded) -> None:
        """A disk tier's load of tokens[:loaded.n] into the tree, piece by piece (its arrays are new: kept,
        not copied, each piece an edge of its own)."""
        for p in loaded.pieces:
            if p.drafter is not None and p.drafter_n:
                d = p.start + p.drafter_n
                self._insert(tokens[:d], p.layers, p.hidden[: p.drafter_n] if p.hidden is not None else None,
                             False, p.drafter, offset=p.start)
            self._insert(tokens[: p.end], p.layers, p.hidden, False, None, offset=p.start)
        if loaded.checkpoint is not None:
            self._checkpoint(tokens[: loaded.n], loaded.checkpoint, False)

    # -- writing -----------------------------------------------------------------------------------------
    def insert(self, tokens: list[int], layers: list, hidden: mx.array | None = None, copy: bool = True,
               drafter: list | None = None, checkpoint: list | None = None) -> int:
        """Store the entries of `tokens` (layers: per layer, a state holding at least len(tokens) positions,
        e.g. layer_states(cache, n); hidden: their hidden rows when the tree keeps them; drafter: the
        drafter's per-layer states of the same positions, or None; checkpoint: a checkpoint tree's recurrent
        states after exactly these tokens, or None). Only the part not cached yet is stored: copied, or with
        copy=False kept as views of the caller's arrays (a cache it hands over and will not write again: no
        copy, no wait); edges on the way that lack the drafter's states take them. Returns the tokens newly
        stored."""
        if self.with_hidden and hidden is None:
            raise ValueError("this prefix cache keeps hidden rows: insert needs them")
        stored = self._insert(tokens, layers, hidden, copy, drafter)
        if checkpoint is not None and tokens:
            self._checkpoint(tokens, checkpoint, copy)
        if self.disk is not None and tokens:
            self.disk.offer(self, tokens)
        return stored

    def _checkpoint(self, tokens: list[int], states: list, copy: bool) -> None:
        """The recurrent states after `tokens` (stored just before) on the node ending there."""
        path = self._walk(tokens)
        if sum(m for _, m in path) != len(tokens):  # (not all stored: over the budget)
            return
        node, m = path[-1]
        if m < len(node.tokens):  # tokens end inside an edge: cut it there
            node = self._split(node, m)
        if node.checkpoint is not None:  # the same tokens: the same states
            return
        node.checkpoint = [tree_map(mx.contiguous, s) for s in states] if copy else list(states)
        extra = _nbytes(node.checkpoint)
        node.nbytes += extra
        self.nbytes += extra
        if copy:
            host.wait(node.checkpoint)
        self._evict(keep=node)

    def _insert(self, tokens: list[int], layers: list, hidden, copy: bool, drafter: list | None,
                offset: int = 0) -> int:
        """insert's work; `offset`: the given states start at that token position (a disk piece's), which
        every part of `tokens` not yet stored is at or after."""
        path = self._walk(tokens)
        self._tick += 1
        cut = _slice if copy else _view
        node, pos = self.root, 0
        filled = []
        for child, m in path:
            if m < len(child.tokens):  # the new sequence leaves this edge at m: split it there
                child = self._split(child, m)
            child.used = self._tick
            if drafter is not None and child.drafter is None and pos >= offset:
                child.drafter = [cut(s, pos - offset, pos - offset + m) for s in drafter]
                child.nbytes += _nbytes(child.drafter)
                self.nbytes += _nbytes(child.drafter)
                filled += child.drafter
            node, pos = child, pos + m
        if pos >= len(tokens):
            if copy and filled:
                host.wait(filled)
            self._evict()
            return 0
        a, b = pos - offset, len(tokens) - offset  # (the new positions in the given states)
        new = _Node(list(tokens[pos:]), [cut(s, a, b) for s in layers],
                    cut(hidden[None, None], a, b)[0, 0] if self.with_hidden else None, node,
                    [cut(s, a, b) for s in drafter] if drafter is not None else None)
        new.used = self._tick
        node.children[tokens[pos]] = new
        self.nbytes += new.nbytes
        if copy:  # copy now: the source moves on
            host.wait(new.layers, *([new.hidden] if new.hidden is not None else []), new.drafter or [], filled)
        self._evict(keep=new)
        return len(tokens) - pos

    def _split(self, node: _Node, m: int) -> _Node:
        """Cut node's edge after m tokens: returns the new upper node (the old one keeps the rest)."""
        upper = _Node(node.tokens[:m], [_slice(s, 0, m) for s in node.layers],
                      mx.contiguous(node.hidden[:m]) if node.hidden is not None else None, node.parent,
                      [_slice(s, 0, m) for s in node.drafter] if node.drafter is not None else None)
        upper.used = node.used
        node.parent.children[node.tokens[0]] = upper
        rest = _Node(node.tokens[m:], [_slice(s, m) for s in node.layers],
                     mx.contiguous(node.hidden[m:]) if node.hidden is not None else None, upper,
                     [_slice(s, m) for s in node.drafter] if node.drafter is not None else None)
        rest.used, rest.children = node.used, node.children
        if node.checkpoint is not None:  # (the states after the edge's last token: the lower part's end)
            rest.checkpoint = node.checkpoint
            rest.nbytes += _nbytes(node.checkpoint)
        for c in rest.children.values():
            c.parent = rest
        upper.children[rest.tokens[0]] = rest
        self.nbytes += upper.nbytes + rest.nbytes - node.nbytes
        return upper

    def _evict(self, keep: _Node | None = None) -> None:
        """Drop least recently used leaves until the budget holds; `keep` (the edge just stored) last."""
        while self.nbytes > self.budget:
            leaves = [n for n in self._nodes() if not n.children]
            if not leaves:
                return
            others = [n for n in leaves if n is not keep]
            self._remove(min(others, key=lambda n: n.used) if others else keep)

    def _remove(self, node: _Node) -> None:
        del node.parent.children[node.tokens[0]]
        self.nbytes -= node.nbytes
        self.evicted_tokens += len(node.tokens)

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def clear(self) -> None:
        self.root.children.clear()
        self.nbytes = 0

    @property
    def tokens(self) -> int:
        """Token positions stored (a token shared by several prompts counts once)."""
        return sum(len(n.tokens) for n in self._nodes())

    @property
    def checkpoint_count(self) -> int:
        return sum(n.checkpoint is not None for n in self._nodes())

    def status(self) -> dict:
        out = {"bytes": self.nbytes, "budget_bytes": self.budget, "tokens": self.tokens, "lookups": self.lookups,
               "hits": self.hits, "hit_tokens": self.hit_tokens, "evicted_tokens": self.evicted_tokens}
        if self.checkpoints:
            out["checkpoints"] = self.checkpoint_count
        if self.disk is not None:
            out["disk"] = self.disk.status()
        return out
