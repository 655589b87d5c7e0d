"""The MTP drafter: the target's own multi-token-prediction head(s), run with their own KV cache.

Slot bookkeeping (mtp-heads.md §0). Committed tokens t_0..t_M; the target has fed t_0..t_{M-1} and
produced final-normed hidden states h_0..h_{M-1}. Head slot p takes (Emb(t_{p+1}), h_p) and predicts
t_{p+2}; its KV entry sits at RoPE position p (cache offset == slot index).

- The head cache holds exact (target-conditioned) entries for the committed slots. Slots whose inputs
  are known but not yet fed are *pending* (hidden rows + tokens); they are fed in ONE batch by the next
  `propose` (or `flush`): after `begin` that is the whole prompt, after a verify the accepted slots plus
  the slot of the bonus token.
- `propose(k)`: feed the pending slots (the last one's output h' gives draft 1), then chain k-1 steps on
  the head's own post-norm output h' (several layers: layer (step % L), vLLM style). Those k-1 entries
  are draft-time approximations and are trimmed at `commit`.
- `commit`: trim the approximations, then queue the accepted slots with the TRUE hidden states of the
  verify pass (vLLM #14649): rows 0..n of `hidden` paired with the emitted tokens.
"""

from __future__ import annotations


import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from ...target_model import cache as cache_ops
from ...target_model import prefix_cache as prefix_ops
from ... import host
from ...sampling import SamplingConfig, choose
from ..base import Draft, Verdict
from ..vocab_subset import SubsetOutput


def within(logits: mx.array, allowed: mx.array) -> mx.array:
    """logits [B, V] with the tokens outside `allowed` ([V'] or [B, V'], V' >= V) at -inf, row by row, unless
    that leaves a row none finite (a reduced draft vocabulary may score none of the allowed tokens): that row
    as it was (its draft is cut later)."""
    masked = mx.where(allowed[..., : logits.shape[-1]], logits, mx.array(-mx.inf, logits.dtype))
    return mx.where(mx.any(masked > -mx.inf, axis=-1, keepdims=True), masked, logits)


def sureness(logits: mx.array, probs: mx.array | None) -> mx.array:
    """[B]: the largest probability of each row's draft distribution (`probs` when sampled, else the softmax
    of `logits`): Draft.confidence."""
    return mx.max(probs if probs is not None else mx.softmax(logits.astype(mx.float32), axis=-1), axis=-1)


