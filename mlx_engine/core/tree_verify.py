"""A verify cycle whose draft is a token tree (drafters/tree_draft.py): one target pass over every node,
the longest accepted path kept, the cache compacted to it (target_model/tree_cache.py).

Acceptance, one rule for every temperature: the target picks a token at EVERY row of the pass (greedy: its
argmax; temperature > 0: a sample from its distribution after the sampler chain, one independent uniform
per row), and from the root the path follows the child whose token is the target's pick, while there is
one. The emitted tokens are the path's tokens, then the pick at its last row. Lossless for any drafter,
with or without probabilities: each emitted token is the target's own pick given exactly the tokens before
it (its row's ancestors are those tokens), and a row's uniform is used only if the path reaches the row,
so it is an independent draw at that point; at temperature 0 it is the plain greedy token. (Multi-draft
rejection sampling would accept more often where drafters give probabilities; not done.)

One host read per cycle: the picks of all rows (and, for a device tree, its tokens and parents), then the
walk on the host (with, when asked for, the logprob rows of every row's pick: the path's are kept). Trees
need a cache that compacts (plain or quantized KV caches), no repetition, presence or frequency penalty
(their history differs per branch; a logit bias is the same on every row), and no fixed-row pass;
otherwise `off` says why and the drafter's best chain is verified as before. Batch-invariant (`kernels`)
passes verify trees too, each row bit for bit the decode step at its position (target_model/tree_cache.py);
a device tree's shape is then read before the pass (a second host read per cycle).
"""

from __future__ import annotations

import time

import mlx.core as mx

from .. import host
from ..drafters.base import Verdict
from ..drafters.tree_draft import TokenTree, host_ancestors, host_depths, walk
from ..grammar import apply_bitmask
from ..grammar.trees import kept, legal_nodes, tree_masks
from ..kernels.batch_attention import tree_bits
from ..sampling import SamplingConfig, logprob_rows, probabilities, process_logits, sample
from ..target_model import tree_cache


