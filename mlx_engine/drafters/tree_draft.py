"""A draft that is a token tree: what a tree-drafting drafter hands the engine (core/tree_verify.py).

Nodes are listed best first (`rank` order: the drafter's own estimate of how likely each node is to be
accepted, highest first) and a node's parent always comes before it, so the first n nodes of a tree are
the best tree of n nodes. parents[i] = -1: a child of the root, the last committed token (not yet fed).
A chain is the tree whose node i has parent i - 1.

Host trees (prompt lookup, the suffix drafter) hold tokens and parents as lists; device trees (MTP top-k
expansion) hold them as lazy arrays, with the ancestor matrix the verify mask is built from, so no host
read happens before the verify pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class TokenTree:
    tokens: mx.array  # [n] int32
    parents: list[int] | mx.array  # [n]: index of the parent node, -1 = the root
    host_tokens: list[int] | None = None  # the tokens on the host, when the drafter holds them there
    ancestors: mx.array | None = None  # [n + 1, n + 1] bool (row 0 = the root), given by device trees
    depths: mx.array | None = None  # [n + 1] int32 (the root 0), given by device trees
    counts: list[int] | None = None  # suffix drafter: occurrences of each node's string (tests, traces)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def on_host(self) -> bool:
        return isinstance(self.parents, list)

    @property
    def is_chain(self) -> bool:
        """Node i's parent is i - 1 (known on the host only: a device tree is never called a chain)."""
        return self.on_host and is_chain(self.parents)


def is_chain(parents: list[int]) -> bool:
    """Node i's parent is i - 1 for every node."""
    return all(p == i - 1 for i, p in enumerate(parents))


def chain(tokens: list[int]) -> TokenTree:
    """The chain tokens[0] -> tokens[1] -> ... as a tree."""
    return TokenTree(mx.array(tokens, dtype=mx.int32), list(range(-1, len(tokens) - 1)), host_tokens=list(tokens))


def host_depths(parents: list[int]) -> list[int]:
    """Depth of every row of the verify pass: row 0 the root (0), row i + 1 node i."""
    out = [0]
    for p in parents:
        out.append(out[p + 1] + 1)
    return out


def host_ancestors(parents: list[int]) -> np.ndarray:
    """[n + 1, n + 1] bool: row r sees row c (c an ancestor of r, or r itself; row 0 the root)."""
    n = len(parents)
    a = np.zeros((n + 1, n + 1), dtype=bool)
    a[0, 0] = True
    for i, p in enumerate(parents):
        a[i + 1] = a[p + 1]
        a[i + 1, i + 1] = True
    return a


def check(parents: list[int]) -> None:
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"node {i}'s parent {p} does not come before it")


def walk(parents: list[int], tokens: list[int], choices: list[int]) -> list[int]:
    """The accepted path: from the root, while the target's choice at the current row is the token of one of
    its children, move to that child. choices[r]: the target's token at row r (row 0 the root, row i + 1
    node i). Returns the accepted nodes' rows (1-based, in order); the emitted tokens are theirs followed by
    the choice at the last row."""
    kids: dict[tuple[int, int], int] = {}
    for i, (p, t) in enumerate(zip(parents, tokens)):
        kids.setdefault((p + 1, t), i + 1)  # the first (best) child with that token
    path, row = [], 0
    while (row, choices[row]) in kids:
        row = kids[(row, choices[row])]
        path.append(row)
    return path
