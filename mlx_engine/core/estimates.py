"""What the draft-length policies estimate from what they measure, shared by the single-sequence policy
(policy.py) and the batch policy (batch_policy.py).

- Acceptance: decayed counts of drafts reached and accepted per draft position (`add_verdict`), turned
  into a Beta-smoothed conditional acceptance a_i per position (`smoothed_acceptance`; a deeper
  position's prior is no higher than the estimate of the position before it), optionally at a Wilson
  confidence bound (`wilson_bound`), and the expected tokens per cycle E(k) = 1 + a_1 + a_1 a_2 + ...
  (`expected_tokens`).
- Cost: a cost measured at some integer sizes (draft lengths, or rows of a verify pass) is extrapolated
  to an unmeasured size linearly through the two nearest measured ones, never flatter than a floor
  (`extrapolate`): a noisy or flat pair must not make a longer draft look free.
"""

from __future__ import annotations

import math


def wilson_bound(hits: float, tries: float, z: float = 1.64, upper: bool = True) -> float:
    """One-sided confidence bound (z deviations; 1.64: ~95%) on a success rate from `hits` of `tries`
    (Wilson score). With no tries: 1 (upper) or 0 (lower)."""
    if tries <= 0:
        return 1.0 if upper else 0.0
    p, z2 = hits / tries, z * z
    centre = p + z2 / (2 * tries)
    spread = z * math.sqrt(max(p * (1 - p), 0.0) / tries + z2 / (4 * tries * tries))
    bound = (centre + spread if upper else centre - spread) / (1 + z2 / tries)
    return min(1.0, bound) if upper else max(0.0, bound)


def add_verdict(hits: list[float], tries: list[float], k: int, n_accepted: int, decay: float) -> None:
    """Count one draft of k tokens of which the first n_accepted were accepted (in place): each position
    the draft reached (all positions before it accepted) is a try, decaying the older counts there."""
    for i in range(min(n_accepted + 1, k)):
        while len(tries) <= i:
            hits.append(0.0)
            tries.append(0.0)
        hits[i] = hits[i] * decay + (1.0 if i < n_accepted else 0.0)
        tries[i] = tries[i] * decay + 1.0


def smoothed_acceptance(hits: list[float], tries: list[float], prior: float, weight: float,
                        z: float = 0.0) -> list[float]:
    """Beta-smoothed conditional acceptance per position (prior `prior` with `weight` pseudo-drafts; a
    deeper position's prior is no higher than the point estimate of the position before it: drafts rarely
    get easier further out). z > 0: the Wilson lower bound of the smoothed counts at z deviations instead
    of the point estimate (a choice that must win on the evidence, not on a lucky few drafts)."""
    out, point = [], None
    for h, t in zip(hits, tries):
        p0 = prior if point is None else min(prior, point)
        h, t = h + p0 * weight, t + weight
        point = h / t if t > 0 else p0
        out.append(wilson_bound(h, t, z, upper=False) if z > 0 else point)
    return out


def expected_tokens(acceptance: list[float], k: int, default: float) -> float:
    """E(k) = 1 + a_1 + a_1 a_2 + ... + a_1..a_k; positions past the estimates take the last estimate
    (or `default` when there is none)."""
    total, run = 1.0, 1.0
    for i in range(k):
        a = acceptance[i] if i < len(acceptance) else (acceptance[-1] if acceptance else default)
        run *= a
        total += run
    return total


def extrapolate(cost: dict[int, float], n: int, min_slope: float) -> float | None:
    """cost[n] if measured, else linear in n through the two nearest measured sizes (ties: the smaller),
    with a slope of at least `min_slope` per unit of n. None with fewer than two measured sizes."""
    if n in cost:
        return cost[n]
    known = sorted(cost, key=lambda j: (abs(j - n), j))
    if len(known) < 2:
        return None
    a, b = sorted(known[:2])
    slope = max((cost[b] - cost[a]) / (b - a), min_slope)
    return cost[a] + slope * (n - a)