class Trees:
    """The engine's tree path: whether it can run for this model, and its cycle."""

    def __init__(self, engine):
        self.engine = engine
        self._off: str | None | bool = False  # False: not decided yet
        self.last_path: list[int] = []  # the last cycle's accepted nodes (indices into its tree; traces, tests)
        self.cut = 0  # the last cycle's nodes a grammar cut before the pass

    @property
    def off(self) -> str | None:
        """Why this engine verifies no trees (None: it does)."""
        if self._off is False:
            e = self.engine
            self._off = tree_cache.unsupported(e.target.make_cache(), e.target.model)
            if self._off is None and e.max_rows is not None:
                self._off = tree_cache.install_invariant(e.target.model)
        return self._off

    def wanted(self, member: str | None, sampling: SamplingConfig) -> bool:
        """This cycle verifies a tree: the drafter drafts one for `member` and the engine can verify it."""
        d = self.engine._drafting
        return (d is not None and hasattr(d, "propose_tree") and d.drafts_tree(member)
                and not sampling.penalized and not sampling.counted and self.off is None)

    def cycle(self, k: int, sampling: SamplingConfig, key: mx.array, want_hidden, profile: bool, policy):
        """Propose a tree of up to k nodes, verify, accept, compact, commit.
        -> (nodes drafted, verdict, the drafted tokens, seconds waiting for the device)."""
        e = self.engine
        t = time.perf_counter()
        tree: TokenTree = e._drafting.propose_tree(k, sampling, key)
        matcher, asked = e._matcher, tree.size
        origin = None  # under a grammar: the kept nodes' indices in the drafter's tree
        if matcher is not None:  # the nodes the grammar forbids (and their subtrees) are cut before the pass
            tree, origin = legal_tree(tree, matcher)
        n = tree.size
        self.cut = asked - n
        # the device starts on the drafter's work while Python builds the verify graph
        host.start(tree.tokens, *([] if tree.on_host else [tree.ancestors, tree.depths]))
        if profile:
            host.wait(tree.tokens)
            e.stats.time_draft += time.perf_counter() - t
        start = e.cache[0].offset
        if tree.on_host:
            ancestors = mx.array(host_ancestors(tree.parents))
            # a chain's rows sit at consecutive positions: no per-row RoPE positions needed
            depths = None if tree.is_chain else mx.array(host_depths(tree.parents), dtype=mx.int32)
        else:
            ancestors, depths = tree.ancestors, tree.depths
        bits = None
        if e.max_rows is not None:  # batch-invariant passes: each row's visible rows, on the host
            if tree.on_host:
                bits = tree_bits(host_ancestors(tree.parents))
            else:
                flat = host.read(ancestors.astype(mx.int32).reshape(-1))
                bits = tree_bits([flat[r * (n + 1) : (r + 1) * (n + 1)] for r in range(n + 1)])
        inputs = mx.concatenate([mx.array([e._last], dtype=mx.int32), tree.tokens.astype(mx.int32)])
        with tree_cache.tree_pass(e.cache, ancestors, depths, bits):
            logits, hidden = e.target.forward(inputs, e.cache, want_hidden)
        if profile:
            t = time.perf_counter()
            host.wait(logits)
            e.stats.time_verify += time.perf_counter() - t
        masks = None
        if matcher is not None:  # built on the host while the device runs the pass
            host.start(logits)
            masks = tree_masks(matcher, tree.parents, tree.host_tokens)
        picks = pick(logits, sampling, e._next_key(), masks)
        parts = [picks] + ([] if tree.host_tokens is not None else [tree.tokens.astype(mx.int32)]) \
            + ([] if tree.on_host else [tree.parents.astype(mx.int32)])
        packed = mx.concatenate(parts) if len(parts) > 1 else picks
        n_top = e._logprobs_n
        t_sync = time.perf_counter()
        if n_top is None:
            values, rows = host.read(packed), None  # the cycle's one host read
        else:  # with the logprob row of every row's pick (the emitted tokens are picks along the path)
            values, rows = host.read_all(packed, logprob_rows(logits, picks, n_top))
        waited = time.perf_counter() - t_sync
        if profile:
            e.stats.time_sample += waited
            e.stats.profiled_cycles += 1
        L = n + 1
        choices, rest = values[:L], values[L:]
        tokens = tree.host_tokens if tree.host_tokens is not None else rest[:n]
        parents = tree.parents if tree.on_host else rest[-n:] if n else []
        path = walk(parents, tokens, choices)
        self.last_path = [r - 1 if origin is None else origin[r - 1] for r in path]
        emitted = [tokens[r - 1] for r in path] + [choices[path[-1] if path else 0]]
        # token j of `emitted` is the pick at row ([0] + path)[j]: the root's, then each accepted node's
        e._rows = [rows[r] for r in [0] + path] if rows is not None else None
        if matcher is not None:
            matcher.consume(emitted)
        verdict = Verdict(n, len(path), emitted)
        self._commit([0] + path, start, verdict, hidden)
        adaptive = getattr(policy, "inner", None) or policy  # (the chat's live policy wraps one)
        if getattr(adaptive, "tree", False):  # which ranks were accepted, for the engine's observe() next
            adaptive.observe_tree(asked, self.last_path)
        return n, verdict, list(tokens), waited

    def _commit(self, rows: list[int], start: int, verdict: Verdict, hidden) -> None:
        """Keep the path's rows in the cache, record them as held, advance the drafter."""
        e = self.engine
        tree_cache.compact(e.cache, start, rows)
        kept_hidden = None
        if hidden is not None:
            kept_hidden = hidden if rows == list(range(len(rows))) else hidden[mx.array(rows, dtype=mx.int32)]
        e.held.fed([e._last] + verdict.tokens[: verdict.n_accepted], kept_hidden)
        e._last = verdict.tokens[verdict.n_accepted]
        e._drafting.commit(verdict, kept_hidden)


def legal_tree(tree: TokenTree, matcher) -> tuple[TokenTree, list[int]]:
    """The tree without the nodes a grammar forbids and their subtrees, as a host tree (a device tree is
    read first: under a grammar a tree cycle reads the host twice). -> (tree, kept nodes' indices in `tree`)."""
    if tree.on_host and tree.host_tokens is not None:
        tokens, parents = list(tree.host_tokens), list(tree.parents)
    elif tree.on_host:
        tokens, parents = host.read(tree.tokens.astype(mx.int32)), list(tree.parents)
    else:
        flat = host.read(mx.concatenate([tree.tokens.astype(mx.int32), tree.parents.astype(mx.int32)]))
        tokens, parents = flat[: tree.size], flat[tree.size :]
    keep, new_parents = kept(parents, legal_nodes(matcher, parents, tokens))
    if len(keep) == len(parents) and tree.on_host and tree.host_tokens is not None:
        return tree, keep
    tokens = [tokens[i] for i in keep]
    return TokenTree(mx.array(tokens, dtype=mx.int32), new_parents, host_tokens=tokens), keep


def pick(logits: mx.array, sampling: SamplingConfig, key: mx.array, masks=None) -> mx.array:
    """The target's token at every row: argmax (temperature 0), else one sample per row from the sampler
    chain's distribution, each row with its own uniform; `masks` [rows, W]: a grammar's, applied first."""
    logits = process_logits(logits, None, sampling)
    if masks is not None:
        logits = apply_bitmask(logits, masks)
    if sampling.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    return sample(probabilities(logits, sampling), key).astype(mx.int32)
