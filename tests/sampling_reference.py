"""The sampling distribution from first principles (numpy, float64), and a conditional chi-square test.

Nothing here imports mlx_engine.sampling: the distribution tests compare the engine against these
definitions, so a bug in the engine's sampler cannot sit on both sides.

Definitions (the order of mlx_engine/sampling.py's docstring, which is the contract):
    logit bias: logit[t] += bias[t] (OpenAI's logit_bias);
    repetition penalty: every token among the last `window` tokens of the history has its logit divided by
        the penalty if positive, multiplied by it if negative (CTRL, mlx-lm);
    presence and frequency penalties (OpenAI, as vLLM applies them): logit[t] -= presence * (count[t] > 0)
        + frequency * count[t], count[t] the occurrences of t among the tokens generated so far (the prompt
        not counted, the whole answer counted);
    temperature T: logits / T;
    top-k: keep the k largest;
    top-p: keep the smallest set of most probable tokens whose probability sums to >= p (a token is kept
        when the mass of the tokens strictly more probable than it is < p);
    min-p: keep tokens whose probability is >= min_p times the largest;
    then normalise. Each filter sees the distribution the previous ones left.
"""

from __future__ import annotations

import math

import numpy as np


def penalize(logits: np.ndarray, history, penalty: float, window: int) -> np.ndarray:
    out = np.array(logits, dtype=np.float64)
    if penalty == 1.0 or len(history) == 0:
        return out
    seen = sorted(set(int(t) for t in list(history)[-window:]))
    x = out[seen]
    out[seen] = np.where(x < 0, x * penalty, x / penalty)
    return out


def bias(logits: np.ndarray, logit_bias=()) -> np.ndarray:
    """logit[t] + bias[t]; `logit_bias` a dict {id: bias} or (id, bias) pairs."""
    out = np.array(logits, dtype=np.float64)
    for t, b in (logit_bias.items() if isinstance(logit_bias, dict) else logit_bias):
        out[int(t)] += b
    return out


def count_penalize(logits: np.ndarray, generated, presence: float = 0.0, frequency: float = 0.0) -> np.ndarray:
    """logit[t] - (presence * (count[t] > 0) + frequency * count[t]), counts over `generated`."""
    out = np.array(logits, dtype=np.float64)
    count = np.zeros(len(out))
    for t in generated:
        count[int(t)] += 1
    return out - (presence * (count > 0) + frequency * count)


def process(logits, history=(), generated=(), repetition_penalty=1.0, repetition_context=20, presence_penalty=0.0,
            frequency_penalty=0.0, logit_bias=()) -> np.ndarray:
    """The logit processors in order (float64): logit bias, repetition penalty (`history`: the prompt and the
    tokens generated), presence and frequency penalties (`generated`: the tokens generated alone)."""
    x = penalize(bias(logits, logit_bias), history, repetition_penalty, repetition_context)
    return count_penalize(x, generated, presence_penalty, frequency_penalty)


def process_of(cfg, logits, history=(), generated=()) -> np.ndarray:
    """`process` with the fields of a SamplingConfig."""
    return process(logits, history, generated, cfg.repetition_penalty, cfg.repetition_context,
                   getattr(cfg, "presence_penalty", 0.0), getattr(cfg, "frequency_penalty", 0.0),
                   getattr(cfg, "logit_bias", ()))


def distribution(logits, history=(), temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                 repetition_penalty=1.0, repetition_context=20, generated=(), presence_penalty=0.0,
                 frequency_penalty=0.0, logit_bias=()) -> np.ndarray:
    """The target's sampling distribution over the vocabulary for one position (temperature > 0).
    `history`: the prompt and the tokens generated before the position; `generated`: those tokens alone."""
    x = process(logits, history, generated, repetition_penalty, repetition_context, presence_penalty,
                frequency_penalty, logit_bias) / temperature
    keep = np.ones(x.shape, bool)
    if 0 < top_k < len(x):
        keep &= x >= np.sort(x)[::-1][top_k - 1]
    p = _softmax(x, keep)
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        kept = np.zeros(len(p), bool)
        kept[order] = before < top_p
        keep &= kept
        p = _softmax(x, keep)
    if min_p > 0.0:
        keep &= p >= min_p * p.max()
        p = _softmax(x, keep)
    return p


