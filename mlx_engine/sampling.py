"""The sampler chain, on device, shared by the target and every drafter.

Order: logit bias -> repetition penalty -> presence / frequency penalties -> temperature -> top-k -> top-p
-> min-p -> softmax.
Every function takes `[n, V]` logits, one row per position, so a verify pass of k+1 rows and a
single decode step go through the same code. The penalties are applied per position with the history up
to that position: row i of a verify pass sees the committed tokens plus drafts 1..i.

The OpenAI penalties (vLLM's semantics): logit[t] += logit_bias[t]; logit[t] -= presence * (count[t] > 0)
+ frequency * count[t], where count[t] is how often t occurs among the tokens generated so far (the prompt
excluded, the whole answer counted, not a window). The repetition penalty's history takes the prompt in.
"""

import math
from collections.abc import Mapping
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
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted from every token generated so far (0 = off)
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per time a token was generated so far (0 = off)
    # ((token id, bias in [-100, 100]), ...) added to the logits, sorted by id; a dict {id: bias} is taken too
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name.replace('_', ' ')} must be in [-2, 2], got {getattr(self, name)}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError for a logit_bias token id outside the model's vocabulary [0, vocab_size)."""
        bad = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad:
            raise ValueError(f"logit bias token id {bad[0]} is outside the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """The repetition penalty is on (its history: the prompt and the tokens generated)."""
        return self.repetition_penalty != 1.0

    @property
    def counted(self) -> bool:
        """A presence or frequency penalty is on (its history: the tokens generated, counted per row)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (id, bias) pairs, checked: ids integers >= 0 (digit strings taken, as JSON keys
    are), biases finite numbers in [-100, 100], no id twice."""
    pairs = list(bias.items()) if isinstance(bias, Mapping) else list(bias)
    out = {}
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"logit bias must map token ids to numbers, got {pair!r}")
        token, value = pair
        if isinstance(token, str) and token.strip().isdigit():
            token = int(token)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit bias token ids must be integers >= 0, got {token!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"logit bias of token {token} must be a finite number, got {value!r}")
        if not -100.0 <= value <= 100.0:
            raise ValueError(f"logit bias of token {token} must be in [-100, 100], got {value}")
        if token in out:
            raise ValueError(f"logit bias names token {token} twice")
        out[token] = float(value)
    return tuple(sorted(out.items()))


def bias_row(pairs: tuple[tuple[int, float], ...], vocab: int) -> mx.array:
    """[V] float32: each pair's bias at its token id (ids past a narrower scorer's `vocab` left out)."""
    inside = [(t, b) for t, b in pairs if t < vocab]
    row = mx.zeros((vocab,), dtype=mx.float32)
    if not inside:
        return row
    ids, values = zip(*inside)
    return row.at[mx.array(ids, dtype=mx.int32)].add(mx.array(values, dtype=mx.float32))


def token_counts(counts: Mapping[int, int], vocab: int) -> mx.array:
    """[V] float32: how often each token was generated ({token id: count}, from the host)."""
    row = mx.zeros((vocab,), dtype=mx.float32)
    if not counts:
        return row
    return row.at[mx.array(list(counts), dtype=mx.int32)].add(mx.array(list(counts.values()), dtype=mx.float32))


def row_counts(counts: mx.array, drafts: mx.array) -> mx.array:
    """Each verified row's counts: `counts` [V] (the tokens generated before row 0), drafts [n - 1] -> [n, V],
    row i counting drafts 1..i as well (the history plain decoding would have at that position)."""
    if drafts.shape[0] == 0:
        return counts[None]
    hits = (drafts[:, None] == mx.arange(counts.shape[0])[None, :]).astype(mx.float32)  # [n - 1, V]
    prefix = mx.cumsum(hits, axis=0)
    return mx.concatenate([counts[None], counts[None] + prefix], axis=0)


def count_penalties(logits: mx.array, counts: mx.array, presence: float, frequency: float) -> mx.array:
    """logits [n, V] - (frequency * counts + presence * (counts > 0)), counts [n, V] (or [1, V] for every row)."""
    if frequency != 0.0:
        logits = logits - frequency * counts
    if presence != 0.0:
        logits = logits - presence * (counts > 0).astype(mx.float32)
    return logits


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


def process_logits(logits: mx.array, context: mx.array | None, cfg: SamplingConfig,
                   counts: mx.array | None = None) -> mx.array:
    """Logits after the logit processors, float32. [n, V] -> [n, V]: the logit bias, the repetition penalty
    (`context`: see repetition_penalty), the presence and frequency penalties (`counts` [n, V]: each row's
    counts of the generated tokens, `row_counts`). A processor whose history is not given is skipped: a
    drafter may leave the counts out (its q need not be the target's, only the target's rows must have them)."""
    logits = logits.astype(mx.float32)
    if cfg.logit_bias:
        logits = logits + bias_row(cfg.logit_bias, logits.shape[-1])
    if cfg.penalized and context is not None:
        logits = repetition_penalty(logits, context, cfg.repetition_penalty, cfg.repetition_context)
    if cfg.counted and counts is not None:
        logits = count_penalties(logits, counts, cfg.presence_penalty, cfg.frequency_penalty)
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


def choose(logits: mx.array, context: mx.array | None, cfg: SamplingConfig, key: mx.array | None,
           counts: mx.array | None = None):
    """Process and pick one token per row: argmax when greedy, else a sample.

    Returns (tokens [n], probs [n, V] or None when greedy).
    """
    logits = process_logits(logits, context, cfg, counts)
    if cfg.greedy:
        return mx.argmax(logits, axis=-1), None
    probs = probabilities(logits, cfg)
    return sample(probs, key), probs


def random_draws(key: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The random draws of one sampled acceptance: (uniforms [k] for the accept tests, one uniform for the
    inverse-CDF sample of the next token). The fused kernel (kernels/acceptance.py) is given the same."""
    accept_key, sample_key = mx.random.split(key)
    return mx.random.uniform(shape=(k,), key=accept_key), mx.random.uniform(key=sample_key)


