"""A grammar over a token tree: which nodes it allows, and every row's mask.

Node i (tokens[i], parent parents[i], -1 = the root; a parent before its child) is legal when its parent
is and its token is allowed after its ancestors' tokens. Row 0 of a tree's verify pass is the root, row
i + 1 node i; a row's mask is the grammar's after the tokens of the path to it. The matcher walks the tree
depth by depth along each node's path, rolling back only what two consecutive paths do not share, and is
left as it started.
"""

from __future__ import annotations

import numpy as np


def _paths(parents: list[int], tokens: list[int]) -> list[list[int]]:
    """Each node's path of tokens from the root, itself included."""
    out: list[list[int]] = []
    for p, t in zip(parents, tokens):
        out.append((out[p] if p >= 0 else []) + [int(t)])
    return out


class _Walker:
    """The matcher moved from path to path, rolling back to their common prefix."""

    def __init__(self, matcher):
        self.matcher, self.at = matcher, []

    def go(self, path: list[int]) -> None:
        common = 0
        while common < min(len(path), len(self.at)) and path[common] == self.at[common]:
            common += 1
        self.matcher.rollback(len(self.at) - common)
        self.matcher.consume(path[common:])
        self.at = list(path)

    def home(self) -> None:
        self.go([])


def legal_nodes(matcher, parents: list[int], tokens: list[int]) -> list[bool]:
    """Whether each node is legal (its path allowed token by token; an end-of-answer token ends a path)."""
    walker, paths, ok = _Walker(matcher), _paths(parents, tokens), []
    eos = matcher.eos
    for i, (p, path) in enumerate(zip(parents, paths)):
        parent_ok = p < 0 or (ok[p] and path[-2] not in eos)
        if not parent_ok:
            ok.append(False)
            continue
        walker.go(path[:-1])
        ok.append(matcher.legal(path[-1:]) == 1)
    walker.home()
    return ok


def tree_masks(matcher, parents: list[int], tokens: list[int]) -> np.ndarray:
    """[n + 1, W]: the mask of every row (all nodes legal; `legal_nodes` first). A row whose path holds an
    end-of-answer token allows only end-of-answer tokens."""
    walker, paths = _Walker(matcher), _paths(parents, tokens)
    out = np.empty((len(parents) + 1, matcher.words), dtype=np.int32)
    matcher.fill(out[0])
    for i, path in enumerate(paths):
        if any(t in matcher.eos for t in path):
            matcher.fill_ended(out[i + 1])
            continue
        walker.go(path)
        matcher.fill(out[i + 1])
    walker.home()
    return out


def kept(parents: list[int], legal: list[bool]) -> tuple[list[int], list[int]]:
    """(indices of the legal nodes, their parents renumbered among them)."""
    index, keep, new_parents = {}, [], []
    for i, (p, ok) in enumerate(zip(parents, legal)):
        if ok:
            index[i] = len(keep)
            keep.append(i)
            new_parents.append(index[p] if p >= 0 else -1)
    return keep, new_parents
