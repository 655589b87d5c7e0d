"""`mtp-tree`: the MTP head's top-k guesses as a token tree (EAGLE-2 style: a dynamic tree from the
drafter's own confidence), so a weak head's second- and third-best guesses count.

The head runs its usual chain along its best guesses (depth D), and at each depth d keeps its K best
tokens with their probabilities q_d. A candidate (d, r), the r-th best token at depth d, hangs under the
chain's node at depth d - 1 (the root at depth 1) and scores the chain's probability to there times its
own: q_1(best) ... q_{d-1}(best) q_d(r). The tree is the n best candidates (n: the draft-length policy's
budget, chosen from each rank's measured acceptance and the measured cost of a pass of n + 1 rows), best
first; a candidate never scores above its parent (ties go to the shallower), so the n best are a tree.
Everything stays on the device (selection, parents, the ancestor matrix, depths): the verify pass is
built without a host read, and the cycle's one read brings back the picks and the tree together.

Only the chain's best guesses feed the head (its draft-time cache entries are the chain's, as in `mtp`),
so the tree is as deep as the chain and only the chain's nodes have children. The verdict commits like a
chain's: the head's draft-time entries are dropped and the kept path's slots fed with the target's own
hidden states, whichever branch was kept.
"""

from __future__ import annotations

import mlx.core as mx

from ..sampling import SamplingConfig
from ..target_model import cache as cache_ops
from .mtp.drafter import MTPDrafter
from .tree_draft import TokenTree


class MTPTreeDrafter(MTPDrafter):
    name = "mtp-tree"
    # k counts tree nodes, its acceptance is each rank's (core/policy.py `tree`)
    policy_settings = {"max_k": 8, "tree": True}

    def __init__(self, head, target, prefill_step: int = 2048, depth: int = 3, width: int = 4):
        """depth: the head's chain steps at most (the tree's depth); width: best tokens kept per depth."""
        super().__init__(head, target, prefill_step)
        if depth < 1 or width < 1:
            raise ValueError(f"need depth >= 1 and width >= 1, got {depth}, {width}")
        self.depth, self.width = depth, width

    @classmethod
    def of(cls, drafter: MTPDrafter, **kw) -> "MTPTreeDrafter":
        """The tree drafter over a loaded MTP drafter's head."""
        out = cls(drafter.head, drafter.target, drafter.prefill_step, **kw)
        out.kv_quant = drafter.kv_quant
        return out

    def drafts_tree(self, member: str | None = None) -> bool:
        return True

    def _scores(self, i: int, h: mx.array, drafted: list) -> tuple[mx.array, mx.array | None]:
        """Draft step i's scores [S] and the token id of each (None: the scores are over the whole
        vocabulary). With a reduced draft vocabulary only the subset is scored and ranked: the same
        candidates and log-probabilities as the full logits (-inf off the subset) give, 6x fewer to rank."""
        if self._subset is not None and "head" not in self.head.layers[i]:
            return self._subset.scores(h)[0].astype(mx.float32), self._subset.ids
        return self._logits(i, h, drafted).astype(mx.float32)[0], None

    def propose_tree(self, budget: int, sampling: SamplingConfig, key: mx.array) -> TokenTree:
        K = min(self.width, budget)
        D = min(self.depth, budget)
        n = min(budget, D * K)
        self._feed_pending()
        h = self._out
        self._k = D
        n_chain = [0] * self.num_layers  # chained step s (1..D-1) feeds one draft-time entry into layer s % L
        for s in range(1, D):
            n_chain[s % self.num_layers] += 1
        self._ckpt = [cache_ops.checkpoint([c], m) for c, m in zip(self.cache, n_chain)]
        ids, logq, chain = [], [], []
        for d in range(D):
            scores, token_of = self._scores(d % self.num_layers, h, chain)
            if K == 1:  # one guess per depth: the chain itself
                top = mx.argmax(scores, keepdims=True)
            else:
                lp = scores - mx.logsumexp(scores)
                top = mx.argpartition(-lp, K - 1)[:K] if K < lp.shape[0] else mx.arange(lp.shape[0])
                top = top[mx.argsort(-lp[top])]  # best first: top[0] is the chain's token
                logq.append(lp[top])
            top = (top if token_of is None else token_of[top]).astype(mx.int32)
            ids.append(top)
            chain.append(top[:1])
            if d + 1 < D:
                h = self._run((d + 1) % self.num_layers, chain[-1], h)
        if K == 1:  # its shape is known on the host: verified as a chain (no per-row positions)
            return TokenTree(mx.concatenate(chain), list(range(-1, D - 1)))
        ids, logq = mx.stack(ids), mx.stack(logq)  # [D, K]
        chain_lp = mx.cumsum(logq[:, 0])  # log-probability of the chain through depth d
        before = mx.concatenate([mx.zeros((1,)), chain_lp[:-1]])  # ... through depth d - 1
        depth = mx.repeat(mx.arange(D), K)  # candidate c = d * K + r
        rank = mx.tile(mx.arange(K), D)
        score = (before[:, None] + logq).reshape(-1) - 1e-4 * depth - 1e-7 * rank  # ties: shallower, better
        sel = mx.argsort(-score)[:n].astype(mx.int32)  # the n best, best first (a parent before its children)
        d_sel, r_sel = sel // K, sel % K
        parent_cand = (d_sel - 1) * K  # the chain's node one level up
        parent = mx.argmax(sel[None, :] == parent_cand[:, None], axis=1).astype(mx.int32)
        parent = mx.where(d_sel == 0, -1, parent)
        tokens = ids.reshape(-1)[sel]
        # row i + 1 (node i) sees row j + 1 when j is i or a chain node above it; every row sees the root
        on_chain = (r_sel == 0)[None, :] & (d_sel[None, :] < d_sel[:, None])
        nodes = on_chain | mx.eye(n, dtype=mx.bool_)
        ancestors = mx.concatenate([mx.ones((n + 1, 1), mx.bool_),
                                    mx.concatenate([mx.zeros((1, n), mx.bool_), nodes], axis=0)], axis=1)
        depths = mx.concatenate([mx.zeros((1,), mx.int32), (d_sel + 1).astype(mx.int32)])
        return TokenTree(tokens, parent, ancestors=ancestors, depths=depths)