# -- log-probabilities of the emitted tokens ------------------------------------------------------------

MAX_TOP_LOGPROBS = 20  # OpenAI's ceiling on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target (log-softmax of the model's logits at that
    position, float32, before any logit processor, the temperature, the filters or a grammar's mask), and
    the `top` most likely tokens there as (id, logprob), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_logprobs(n) -> None:
    """ValueError unless n is None (off) or an integer in [0, MAX_TOP_LOGPROBS]."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TOP_LOGPROBS):
        raise ValueError(f"logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], got {n!r}")


def logprob_rows(logits: mx.array, tokens: mx.array, n: int) -> mx.array:
    """On the device: [R, V] raw logits and the token emitted at each row [R] -> [R, 1 + 2n'] float32, per
    row the token's logprob, then the n' = min(n, V) most likely ids (exact in float32 below 2^24) and
    their logprobs, most likely first. Read with the cycle's other results; `host_logprobs` unpacks it."""
    x = logits.astype(mx.float32)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, tokens.astype(mx.int32).reshape(-1, 1), axis=-1)
    n = min(n, lp.shape[-1])
    if n == 0:
        return chosen
    ids = mx.argpartition(-lp, kth=n - 1, axis=-1)[:, :n]
    values = mx.take_along_axis(lp, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    ids, values = mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)
    return mx.concatenate([chosen, ids.astype(mx.float32), values], axis=-1)


def host_logprobs(tokens: list[int], rows: list[list[float]]) -> list[TokenLogprob]:
    """The emitted tokens with their rows of `logprob_rows` (read to the host, one per token, in order)."""
    out = []
    for token, row in zip(tokens, rows):
        n = (len(row) - 1) // 2
        top = tuple((int(row[1 + j]), row[1 + n + j]) for j in range(n))
        out.append(TokenLogprob(int(token), row[0], top))
    return out
