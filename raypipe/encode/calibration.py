"""The `calibrated` cost model: per-unit encode cost fitted from the times workers really measure.

A unit's cost is modelled as `a p^2 + b p + c` seconds, `p` = the unit's patch count (the `patches`
cost): `a` is full attention, `b` linear layers and window attention, `c` per-unit work (image
processor call, merger set-up).

What can be measured: a worker encodes a whole shard in one batched tower call, so the time of one
unit inside it is not observable. But a shard's time is the sum of its units' costs plus a per-call
overhead `o`, which is *linear* in the unknowns:

    seconds(shard) = a * sum(p^2) + b * sum(p) + c * len(shard) + o

so every shard receipt is one row of a least-squares problem in `(a, b, c, o)`. A prior keeps the
fit sensible while receipts are few: the `attention` FLOP model, scaled to seconds by the single
factor that best maps it onto the shard times, enters as one pseudo-row per recent unit, weighted
so that together they count as `PRIOR_WEIGHT` shards. With no receipt yet the costs *are* the
attention model's, so the first batches are already balanced well; as receipts arrive the data
outweighs the prior and the fit follows what this device really does (e.g. the image processor's
share, which FLOPs ignore). Coefficients are constrained to be >= 0, so costs stay positive and
monotone in `p`.

One `CostCalibration` per device kind ("cpu", "NVIDIA H100 ..."), per coordinator (= per
deployment), over a window of recent shards, refitted on every receipt (a small least squares).
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Sequence

import numpy as np

PRIOR_WEIGHT = 0.25  # the prior counts as this many shards: it pins what few receipts leave open, no more
WINDOW = 256  # recent shards kept per device
NAMES = ("a_p2", "b_p", "c_unit", "o_shard")


class CostCalibration:
    """Shard-level least-squares fit of `a p^2 + b p + c` (+ per-shard overhead) for one device."""

    def __init__(self, window: int = WINDOW, prior_weight: float = PRIOR_WEIGHT):
        self.prior_weight = prior_weight
        self._rows: collections.deque = collections.deque(maxlen=window)  # (features, seconds)
        self._shard_prior: collections.deque = collections.deque(maxlen=window)  # summed prior cost per row
        self._prior_units: collections.deque = collections.deque(maxlen=4 * window)  # (p, prior cost)
        self._coef: np.ndarray | None = None  # (a, b, c, o) in seconds; None until the first receipt
        self._error: float | None = None
        self._lock = threading.Lock()

    def observe(self, patches: Sequence[float], prior_costs: Sequence[float], seconds: float) -> None:
        """One shard: its units' patch counts and prior (attention) costs, and the measured seconds."""
        if not patches or not seconds > 0:
            return
        p = np.asarray(patches, dtype=float)
        with self._lock:
            self._rows.append((np.array([np.sum(p * p), np.sum(p), len(p), 1.0]), float(seconds)))
            self._shard_prior.append(float(sum(prior_costs)))
            self._prior_units.extend(zip(p.tolist(), map(float, prior_costs)))
            self._refit()

    def unit_costs(self, patches: Sequence[float], prior_costs: Sequence[float]) -> list[float]:
        """Fitted seconds per unit; the prior costs themselves until a shard has been measured."""
        with self._lock:
            coef = self._coef
        if coef is None:
            return [float(c) for c in prior_costs]
        p = np.asarray(patches, dtype=float)
        return (coef[0] * p * p + coef[1] * p + coef[2]).tolist()

    def stats(self) -> dict:
        with self._lock:
            coef, error, shards = self._coef, self._error, len(self._rows)
        fit = dict(zip(NAMES, coef.tolist())) if coef is not None else None
        return {"shards": shards, "fit": fit, "rel_rms_error": error}

    def _refit(self) -> None:
        X = np.stack([row for row, _ in self._rows])
        y = np.array([s for _, s in self._rows])
        units = np.array(self._prior_units)
        p, prior = units[:, 0], units[:, 1]
        # The prior in seconds: the one scale that best maps summed prior costs onto shard times.
        shard_prior = np.array(self._shard_prior)
        prior_seconds = prior * float(shard_prior @ y / max(shard_prior @ shard_prior, 1e-300))
        # Pseudo-rows: every recent unit predicted by the prior, weighted so that together they count
        # as `prior_weight` shards (a unit's residual is ~1/units-per-shard of a shard's).
        per_shard = float(np.mean(X[:, 2]))
        weight = np.sqrt(self.prior_weight * per_shard**2 / len(p))
        pseudo = np.stack([p * p, p, np.ones_like(p), np.zeros_like(p)], axis=1) * weight
        A = np.vstack([X, pseudo, _OVERHEAD_ANCHOR * np.sqrt(np.mean(y * y))])
        b = np.concatenate([y, prior_seconds * weight, [0.0]])
        self._coef = _nonnegative_lstsq(A, b)
        predicted = X @ self._coef
        self._error = float(np.sqrt(np.mean((predicted - y) ** 2)) / max(np.mean(y), 1e-12))


# A faint pull of the per-shard overhead towards 0, so it is defined while every row is one shard.
_OVERHEAD_ANCHOR = np.array([[0.0, 0.0, 0.0, 1e-3]])


def _nonnegative_lstsq(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |A w - b| over w >= 0, for a handful of unknowns: every subset of free coefficients
    (16 for 4) solved in closed form, the best feasible one kept. Columns are scaled first: sum p^2
    is ~1e7 where a shard count is ~1."""
    scale = np.sqrt(np.mean(A * A, axis=0)) + 1e-300
    A = A / scale
    best, best_loss = np.zeros(A.shape[1]), np.inf
    for free in itertools.product((False, True), repeat=A.shape[1]):
        free = np.array(free)
        w = np.zeros(A.shape[1])
        if free.any():
            w[free] = np.linalg.lstsq(A[:, free], b, rcond=None)[0]
        if (w < 0).any():
            continue
        loss = float(np.sum((A @ w - b) ** 2))
        if loss < best_loss:
            best, best_loss = w, loss
    return best / scale


class CalibratedCosts:
    """One `CostCalibration` per device kind, for one coordinator."""

    def __init__(self):
        self._by_device: dict[str, CostCalibration] = {}
        self._lock = threading.Lock()

    def for_device(self, device: str) -> CostCalibration:
        with self._lock:
            if device not in self._by_device:
                self._by_device[device] = CostCalibration()
            return self._by_device[device]

    def stats(self) -> dict:
        with self._lock:
            devices = dict(self._by_device)
        return {device: calibration.stats() for device, calibration in devices.items()}
