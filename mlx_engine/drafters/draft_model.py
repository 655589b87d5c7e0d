"""A separate small draft model with the target's tokenizer.

With `vocab_subset` (token ids) the draft scores its final hidden state only against those rows of its own
output matrix (drafters/vocab_subset.py): a cheaper draft step, still lossless.

The draft cache holds every committed token except the last and the `pending` ones (tokens kept after a
rollback, or the last draft after a full accept); `propose` feeds pending + last, then its own drafts.
"""

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..target_model import cache as cache_ops
from ..target_model import prefix_cache as prefix_ops
from .. import host
from ..sampling import SamplingConfig, choose
from .base import Draft, Verdict
from .vocab_subset import SubsetOutput


def _fit_vocab(logits: mx.array, vocab: int) -> mx.array:
    """Crop or pad (-inf) draft logits [n, Vd] to the target's output size."""
    extra = vocab - logits.shape[-1]
    if extra < 0:
        return logits[:, :vocab]
    if extra > 0:
        pad = mx.full((logits.shape[0], extra), -mx.inf, dtype=logits.dtype)
        return mx.concatenate([logits, pad], axis=-1)
    return logits


class DraftModelDrafter:
    name = "draft"
    needs_hidden = False
    kv_quantizable = True
    kv_quant: tuple[int, int] | None = None  # (bits, group size) of its own KV cache (drafters.base.quantize_kv)

    def __init__(self, model: nn.Module, vocab_size: int, prefill_step: int = 2048,
                 vocab_subset: mx.array | None = None):
        self.model = model
        self.vocab_size = vocab_size  # the target's output size
        self.prefill_step = prefill_step
        self._subset = self._draft = None
        if vocab_subset is not None:
            from ..target_model.model import Target

            self._draft = Target(model)  # captures the final-normed hidden state its output layer scores
            dtype = next((v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)),
                         mx.float32)
            self._subset = SubsetOutput(self._draft, vocab_subset, vocab_size, dtype)
        self.cache: list = []
        self.history: list[int] = []
        self.pending: list[int] = []
        self._ckpt = None
        self._k = 0

    def _forward(self, tokens: mx.array) -> mx.array:
        return self.model(tokens[None], cache=self.cache)[0]

    def _next_logits(self, tokens: mx.array) -> mx.array:
        """Feed tokens; logits [1, V] (the target's output size) for the token after the last one."""
        if self._subset is None:
            return _fit_vocab(self._forward(tokens)[-1:], self.vocab_size)
        _, h = self._draft.forward(tokens, self.cache, True)  # the full logits stay lazy, unused
        return self._subset(h[-1:])

    def begin(self, tokens: list[int], hidden: mx.array | None = None) -> None:
        """The prompt is left pending: fed by the first propose, or a piece at a time by prefill_pending."""
        self.cache = cache_ops.make_cache(self.model, *(self.kv_quant or (None,)))
        self.history = list(tokens)
        self.pending = tokens[:-1]

    def prefill_pending(self, limit: int) -> int:
        """Feed up to `limit` pending prompt tokens; returns how many are left to feed this way (the last
        pending token always waits for propose, whose pass needs its logits)."""
        n = min(limit, max(len(self.pending) - 1, 0))
        if n > 0:
            self._forward(mx.array(self.pending[:n]))
            host.wait([c.state for c in self.cache])
            self.pending = self.pending[n:]
        return max(len(self.pending) - 1, 0)

    # -- the prefix tree's share (core/drafter_prefix.py) ------------------------------------------------
    def keepable(self) -> bool:
        """Whether its cache's entries are a function of a prefix's tokens alone (plain KV layers)."""
        return prefix_ops.supported(self.cache or cache_ops.make_cache(self.model)) is None

    def prefix_states(self) -> tuple[list, int]:
        """Its cache entries, position for position the target's: (per-layer states, positions held).
        Between cycles."""
        n = self.cache[0].offset if self.cache else 0
        return (prefix_ops.layer_states(self.cache, n), n) if n else ([], 0)

    def restore(self, states: list, n: int) -> None:
        """After begin(): the first n prompt positions' entries from the prefix tree, not fed again (the
        last pending token still waits for propose)."""
        n = min(n, len(self.pending) - 1)
        if n <= 0:
            return
        prefix_ops.fill(self.cache, states, n)
        self.pending = self.pending[n:]

    def propose(self, k: int, sampling: SamplingConfig, key: mx.array) -> Draft:
        while len(self.pending) > self.prefill_step:  # a long prompt, in chunks
            self.prefill_pending(self.prefill_step)
        feed = self.pending + self.history[-1:]
        self._ckpt = cache_ops.checkpoint(self.cache, len(feed) + k - 1)
        self._k = k
        keys = mx.random.split(key, k)
        window = mx.array(self.history[-sampling.repetition_context :]) if sampling.penalized else None
        x = mx.array(feed)
        tokens, probs = [], []
        for i in range(k):
            logits = self._next_logits(x)
            context = mx.concatenate([window, *tokens]) if window is not None else None
            tok, p = choose(logits, context, sampling, keys[i])
            tokens.append(tok)
            probs.append(p)
            x = tok
        draft_tokens = mx.concatenate(tokens).astype(mx.int32)
        draft_probs = None if sampling.greedy else mx.concatenate(probs)
        return Draft(draft_tokens, draft_probs)

    def commit(self, verdict: Verdict, hidden: mx.array | None = None) -> None:
        n, k = verdict.n_accepted, verdict.n_drafted
        if k == 0:  # nothing was fed this cycle
            self.pending = self.pending + self.history[-1:]
        elif n == k:  # everything fed is kept; the last draft itself was never fed
            self.pending = verdict.tokens[k - 1 : k]
        else:
            kept = self.pending + self.history[-1:] + verdict.tokens[:n]
            replay = cache_ops.rollback(self.cache, self._ckpt, len(kept))
            self.pending = kept[len(kept) - replay :] if replay else []
        self.history += verdict.tokens

    def max_draft(self) -> int | None:
        return None
