"""Paired, interleaved timing: ABBA blocks and ratio statistics.

Two arms measured on one machine drift together (thermal state, other load),
so we never compare two separate series: each block runs A B B A (or, for
more arms, the arms in order then reversed), and each block yields one ratio
per arm against the baseline arm. Warm-up blocks are run and discarded. The
summary is the median ratio with its interquartile range and a bootstrap 95%
confidence interval (``scipy.stats.bootstrap``), and a verdict that says
"not significant" when the interval contains 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats

__all__ = ["RatioSummary", "run_abba", "summarize_ratios"]


@dataclass(frozen=True)
class RatioSummary:
    """Median of per-block ratios (arm / baseline) with spread and a bootstrap CI."""

    arm: str
    baseline: str
    blocks: int
    median_ratio: float
    iqr: tuple[float, float]
    ci95: tuple[float, float]
    median_arm_seconds: float
    median_baseline_seconds: float

    @property
    def verdict(self) -> str:
        low, high = self.ci95
        if low <= 1.0 <= high:
            return "not significant"
        return "slower" if low > 1.0 else "faster"

    def as_dict(self) -> dict:
        return {**asdict(self), "verdict": self.verdict}


def run_abba(
    arms: Mapping[str, Callable[[], None]],
    *,
    blocks: int,
    warmup_blocks: int = 2,
    on_block: Callable[[int, dict[str, float]], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Run ``blocks`` mirrored blocks of every arm; returns seconds per arm per block.

    Each block runs the arms in order, then in reverse, and records each
    arm's mean of its two runs. ``on_block`` is called after each measured
    block (for progress lines). ``clock`` is injectable for tests.
    """
    names = list(arms)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for block in range(warmup_blocks + blocks):
        times = {name: 0.0 for name in names}
        for name in names + names[::-1]:
            start = clock()
            arms[name]()
            times[name] += (clock() - start) / 2
        if block >= warmup_blocks:
            for name in names:
                seconds[name].append(times[name])
            if on_block is not None:
                on_block(block - warmup_blocks, times)
    return seconds


def summarize_ratios(seconds: Mapping[str, list[float]], baseline: str, *, seed: int = 0) -> list[RatioSummary]:
    """One :class:`RatioSummary` per non-baseline arm."""
    base = np.asarray(seconds[baseline], dtype=float)
    summaries = []
    for arm, values in seconds.items():
        if arm == baseline:
            continue
        ratios = np.asarray(values, dtype=float) / base
        if len(ratios) >= 3:
            interval = stats.bootstrap(
                (ratios,), np.median, confidence_level=0.95, n_resamples=2000, random_state=seed, method="percentile"
            ).confidence_interval
            ci = (float(interval.low), float(interval.high))
        else:
            ci = (float(ratios.min()), float(ratios.max()))
        q1, q3 = np.percentile(ratios, [25, 75])
        summaries.append(
            RatioSummary(
                arm=arm,
                baseline=baseline,
                blocks=len(ratios),
                median_ratio=float(np.median(ratios)),
                iqr=(float(q1), float(q3)),
                ci95=ci,
                median_arm_seconds=float(np.median(values)),
                median_baseline_seconds=float(np.median(base)),
            )
        )
    return summaries
