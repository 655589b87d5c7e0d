"""Seconds per batched step, by batch size B and draft length k: what the batch policy knows of costs.

A step of B rows at draft length k drafts k tokens per row (one head pass per draft step for a batched MTP
head; a drafter copy per row otherwise) and verifies B * (k + 1) rows in one target pass, so

    T(B, k) = verify(B * (k + 1)) + c_draft * drafted          (drafted: k, or the rows' k summed)

the batched form of the single-sequence cost model C(k) = t(k + 1) + k * t_draft.

Every (B, k) the engine has run keeps its own measure (a moving average of its timed steps), so what
was measured at one batch size is not forgotten while the batch runs at another. A spike from another
process moves a measure by a bounded step (a sample is clipped to within 2x of the measure first). On
this CPU the verify term is far from linear in rows (12 rows measured slower than 16: BLAS blocking),
so a measured (B, k) is used as it is. An unmeasured one is predicted by the model above, fitted by
weighted least squares over the measured (B, k) (each weighs by its samples, up to 8):
    T = c_0 + c_rows * rows + c_draft * drafted
anchored on the nearest measured draft length at the same B (the fit gives the difference). Before a
fit exists, the single-sequence extrapolation over k at the same B stands in (estimates.extrapolate).
"""

from __future__ import annotations

import numpy as np

from .estimates import extrapolate


class StepCosts:
    def __init__(self, smoothing: float = 0.1, clip: float = 2.0, max_weight: int = 8):
        self.smoothing, self.clip, self.max_weight = smoothing, clip, max_weight
        self.cells: dict[tuple[int, int], list] = {}  # (B, k) -> [seconds, drafted, timed samples]
        self._theta: np.ndarray | None = None
        self._stale = True

    def add(self, b: int, k: int, seconds: float, drafted: float) -> None:
        """One timed step of b rows at draft length k (`drafted`: the model's draft feature)."""
        cell = self.cells.get((b, k))
        if cell is None:
            self.cells[(b, k)] = [seconds, float(drafted), 1]
        else:
            mean, d, n = cell
            x = min(max(seconds, mean / self.clip), mean * self.clip)
            w = max(1.0 / (n + 1), self.smoothing)  # an average of the first samples, then a moving one
            cell[0], cell[1], cell[2] = mean + w * (x - mean), d + w * (drafted - d), n + 1
        self._stale = True

    def samples(self, b: int, k: int) -> int:
        cell = self.cells.get((b, k))
        return cell[2] if cell else 0

    def fit(self) -> np.ndarray | None:
        """(c_0, c_rows, c_draft) over the measured (B, k), or None while they do not determine all three."""
        if self._stale:
            self._stale, self._theta = False, None
            if len(self.cells) >= 3:
                x = np.empty((len(self.cells), 3))  # host numbers, not device arrays
                y = np.empty(len(self.cells))
                w = np.empty(len(self.cells))
                for j, ((b, k), (sec, drafted, n)) in enumerate(self.cells.items()):
                    x[j] = (1.0, b * (k + 1), drafted)
                    y[j], w[j] = sec, min(n, self.max_weight) ** 0.5
                theta, _, rank, _ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
                if rank == 3:
                    self._theta = theta
        return self._theta

    def draft_cost(self) -> float | None:
        """Fitted seconds per unit of the draft feature (None: no fit yet)."""
        theta = self.fit()
        return None if theta is None else float(theta[2])

    def _model(self, theta, b: int, k: int, drafted: float) -> float:
        return float(theta[0] + theta[1] * b * (k + 1) + theta[2] * drafted)

    def predict(self, b: int, k: int, drafted: float) -> float | None:
        """Seconds of a step of b rows at length k with this draft feature; None when nothing supports it."""
        cell = self.cells.get((b, k))
        theta = self.fit()
        if cell is not None:
            if theta is None or drafted == cell[1]:
                return cell[0]
            return cell[0] + theta[2] * (drafted - cell[1])
        near = sorted((j for (bb, j) in self.cells if bb == b), key=lambda j: (abs(j - k), j))
        if theta is None:
            return extrapolate({j: self.cells[(b, j)][0] for j in near}, k, 0.0)
        if not near:
            return max(self._model(theta, b, k, drafted), 1e-6)
        k0 = near[0]
        sec0, d0, _ = self.cells[(b, k0)]
        return sec0 + self._model(theta, b, k, drafted) - self._model(theta, b, k0, d0)
