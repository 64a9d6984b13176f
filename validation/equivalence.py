"""Paired equivalence verdicts across seeds: two one-sided tests (TOST) on per-seed differences.

An arm and its baseline ran once per seed on a matched schedule, so seed
``i`` of one pairs with seed ``i`` of the other. The question is not "do they
differ?" but "is the difference inside a margin we do not care about?".

NOTE [Paired equivalence]
  1. ``d_i = arm_i - baseline_i`` per seed, in the metric's own units. ``n``
     seeds give the mean ``d`` and its standard error ``s / sqrt(n)`` (``s``
     the sample SD, ``n - 1`` degrees of freedom); ``n >= 2``.
  2. The margin is ``max(floor, SD of the baseline across seeds)``: a stated
     floor (the smallest difference a reader cares about) or the
     seed-to-seed spread of the baseline itself, whichever is larger. Both
     numbers are returned.
  3. TOST at level ``alpha``: equivalence holds when both one-sided
     Student-t tests reject, ``d > -margin`` and ``d < +margin``, each at
     ``alpha``; equivalently the ``1 - 2 alpha`` (90% for 0.05) confidence
     interval of the mean difference lies strictly inside
     ``(-margin, +margin)``. The TOST p-value is the larger of the two.
  4. Verdicts, with "worse" meaning the direction in which the metric gets
     worse (up for a loss, down for a reward):
       - ``equivalent``: Rule 3 holds (it wins over the others: a difference
         that is significant but inside the margin is one we do not care about);
       - ``worse``: otherwise, when the whole interval lies on the worse side
         of 0 (a one-sided test at ``alpha`` says the arm is worse);
       - ``better``: likewise on the better side;
       - ``inconclusive``: anything else (too few seeds, too much noise).
  5. Identical differences (``s = 0``, e.g. bitwise-equal arms) make the
     interval the single point ``d``: Rule 3 and Rule 4 apply to it as is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy import stats

from reference_trainer.errors import is_number

from .errors import HarnessError

__all__ = ["VERDICTS", "EquivalenceInputError", "PairedEquivalence", "equivalence_margin", "paired_equivalence"]

VERDICTS = ("equivalent", "worse", "better", "inconclusive")


class EquivalenceInputError(HarnessError, ValueError):
    """Values a paired test cannot use (unpaired lengths, too few seeds, non-finite values, bad margin)."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause, fix="pass one finite value per seed for both arms, at least 2 seeds, and a floor >= 0")


@dataclass(frozen=True)
class PairedEquivalence:
    """One paired comparison (NOTE [Paired equivalence]); ``as_dict`` gives plain JSON types."""

    n: int
    differences: tuple[float, ...]
    mean_difference: float
    ci_low: float
    ci_high: float
    confidence: float
    margin: float
    margin_floor: float
    baseline_sd: float
    p_tost: float
    higher_is_better: bool
    verdict: str

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["differences"] = list(self.differences)
        return out


def _values(name: str, values: Sequence[float] | np.ndarray) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or not np.isfinite(array).all():
        raise EquivalenceInputError(
            f"{name}: expected a 1-D sequence of finite numbers (one per seed), found {values!r}"
        )
    return array


def equivalence_margin(baseline: Sequence[float] | np.ndarray, floor: float) -> tuple[float, float]:
    """``(margin, baseline_sd)``: ``max(floor, sample SD of the baseline across seeds)`` (Rule 2)."""
    if not is_number(floor) or not math.isfinite(floor) or floor < 0:
        raise EquivalenceInputError(f"floor: expected a finite number >= 0, found {floor!r}")
    base = _values("baseline", baseline)
    if base.size < 2:
        raise EquivalenceInputError(f"baseline: expected at least 2 seeds, found {base.size}")
    sd = float(np.std(base, ddof=1))
    return max(float(floor), sd), sd


def paired_equivalence(
    arm: Sequence[float],
    baseline: Sequence[float],
    *,
    floor: float,
    higher_is_better: bool,
    alpha: float = 0.05,
) -> PairedEquivalence:
    """The paired TOST verdict of ``arm`` against ``baseline`` (NOTE [Paired equivalence]).

    ``arm[i]`` and ``baseline[i]`` are the same seed's metric. ``floor`` is
    the stated margin floor (metric units, ``>= 0``); ``higher_is_better``
    says which direction is "better"; ``alpha`` in ``(0, 0.5)``. Raises
    :class:`EquivalenceInputError` for unpaired or non-finite input or
    fewer than 2 seeds.
    """
    if not 0.0 < alpha < 0.5:
        raise EquivalenceInputError(f"alpha: expected a number in (0, 0.5), found {alpha!r}")
    a, b = _values("arm", arm), _values("baseline", baseline)
    if a.shape != b.shape:
        raise EquivalenceInputError(
            f"expected paired values (one per seed for both), found {a.size} arm and {b.size} baseline"
        )
    margin, baseline_sd = equivalence_margin(b, floor)
    diff = a - b
    n = int(diff.size)
    mean = float(diff.mean())
    sem = float(diff.std(ddof=1)) / math.sqrt(n)
    if sem == 0.0:  # Rule 5
        low = high = mean
        p_tost = 0.0 if -margin < mean < margin else 1.0
    else:
        low, high = stats.t.interval(1 - 2 * alpha, n - 1, loc=mean, scale=sem)
        p_lower = stats.t.sf((mean + margin) / sem, n - 1)  # H0: d <= -margin
        p_upper = stats.t.cdf((mean - margin) / sem, n - 1)  # H0: d >= +margin
        p_tost = float(max(p_lower, p_upper))
    return PairedEquivalence(
        n=n,
        differences=tuple(float(d) for d in diff),
        mean_difference=mean,
        ci_low=float(low),
        ci_high=float(high),
        confidence=1 - 2 * alpha,
        margin=margin,
        margin_floor=float(floor),
        baseline_sd=baseline_sd,
        p_tost=p_tost,
        higher_is_better=higher_is_better,
        verdict=_verdict(float(low), float(high), margin, higher_is_better),
    )


def _verdict(low: float, high: float, margin: float, higher_is_better: bool) -> str:
    """Rule 4 from the interval ``[low, high]`` of ``arm - baseline``."""
    if -margin < low and high < margin:
        return "equivalent"
    # Orient so that positive means worse.
    worse_low, worse_high = (-high, -low) if higher_is_better else (low, high)
    if worse_low > 0:
        return "worse"
    if worse_high < 0:
        return "better"
    return "inconclusive"