class MTPLayer(nn.Module):
    """One head: x = eh_proj(cat[enorm(e), hnorm(h)]) -> block -> norm -> h' (lm_head outside).

    `order` is "eh" (DeepSeek, GLM, Qwen, Step) or "he" (MiMo-7B). `head` (optional) is the layer's own
    output projection (Step-3.5 shared_head.output); otherwise the target's lm_head scores h'.
    """

    def __init__(self, hidden: int, eps: float, block: nn.Module, order: str = "eh", own_head: int = 0,
                 norm_cls=nn.RMSNorm):
        super().__init__()
        if order not in ("eh", "he"):
            raise ValueError(f"concat order must be 'eh' or 'he', got {order!r}")
        self.order = order
        self.enorm = norm_cls(hidden, eps=eps)
        self.hnorm = norm_cls(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = block
        self.norm = norm_cls(hidden, eps=eps)
        if own_head:
            self.head = nn.Linear(hidden, own_head, bias=False)

    def project(self, e: mx.array, h: mx.array) -> mx.array:
        a, b = self.enorm(e), self.hnorm(h)
        return self.eh_proj(mx.concatenate([a, b] if self.order == "eh" else [b, a], axis=-1))

    def __call__(self, e: mx.array, h: mx.array, cache, window: int | None = None) -> mx.array:
        """e, h: [L, H] for L consecutive slots -> h' [L, H]."""
        x = self.project(e, h)[None]
        mask = create_attention_mask(x, cache, window_size=window, return_array=True)
        y = self.block(x, mask, cache)
        return self.norm(y)[0]


class MTPHead(nn.Module):
    """The head's layers plus how they run: `windows[i]` (sliding window or None) per layer."""

    def __init__(self, family: str, layers: list[MTPLayer], windows: list[int | None] | None = None):
        super().__init__()
        self.family = family
        self.layers = layers
        self.windows = windows or [None] * len(layers)

    def make_cache(self) -> list:
        return [KVCache() for _ in self.layers]

    @property
    def vocab_subset(self) -> mx.array | None:
        """Reduced draft vocabulary (int32 token ids) or None (the full vocabulary)."""
        return self.__dict__.get("_vocab_subset")

    def set_vocab_subset(self, ids: mx.array | None) -> None:
        # kept outside the parameter tree (nn.Module would store an array as a parameter)
        object.__setattr__(self, "_vocab_subset", None if ids is None else ids.astype(mx.int32))


class MTPDrafter:
    name = "mtp"
    needs_hidden = True
    kv_quantizable = True
    kv_quant: tuple[int, int] | None = None  # (bits, group size) of the head's own KV cache (drafters.base.quantize_kv)

    def __init__(self, head: MTPHead, target, prefill_step: int = 2048):
        from ...target_model.model import Target

        self.head = head
        self.target = target if isinstance(target, Target) else Target(target)
        self.family = head.family
        self.prefill_step = prefill_step
        self.cache: list = []
        self.history: list[int] = []
        self._pend_h: list[mx.array] = []  # target hidden rows of pending slots
        self._pend_tok: list[int] = []  # the token t_{p+1} of each pending slot
        self._out: mx.array | None = None  # h' [1, H] of the last fed slot, when nothing is pending
        self._ckpt = None
        self._k = 0
        # reduced draft vocabulary: the subset's rows of the target's output matrix, gathered once
        self.vocab_subset = head.vocab_subset
        self._subset = None
        if self.vocab_subset is not None:
            self._subset = SubsetOutput(self.target, self.vocab_subset, self.target.vocab_size, self._float_dtype())

    # -- pieces ------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.head.layers)

    def _embed(self, tokens: mx.array) -> mx.array:
        return self.target.embed_tokens(tokens)

    def _run(self, i: int, tokens: mx.array, h: mx.array) -> mx.array:
        return self.head.layers[i](self._embed(tokens), h, self.cache[i], self.head.windows[i])

    def _float_dtype(self):
        for layer in self.head.layers:
            return layer.norm.weight.dtype
        return mx.float32

    def _logits(self, i: int, h: mx.array, drafted: list) -> mx.array:
        """Logits of draft step i from the head output h' [1, H] (`drafted`: the lazy drafts so far).

        With a reduced draft vocabulary h' is scored against the subset's rows only and scattered into
        full-vocabulary logits with -inf elsewhere: the draft puts probability 0 outside the subset."""
        layer = self.head.layers[i]
        if "head" in layer:
            return layer.head(h)
        if self._subset is not None:
            return self._subset(h)
        return self.target.lm_head(h)

    def _on_subset(self, i: int) -> bool:
        """Whether draft step i scores the reduced vocabulary (not a layer's own output head)."""
        return self._subset is not None and "head" not in self.head.layers[i]

    def _greedy_on_subset(self, i: int, sampling: SamplingConfig) -> bool:
        """Whether draft step i is an argmax over the reduced vocabulary with nothing that reads the full
        vocabulary's logits (no logit bias, no penalty; `_subset_argmax`)."""
        return self._on_subset(i) and sampling.greedy and not sampling.logit_bias and not sampling.penalized

    def _subset_argmax(self, h: mx.array, allowed: mx.array | None) -> tuple[mx.array, mx.array]:
        """A greedy draft step on the subset's scores alone: h [B, H] -> (tokens [B] int32, confidences [B]), the
        tokens and confidences that argmax and sureness() give over the scattered full-vocabulary logits (-inf
        off the subset), without building them: on this CPU the scatter, mask and softmax over 49,152 logits
        cost ~2 of a ~7.5 ms step. `allowed` [V'] or [B, V'] bool: a grammar's first position, gathered to the
        subset."""
        scores = self._subset.scores(h).astype(mx.float32)
        if allowed is not None:
            scores = within(scores, mx.take(allowed, self._subset.ids, axis=-1))
        best = mx.argmax(scores, axis=-1)
        return self._subset.ids[best], sureness(scores, None)

    def _pending_hidden(self) -> mx.array:
        """The pending slots' target hidden rows as one array [P, H]."""
        return mx.concatenate(self._pend_h) if len(self._pend_h) > 1 else self._pend_h[0]

    def _feed_pending(self, limit: int | None = None) -> None:
        """Feed the first `limit` pending slots (all: None) through every layer (exact entries), in chunks
        of prefill_step, the last slot alone: only its output h' is read, so the chunks before it compute
        their keys and values only (MLX evaluates what is read). Fed in one chunk with the slots before it,
        its row's output cost that chunk's whole attention and MLP (a 2,048-slot chunk 8k deep: a 2.5 s step
        beside short requests on this CPU, where the keys and values took ~0.04 s)."""
        if not self._pend_tok:
            return
        h_all = self._pending_hidden()
        n = len(self._pend_tok) if limit is None else min(limit, len(self._pend_tok))
        toks = self._pend_tok[:n]
        out = None
        bounds = [(s, min(s + self.prefill_step, n - 1)) for s in range(0, n - 1, self.prefill_step)] + [(n - 1, n)]
        for start, end in bounds:
            tok = mx.array(toks[start:end], dtype=mx.int32)
            h = h_all[start:end]
            for i in range(self.num_layers):
                y = self._run(i, tok, h)
                if i == 0:
                    out = y
            if end < n or n < len(self._pend_tok):
                host.wait([c.state for c in self.cache])
        self._out = out[-1:]
        if n < len(self._pend_tok):
            self._pend_h, self._pend_tok = [h_all[n:]], self._pend_tok[n:]
        else:
            self._pend_h, self._pend_tok = [], []

    def prefill_pending(self, limit: int) -> int:
        """Feed up to `limit` of the slots begin() left pending (a long prompt's, a piece at a time: the
        batch engine interleaves them with other sequences' steps). Returns how many are still pending."""
        self._feed_pending(limit)
        return len(self._pend_tok)

    def flush(self) -> None:
        """Feed the pending slots now (tests inspect the cache after it; propose does it anyway)."""
        self._feed_pending()

    # -- the prefix tree's share (core/drafter_prefix.py) ------------------------------------------------
    def keepable(self) -> bool:
        """Whether the head's entries are a function of a prefix's tokens alone (not a sliding window)."""
        return all(w is None for w in self.head.windows) and prefix_ops.supported(self.cache or
                                                                                  self.head.make_cache()) is None

    def prefix_states(self) -> tuple[list, int]:
        """The head's entries in the prefix tree's position frame: slot p (the hidden row of position p and
        token p + 1) at position p + 1, position 0 empty (zeros). -> (per-layer states, positions covered:
        the fed slots + 1). Between cycles (no chained draft-time entries)."""
        if not self.cache or self.cache[0].offset == 0:
            return [], 0
        return prefix_ops.shifted([(c.keys, c.values) for c in self.cache], self.cache[0].offset)

    def restore(self, states: list, n: int) -> None:
        """After begin(): the first n positions' entries from the prefix tree (states in its frame): slots
        0..n-2 are not fed again."""
        slots = min(n - 1, len(self._pend_tok))
        if slots <= 0:
            return
        prefix_ops.fill(self.cache, states, slots, start=1)
        h_all = self._pending_hidden()
        self._pend_h, self._pend_tok = [h_all[slots:]], self._pend_tok[slots:]

    # -- the protocol ------------------------------------------------------------------------------
    def begin(self, tokens: list[int], hidden: mx.array | None) -> None:
        if hidden is None:
            raise ValueError("the MTP drafter needs the target's hidden states (needs_hidden)")
        n = len(tokens) - 1  # fed prompt tokens
        if hidden.shape[0] != n:
            raise ValueError(f"expected hidden states for {n} prompt tokens, got {hidden.shape[0]}")
        self.cache = cache_ops.quantized(self.head.make_cache(), *(self.kv_quant or (None,)))
        self.history = list(tokens)
        self._pend_h = [hidden]
        self._pend_tok = list(tokens[1:])  # slot p takes t_{p+1}, p = 0..n-1 (slot n-1: the first token)
        self._out = None
        self._ckpt = None

    takes_first_allowed = True  # propose(first_allowed=): a grammar's mask of the first draft position

    def propose(self, k: int, sampling: SamplingConfig, key: mx.array, first_allowed: mx.array | None = None) -> Draft:
        """`first_allowed` [V] bool: the tokens a grammar allows at the first draft position; the first token is
        chosen among them (from the head's distribution restricted to them) when the subset scores any."""
        self._feed_pending()
        h = self._out
        self._k = k
        # chained step s (1..k-1) feeds one draft-time entry into layer s % L: checkpoint each layer
        n_chain = [0] * self.num_layers
        for s in range(1, k):
            n_chain[s % self.num_layers] += 1
        self._ckpt = [cache_ops.checkpoint([c], n) for c, n in zip(self.cache, n_chain)]
        keys = mx.random.split(key, k)
        window = mx.array(self.history[-sampling.repetition_context :]) if sampling.penalized else None
        tokens, probs, confidence = [], [], []
        for i in range(k):
            li = i % self.num_layers
            allowed = first_allowed if i == 0 else None
            if self._greedy_on_subset(li, sampling):
                (tok, sure), p = self._subset_argmax(h, allowed), None
            else:
                logits = self._logits(li, h, tokens)
                if allowed is not None:
                    logits = within(logits, allowed)
                context = mx.concatenate([window, *tokens]) if window is not None else None
                tok, p = choose(logits, context, sampling, keys[i])
                tok, sure = tok.astype(mx.int32), sureness(logits, p)
            tokens.append(tok)
            probs.append(p)
            confidence.append(sure)
            if i + 1 < k:
                h = self._run((i + 1) % self.num_layers, tok, h)
        draft_tokens = mx.concatenate(tokens)
        draft_probs = None if sampling.greedy else mx.concatenate(probs)
        return Draft(draft_tokens, draft_probs, confidence=mx.concatenate(confidence))

    def commit(self, verdict: Verdict, hidden: mx.array | None) -> None:
        n, k = verdict.n_accepted, verdict.n_drafted
        if hidden is None or hidden.shape[0] < n + 1:
            raise ValueError("the MTP drafter needs the verify pass's hidden states for the kept inputs")
        if k > 0 and self._ckpt is not None:
            # drop the k-1 chained draft-time entries; the first slot was fed with the true hidden
            for c, ckpt in zip(self.cache, self._ckpt):
                cache_ops.rollback([c], ckpt, 0)
        self._ckpt = None
        # slots for inputs [last, d_1..d_n]: (h of that input, the token after it)
        self._pend_h.append(hidden[: n + 1])
        self._pend_tok.extend(verdict.tokens[: n + 1])
        self._out = None
        self.history += verdict.tokens

    def max_draft(self) -> int | None:
        return None
