"""The sampler chain, on device, shared by the target and every drafter.

Order: repetition penalty -> temperature -> top-k -> top-p -> min-p -> softmax.
Every function takes `[n, V]` logits, one row per position, so a verify pass of k+1 rows and a
single decode step go through the same code. The repetition penalty is applied per position with the
history up to that position: row i of a verify pass sees the committed tokens plus drafts 1..i.
"""

import math
from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    repetition_context: int = 20  # tokens of history the penalty looks at (mlx-lm's default)

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name.replace('_', ' ')} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min-p must be in [0, 1), got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition penalty must be > 0, got {self.repetition_penalty}")
        if self.repetition_context < 1:
            raise ValueError(f"repetition context must be >= 1, got {self.repetition_context}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0


def repetition_penalty(logits: mx.array, context: mx.array, penalty: float, window: int) -> mx.array:
    """Penalise tokens seen in the last `window` tokens of each row's history.

    logits: [n, V]. context: [C + n - 1] token ids; row i's history is context[: C + i] (C >= 1).
    Positive logits are divided by `penalty`, negative ones multiplied (as in mlx-lm / CTRL).
    """
    n = logits.shape[0]
    c = context.shape[0] - (n - 1)
    ends = mx.arange(c, c + n)[:, None]  # [n, 1] exclusive end of each row's history
    idx = ends - window + mx.arange(window)[None, :]  # [n, window]
    idx = mx.where(idx < 0, ends - 1, idx)  # out of range -> repeat the newest token (a no-op duplicate)
    seen = mx.zeros(logits.shape, dtype=mx.bool_)
    seen = mx.put_along_axis(seen, context[idx], mx.array(True), axis=-1)
    hit = mx.where(logits < 0, logits * penalty, logits / penalty)
    return mx.where(seen, hit, logits)


def process_logits(logits: mx.array, context: mx.array | None, cfg: SamplingConfig) -> mx.array:
    """Logits after the logit processors (today: the repetition penalty), float32. [n, V] -> [n, V]."""
    logits = logits.astype(mx.float32)
    if cfg.penalized and context is not None:
        logits = repetition_penalty(logits, context, cfg.repetition_penalty, cfg.repetition_context)
    return logits


def probabilities(logits: mx.array, cfg: SamplingConfig) -> mx.array:
    """Sampling distribution per row from processed logits: temperature, top-k, top-p, min-p. [n, V] -> [n, V].

    Filters are applied to the temperature-scaled distribution; each keeps at least the best token.
    """
    x = logits / cfg.temperature
    neg_inf = mx.array(-mx.inf, dtype=x.dtype)
    vocab = x.shape[-1]
    if 0 < cfg.top_k < vocab:
        kth = mx.sort(x, axis=-1)[:, vocab - cfg.top_k][:, None]
        x = mx.where(x < kth, neg_inf, x)
    if cfg.top_p < 1.0:
        order = mx.argsort(-x, axis=-1)
        sorted_p = mx.softmax(mx.take_along_axis(x, order, axis=-1), axis=-1)
        before = mx.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly before each token
        keep_sorted = before < cfg.top_p  # the first token always has before == 0
        keep = mx.put_along_axis(mx.zeros(x.shape, mx.bool_), order, keep_sorted, axis=-1)
        x = mx.where(keep, x, neg_inf)
    if cfg.min_p > 0.0:
        p = mx.softmax(x, axis=-1)
        x = mx.where(p < cfg.min_p * p.max(axis=-1, keepdims=True), neg_inf, x)
    return mx.softmax(x, axis=-1)


def sample(probs: mx.array, key: mx.array | None, uniform: mx.array | None = None) -> mx.array:
    """One token per row from [n, V] probabilities (need not sum to 1), by inverting the CDF:

        token = min{j : p_j > 0 and cumsum(p)_j > u * sum(p)},   u ~ U[0, 1), one per row ([n, 1] `uniform`,
                                                                  else drawn from `key`)

    One random number per row instead of V (Gumbel-max, mx.random.categorical, draws V): 0.25 against
    1.8 ms a row for V = 49152 on this CPU. A token of probability 0 is never drawn; if rounding leaves no
    crossing, the last token of positive probability is taken (as the fused acceptance kernel does)."""
    if uniform is None:
        uniform = mx.random.uniform(shape=(probs.shape[0], 1), key=key)
    cdf = mx.cumsum(probs, axis=-1)
    positive = probs > 0
    hit = positive & (cdf > uniform * cdf[:, -1:])
    last = (probs.shape[-1] - 1) - mx.argmax(positive[:, ::-1], axis=-1)
    return mx.where(hit.any(axis=-1), mx.argmax(hit, axis=-1), last).astype(mx.int32)


def choose(logits: mx.array, context: mx.array | None, cfg: SamplingConfig, key: mx.array | None):
    """Process and pick one token per row: argmax when greedy, else a sample.

    Returns (tokens [n], probs [n, V] or None when greedy).
    """
    logits = process_logits(logits, context, cfg)
    if cfg.greedy:
        return mx.argmax(logits, axis=-1), None
    probs = probabilities(logits, cfg)
    return sample(probs, key), probs


def random_draws(key: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The random draws of one sampled acceptance: (uniforms [k] for the accept tests, one uniform for the
    inverse-CDF sample of the next token). The fused kernel (kernels/acceptance.py) is given the same."""
    accept_key, sample_key = mx.random.split(key)
    return mx.random.uniform(shape=(k,), key=accept_key), mx.random.uniform(key=sample_key)
