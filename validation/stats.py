"""Paired-ratio statistics: a median's confidence interval, planned looks, drift, verdicts.

NOTE [Verdicts under repeated looks]
1. A comparison is summarised by the median of its per-block ratios
   (arm seconds / baseline seconds). Its interval is the distribution-free
   order-statistic interval for a median: ``[x(k), x(n-k+1)]`` of the sorted
   ratios, with ``k`` the largest index whose two binomial tails
   ``2 P(Bin(n, 1/2) <= k-1)`` stay within the error rate. It is exact for any
   continuous distribution at any ``n`` (no bootstrap, no normality); when ``n``
   is too small for the requested level there is no interval (NaN) and no
   verdict.
2. The data are looked at only at planned block counts (:func:`planned_looks`:
   8, 16, 32, ... up to ``max_blocks``). The error rate is split across them by
   Bonferroni: each look uses the level ``1 - alpha / looks``, so the chance of
   any false verdict over the whole sequence stays <= ``alpha`` per comparison
   whenever the run stops.
3. Verdicts against the band ``[1 - gate, 1 + gate]`` (docs/harness.md#paired-comparisons): ``tie``
   when the whole interval lies inside it, ``regression`` when it lies above
   ``1 + gate``, ``gain`` when below ``1 - gate``, ``inconclusive`` otherwise
   (and when there is no interval).
4. Drift is the Spearman rank correlation of the per-block ratio with the
   block index and its two-sided p-value; it is reported, not folded into the
   verdict (alternating block order already cancels linear drift in the times).

The functions take arrays whose last axis is the blocks, so simulations can
run many trials at once through the same code as the runner.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from scipy import stats

__all__ = ["VERDICTS", "Drift", "planned_looks", "look_confidence", "median_ci", "verdict", "drift"]

VERDICTS = ("tie", "regression", "gain", "inconclusive")
FIRST_LOOK = 8


@dataclass(frozen=True)
class Drift:
    """Spearman ``rho`` of ratio vs block index, its p-value, and whether p < the error rate."""

    rho: float
    p_value: float
    significant: bool


def planned_looks(max_blocks: int) -> tuple[int, ...]:
    """Block counts at which the data are examined: 8, 16, 32, ... and ``max_blocks`` (Rule 2).

    ``max_blocks`` below 8 gives the single look ``(max_blocks,)``.
    """
    if max_blocks < 1:
        raise ValueError(f"expected max_blocks >= 1, found {max_blocks}")
    looks, n = [], FIRST_LOOK
    while n < max_blocks:
        looks.append(n)
        n *= 2
    return (*looks, max_blocks)


def look_confidence(alpha: float, looks: int) -> float:
    """Two-sided confidence level used at each of ``looks`` planned looks (Bonferroni, Rule 2)."""
    if not 0 < alpha < 1 or looks < 1:
        raise ValueError(f"expected 0 < alpha < 1 and looks >= 1, found alpha={alpha}, looks={looks}")
    return 1.0 - alpha / looks


def median_ci(ratios: np.ndarray, confidence: float) -> tuple[np.ndarray, np.ndarray]:
    """Order-statistic interval for the median along the last axis (Rule 1).

    Returns ``(low, high)`` with the leading shape of ``ratios``; NaN where
    ``n`` blocks cannot reach ``confidence`` (e.g. fewer than 6 at 95%).
    Agrees with ``scipy.stats.quantile_test(...).confidence_interval``.
    """
    values = np.sort(np.asarray(ratios, dtype=float), axis=-1)
    n = values.shape[-1]
    k = _order_index(n, confidence)
    if k < 1:
        nan = np.full(values.shape[:-1], np.nan)
        return nan, nan.copy()
    return values[..., k - 1], values[..., n - k]


@functools.cache
def _order_index(n: int, confidence: float) -> int:
    """The 1-based ``k`` of Rule 1: ``P(Bin(n, 1/2) <= k - 1) <= tail < P(Bin(n, 1/2) <= k)``; 0 if none."""
    tail = (1.0 - confidence) / 2
    k = int(stats.binom.ppf(tail, n, 0.5))  # smallest k with P(Bin <= k) >= tail
    return k + 1 if stats.binom.cdf(k, n, 0.5) <= tail else k


def verdict(low: np.ndarray | float, high: np.ndarray | float, gate: float) -> np.ndarray:
    """Rule 3, element-wise; NaN bounds give ``inconclusive``."""
    low, high = np.asarray(low, dtype=float), np.asarray(high, dtype=float)
    return np.select(
        [(low >= 1 - gate) & (high <= 1 + gate), low > 1 + gate, high < 1 - gate],
        ["tie", "regression", "gain"],
        default="inconclusive",
    )


def drift(ratios: np.ndarray, alpha: float = 0.05) -> Drift:
    """Rule 4 for one series; a constant series or fewer than 3 blocks has no drift (rho 0, p 1)."""
    values = np.asarray(ratios, dtype=float)
    if values.size < 3 or np.all(values == values[0]):
        return Drift(rho=0.0, p_value=1.0, significant=False)
    result = stats.spearmanr(np.arange(values.size), values)
    rho, p_value = float(result.statistic), float(result.pvalue)
    return Drift(rho=rho, p_value=p_value, significant=p_value < alpha)
