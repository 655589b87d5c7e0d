"""What every trainer here feeds its head: training windows over the corpus, their order per step (a
function of the seed and the step, so a resumed run sees the same data), the draft vocabulary subset, and
the learning-rate schedule."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np


def choose_subset(seqs, n: int, vocab: int, always=()) -> np.ndarray:
    """The n most frequent tokens of the corpus (+ `always`, e.g. the stop tokens), sorted."""
    counts = np.bincount(np.concatenate([t for t, _ in seqs]), minlength=vocab)[:vocab].astype(np.float64)
    for t in always:
        if 0 <= t < vocab:
            counts[t] = np.inf
    ids = np.argsort(-counts, kind="stable")[: min(n, vocab)]
    return np.sort(ids).astype(np.int32)


def make_windows(seqs, seq_len: int):
    """Slots grouped in windows of seq_len consecutive slots of one sequence.

    Returns (tokens [N], hidden [N, H], hid_idx, tok_idx, mask) with index arrays [W, seq_len]: slot p of
    a sequence reads hidden[p] and token[p+1] and its teacher hidden[p+1] (= hid_idx + 1)."""
    tokens = np.concatenate([t for t, _ in seqs]).astype(np.int32)
    hidden = np.concatenate([h for _, h in seqs])
    hid_idx, mask = [], []
    off = 0
    for t, _ in seqs:
        n_slots = len(t) - 1  # slots p = 0..n-2 (needs hidden[p+1])
        for s in range(0, n_slots, seq_len):
            m = min(seq_len, n_slots - s)
            hid_idx.append([off + s + j if j < m else 0 for j in range(seq_len)])
            mask.append([1.0] * m + [0.0] * (seq_len - m))
        off += len(t)
    hid_idx = np.array(hid_idx, dtype=np.int32)
    return tokens, hidden, hid_idx, np.array(mask, dtype=np.float32)


def batch_order(n_windows: int, batch: int, step: int, seed: int) -> np.ndarray:
    """Window indices of `step`: an endless stream of seeded permutations (resumable from the step alone)."""
    pos = np.arange(step * batch, (step + 1) * batch)
    out = np.empty(batch, dtype=np.int64)
    for e in np.unique(pos // n_windows):
        perm = np.random.default_rng([seed, int(e)]).permutation(n_windows)
        sel = pos // n_windows == e
        out[sel] = perm[pos[sel] % n_windows]
    return out


def schedule(lr: float, steps: int, warmup: int):
    warmup = max(1, min(warmup, steps // 10 or 1))
    return optim.join_schedules(
        [optim.linear_schedule(lr * 0.01, lr, warmup), optim.cosine_decay(lr, max(1, steps - warmup), lr * 0.1)],
        [warmup])


def train_step_fn(module: nn.Module, opt, loss, clip: float, compile: bool):
    """One optimizer step of `module` on `loss(*inputs) -> (loss, metric)`: forward, backward, gradient
    clipping (clip > 0), update; `mx.compile`d over the module's and the optimizer's state when asked.
    Returns step(*inputs) -> (loss, metric)."""
    value_and_grad = nn.value_and_grad(module, loss)

    def step(*inputs):
        (value, metric), grads = value_and_grad(*inputs)
        if clip > 0:
            grads, _ = optim.clip_grad_norm(grads, clip)
        opt.update(module, grads)
        return value, metric

    if compile:
        state = [module.state, opt.state]
        return mx.compile(step, inputs=state, outputs=state)
    return step
