"""A drafter of random token trees for the tree tests: every shape (chains, bushes, deep branches), some
branches following an oracle model's greedy continuation so that paths are accepted at every depth, the
rest random tokens, and siblings that repeat a token (the first is followed)."""

from __future__ import annotations

import random

import mlx.core as mx

from mlx_engine.drafters.base import Draft
from mlx_engine.drafters.tree_draft import TokenTree, check


class RandomTreeDrafter:
    name = "tree-test"
    needs_hidden = False

    def __init__(self, oracle, vocab: int, seed: int = 0, follow: float = 0.7, shape: str = "random"):
        """oracle: a model whose greedy token a node takes with probability `follow` (None: random tokens
        only); shape: "random" (parent uniform among earlier nodes and the root), "chain", "wide" (every node
        a child of the root)."""
        self.oracle, self.vocab, self.follow, self.shape = oracle, vocab, follow, shape
        self.rng = random.Random(seed)
        self.tokens: list[int] = []
        self.trees: list[TokenTree] = []

    def begin(self, tokens, hidden=None):
        self.tokens = list(tokens)

    def commit(self, verdict, hidden=None):
        self.tokens += verdict.tokens

    def drafts_tree(self, member=None) -> bool:
        return True

    def max_draft(self):
        return None

    def _oracle(self, seq: list[int]) -> int:
        return int(mx.argmax(self.oracle(mx.array(seq)[None])[0, -1]).item())

    def propose_tree(self, k, sampling, key) -> TokenTree:
        parents, tokens = [], []
        for i in range(k):
            if self.shape == "chain":
                p = i - 1
            elif self.shape == "wide":
                p = -1
            else:
                p = self.rng.randrange(-1, i)
            path, q = [], p
            while q >= 0:
                path.append(tokens[q])
                q = parents[q]
            if self.oracle is not None and self.rng.random() < self.follow:
                t = self._oracle(self.tokens + path[::-1])
            else:
                t = self.rng.randrange(self.vocab)
            parents.append(p)
            tokens.append(t)
        check(parents)
        tree = TokenTree(mx.array(tokens, dtype=mx.int32), parents, host_tokens=tokens)
        self.trees.append(tree)
        return tree

    def propose(self, k, sampling, key) -> Draft:
        """The fallback where trees are off: a chain."""
        shape, self.shape = self.shape, "chain"
        tree = self.propose_tree(k, sampling, key)
        self.shape = shape
        return Draft(tree.tokens, None, host_tokens=tree.host_tokens)
