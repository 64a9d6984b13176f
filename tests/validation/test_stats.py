"""The median interval, looks and verdicts of ``validation.stats`` against independent oracles."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy import stats as sps

from validation import stats


@pytest.mark.parametrize("n", [6, 8, 9, 16, 17, 33, 64])
@pytest.mark.parametrize("confidence", [0.95, 0.9875])
def test_median_ci_matches_scipy_quantile_test(n: int, confidence: float) -> None:
    ratios = np.random.default_rng(n).lognormal(0.0, 0.1, n)
    low, high = stats.median_ci(ratios, confidence)
    oracle = sps.quantile_test(ratios, q=1.0, p=0.5).confidence_interval(confidence)
    assert (float(low), float(high)) == (
        pytest.approx(oracle.low, nan_ok=True),
        pytest.approx(oracle.high, nan_ok=True),
    )


def test_median_ci_covers_by_enumeration() -> None:
    """Exact coverage at n = 8: over all 2^8 sign patterns around the true median, the [min, max] interval misses 2."""
    n = 8
    misses = 0
    for signs in itertools.product((-1, 1), repeat=n):
        sample = 1.0 + 0.01 * np.array(signs) * np.arange(1, n + 1)
        low, high = stats.median_ci(sample, 0.95)
        misses += not (low <= 1.0 <= high)
    # At 95%, n = 8: P(Bin(8, 1/2) <= 1) = 9/256 > 0.025, so the interval is [x(1), x(8)]:
    # only the all-above and all-below patterns miss, 2 / 256 <= 5%.
    assert misses == 2


def test_median_ci_is_nan_when_too_few_blocks() -> None:
    low, high = stats.median_ci(np.ones(5), 0.95)  # 2 / 32 = 0.0625 > 0.05: no interval exists
    assert np.isnan(low) and np.isnan(high)


def test_median_ci_is_vectorised_over_trials() -> None:
    series = np.random.default_rng(0).normal(1.0, 0.05, (5, 16))
    low, high = stats.median_ci(series, 0.95)
    for row, lo, hi in zip(series, low, high):
        assert (lo, hi) == stats.median_ci(row, 0.95)


def test_planned_looks_double_from_eight_and_end_at_max() -> None:
    assert stats.planned_looks(64) == (8, 16, 32, 64)
    assert stats.planned_looks(40) == (8, 16, 32, 40)
    assert stats.planned_looks(5) == (5,)
    assert stats.look_confidence(0.05, 4) == pytest.approx(0.9875)
    with pytest.raises(ValueError, match="max_blocks >= 1"):
        stats.planned_looks(0)


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [
        (0.97, 1.03, "tie"),
        (1.06, 1.2, "regression"),
        (0.8, 0.94, "gain"),
        (0.97, 1.07, "inconclusive"),
        (0.9, 1.1, "inconclusive"),
        (float("nan"), float("nan"), "inconclusive"),
        (0.95, 1.05, "tie"),
    ],
)
def test_verdict_bands(low: float, high: float, expected: str) -> None:
    assert stats.verdict(low, high, 0.05) == expected


def test_drift_detects_a_trend_and_not_a_constant() -> None:
    trend = stats.drift(1.0 + 0.01 * np.arange(16))
    assert trend.rho == pytest.approx(1.0) and trend.significant
    assert stats.drift(np.ones(16)) == stats.Drift(rho=0.0, p_value=1.0, significant=False)
    shuffled = stats.drift(np.random.default_rng(3).permutation(1.0 + 0.01 * np.arange(16)))
    assert abs(shuffled.rho) < 0.6