def distribution_of(cfg, logits, history, generated=()) -> np.ndarray:
    """`distribution` with the fields of a SamplingConfig (read as plain attributes; `generated`: the tokens
    of `history` after the prompt, which the presence and frequency penalties count)."""
    return distribution(logits, history, cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p,
                        cfg.repetition_penalty, cfg.repetition_context, generated,
                        getattr(cfg, "presence_penalty", 0.0), getattr(cfg, "frequency_penalty", 0.0),
                        getattr(cfg, "logit_bias", ()))


def _softmax(x: np.ndarray, keep: np.ndarray) -> np.ndarray:
    z = np.where(keep, x - x[keep].max(), -np.inf)
    e = np.exp(z)
    return e / e.sum()


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df), exactly: Q(df/2, stat/2) by the recurrence
    Q(s + 1, x) = Q(s, x) + x^s e^-x / Gamma(s + 1) from Q(1, x) = e^-x or Q(1/2, x) = erfc(sqrt x)."""
    if df <= 0:
        return 1.0
    x = stat / 2.0
    if df % 2 == 0:
        s, q = 1.0, math.exp(-x)
    else:
        s, q = 0.5, math.erfc(math.sqrt(x))
    while s < df / 2.0:
        q += math.exp(s * math.log(x) - x - math.lgamma(s + 1.0)) if x > 0 else 0.0
        s += 1.0
    return min(1.0, q)


def conditional_chi_square(probs: np.ndarray, tokens: np.ndarray, min_expected: float = 5.0) -> tuple[float, int]:
    """Do tokens[s] ~ probs[s] (one known distribution per sample, given everything before it)?

    O_v = #{s : tokens[s] = v}, E_v = sum_s probs[s, v]; tokens of E < min_expected are pooled into one
    category. Under the hypothesis O - E has covariance C = sum_s diag(p_s) - p_s p_s^T (a sum of
    martingale differences), so (O - E)^T C^+ (O - E) ~ chi-square(rank C). With one distribution for every
    sample this is Pearson's statistic. Returns (statistic, degrees of freedom)."""
    probs = np.asarray(probs, np.float64)
    if len(probs) == 0:
        return 0.0, 0
    expected = probs.sum(axis=0)
    big = np.flatnonzero(expected >= min_expected)
    small = np.flatnonzero(expected < min_expected)
    merged = np.concatenate([probs[:, big], probs[:, small].sum(axis=1, keepdims=True)], axis=1)
    onehot = np.zeros_like(merged)
    slot = np.full(probs.shape[1], merged.shape[1] - 1)
    slot[big] = np.arange(len(big))
    onehot[np.arange(len(tokens)), slot[np.asarray(tokens)]] = 1.0
    diff = onehot.sum(axis=0) - merged.sum(axis=0)
    cov = np.diag(merged.sum(axis=0)) - merged.T @ merged
    df = int(np.linalg.matrix_rank(cov, tol=1e-9 * max(1.0, len(tokens))))
    return float(diff @ np.linalg.pinv(cov, rcond=1e-12) @ diff), df


def grouped_p_value(probs: np.ndarray, tokens: np.ndarray, groups, min_group: int = 50) -> tuple[float, int]:
    """conditional_chi_square within each group (a key fixed before the token is drawn, e.g. the previous
    token), statistics and degrees of freedom summed; groups of fewer than `min_group` samples are tested
    together as one (still exact: each sample keeps its own distribution). Returns (p-value, df)."""
    groups = np.asarray(groups).reshape(len(tokens), -1)
    keys, inverse, sizes = np.unique(groups, axis=0, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    label = np.where(sizes[inverse] >= min_group, inverse, -1)
    stat, df = 0.0, 0
    for g in np.unique(label):
        sel = label == g
        s, d = conditional_chi_square(probs[sel], tokens[sel])
        stat, df = stat + s, df + d
    return chi2_sf(stat, df), df
