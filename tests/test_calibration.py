"""The calibrated cost model: fits measured shard times, and balances as well as the true costs do."""

import numpy as np
import pytest

from raypipe.encode.balance import get_load_balance_assignment, split_by_counts
from raypipe.encode.calibration import CostCalibration
from raypipe.encode.partition import makespan, partition

TRUE = (3e-8, 2e-5, 4e-3)  # seconds: a p^2 + b p + c per unit
OVERHEAD = 6e-3  # per shard (one tower call)


def true_seconds(p):
    a, b, c = TRUE
    return a * p * p + b * p + c


def heavy_tailed_patches(rng, count):
    """Thumbnails, photos and a few large documents (patch counts, like `bench encode`'s mix)."""
    kinds = rng.random(count)
    small = rng.integers(16, 300, count)
    photo = rng.integers(500, 2000, count)
    big = rng.integers(3000, 5000, count)
    return np.where(kinds < 0.5, small, np.where(kinds < 0.85, photo, big)).astype(float).tolist()


def greedy(costs, n):
    order, counts, _ = get_load_balance_assignment(costs, n)
    return split_by_counts(order, counts)


def test_fit_recovers_the_per_unit_model_from_shard_totals():
    rng = np.random.default_rng(0)
    calibration = CostCalibration()
    for _ in range(40):
        patches = heavy_tailed_patches(rng, int(rng.integers(1, 8)))
        seconds = sum(true_seconds(p) for p in patches) + OVERHEAD
        calibration.observe(patches, patches, seconds)
    # The prior (patch count: linear, no per-unit term) is wrong; 40 receipts outweigh it.
    probe = [20.0, 200.0, 1000.0, 3000.0, 5000.0]
    np.testing.assert_allclose(calibration.unit_costs(probe, probe), [true_seconds(p) for p in probe], rtol=0.05)
    assert calibration.stats()["fit"]["o_shard"] == pytest.approx(OVERHEAD, rel=0.3)
    assert calibration.stats()["rel_rms_error"] < 0.01
    assert calibration.stats()["shards"] == 40


def test_prior_is_used_until_a_shard_is_measured():
    calibration = CostCalibration()
    assert calibration.unit_costs([10, 20], [5.0, 7.0]) == [5.0, 7.0]
    assert calibration.stats() == {"shards": 0, "fit": None, "rel_rms_error": None}


def test_after_warm_up_calibrated_balances_within_1pct_of_greedy_on_measured_costs():
    """Patch counts misjudge shards here (per-unit and quadratic terms); the prior is the patch count."""
    rng = np.random.default_rng(1)
    n = 4
    calibration = CostCalibration()
    for _ in range(8):  # warm-up: real batches, balanced by the model being fitted, timed per shard
        patches = heavy_tailed_patches(rng, 24)
        shards, _ = partition(calibration.unit_costs(patches, patches), n)
        for shard in shards:
            if shard:
                total = sum(true_seconds(patches[i]) for i in shard) + OVERHEAD
                calibration.observe([patches[i] for i in shard], [patches[i] for i in shard],
                                    total * rng.uniform(0.97, 1.03))  # timing noise
    ratios, patch_ratios = [], []
    for _ in range(10):
        patches = heavy_tailed_patches(rng, 48)
        measured = [true_seconds(p) for p in patches]
        oracle = makespan(measured, greedy(measured, n))
        ratios.append(makespan(measured, greedy(calibration.unit_costs(patches, patches), n)) / oracle)
        patch_ratios.append(makespan(measured, greedy(patches, n)) / oracle)
    assert max(patch_ratios) > 1.01  # the mix is one where the patch count misleads the balancer
    assert max(ratios) <= 1.01, ratios
