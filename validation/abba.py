"""Paired comparisons in alternating blocks: ``compare`` (docs/harness.md#paired-comparisons).

NOTE [Alternating blocks]
1. Arms measured on one machine drift together (thermal state, other load), so
   arms are never timed as separate series. Block ``i`` runs every arm once in
   order and once reversed (A B B A); the next block starts reversed (B A A B).
   An arm's block time is the mean of its two runs, so a drift linear in time
   cancels exactly within each block.
2. ``warmup_blocks`` blocks run first and are discarded (caches, allocator,
   the load probe's calibration).
3. Each measured block gives one ratio per arm: arm time / baseline time.
   Statistics, looks and verdicts are ``validation.stats`` (NOTE [Verdicts
   under repeated looks]); the run stops at the first planned look where every
   verdict is decided (tie, regression or gain), or after ``max_blocks``, or
   once ``budget_s`` (on ``clock``) is spent, whichever comes first. A stop
   forced by the budget is examined as the next planned look, so the number of
   looks never exceeds the plan.
4. The load probe measures each block (default :class:`CpuShare`: process CPU
   seconds / wall seconds). Its median over the warm-ups is the calibration; a
   block whose share falls below ``(1 - load_tolerance)`` of it is flagged as
   loaded and left out of the statistics. When more than ``max_loaded`` of the
   blocks are flagged, every verdict is ``inconclusive``: a loaded machine must
   never produce a gain or a regression.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np

from . import stats

__all__ = ["Comparison", "LoadProbe", "CpuShare", "compare", "run_block", "MAX_LOADED"]

MAX_LOADED = 0.25  # Rule 4: above this share of loaded blocks every verdict is inconclusive


class LoadProbe(Protocol):
    """Measures one block: ``start()`` before it, ``stop()`` after it returns its busy share."""

    def start(self) -> None: ...

    def stop(self) -> float: ...


class CpuShare:
    """Default load probe: process CPU seconds over wall seconds for the block (Rule 4).

    Another process competing for the cores lowers it; so does this process
    waiting on anything but its own computation.
    """

    def __init__(self) -> None:
        self.cpu = self.wall = 0.0

    def start(self) -> None:
        self.cpu, self.wall = time.process_time(), time.perf_counter()

    def stop(self) -> float:
        wall = time.perf_counter() - self.wall
        return (time.process_time() - self.cpu) / wall if wall > 0 else 1.0


@dataclass(frozen=True)
class Comparison:
    """One arm against the baseline.

    ``blocks``: the blocks the statistics use (measured, not loaded);
    ``ratio``: their median ratio; ``ci95``: its interval at the per-look
    level ``confidence`` (95% family-wise over the planned looks);
    ``loaded``: indices (into ``ratios``) of blocks the probe flagged;
    ``ratios``, ``arm_seconds``, ``baseline_seconds``: every measured block.
    """

    arm: str
    baseline: str
    gate: float
    blocks: int
    ratio: float
    ci95: tuple[float, float]
    confidence: float
    drift: stats.Drift
    loaded: tuple[int, ...]
    verdict: str
    looks: tuple[int, ...]
    ratios: tuple[float, ...]
    arm_seconds: tuple[float, ...]
    baseline_seconds: tuple[float, ...]

    def as_dict(self) -> dict:
        """Plain JSON types (for evidence)."""
        return asdict(self)


def _block_order(names: list[str], index: int) -> list[str]:
    """Rule 1: A B B A on even blocks, B A A B on odd ones."""
    first = names if index % 2 == 0 else names[::-1]
    return first + first[::-1]


def run_block(arms: Mapping[str, Callable[[], object]], index: int, clock: Callable[[], float]) -> dict[str, float]:
    """Block ``index`` of ``arms`` in alternating order (Rule 1): each arm's mean seconds over its two runs."""
    times = dict.fromkeys(arms, 0.0)
    for name in _block_order(list(arms), index):
        start = clock()
        arms[name]()
        times[name] += (clock() - start) / 2
    return times


def _summaries(
    seconds: dict[str, list[float]], flagged: list[bool], *, baseline: str, gate: float, confidence: float,
    max_loaded: float, alpha: float, looks: tuple[int, ...], with_drift: bool = True,
) -> list[Comparison]:
    """One :class:`Comparison` per non-baseline arm; ``with_drift=False`` (a look that may not stop) skips the drift test."""
    keep = ~np.asarray(flagged, dtype=bool)
    base = np.asarray(seconds[baseline])
    too_loaded = (~keep).mean() > max_loaded
    results = []
    for arm, values in seconds.items():
        if arm == baseline:
            continue
        ratios = np.asarray(values) / base
        used = ratios[keep]
        low, high = stats.median_ci(used, confidence) if used.size else (np.nan, np.nan)
        decided = "inconclusive" if too_loaded else str(stats.verdict(low, high, gate))
        results.append(Comparison(
            arm=arm, baseline=baseline, gate=gate, blocks=int(used.size),
            ratio=float(np.median(used)) if used.size else float("nan"),
            ci95=(float(low), float(high)), confidence=confidence,
            drift=stats.drift(used, alpha) if with_drift else stats.Drift(0.0, 1.0, False), loaded=tuple(int(i) for i in np.flatnonzero(~keep)),
            verdict=decided, looks=looks, ratios=tuple(ratios.tolist()),
            arm_seconds=tuple(values), baseline_seconds=tuple(seconds[baseline]),
        ))
    return results


def compare(
    arms: Mapping[str, Callable[[], object]],
    *,
    baseline: str,
    gate: float = 0.05,
    max_blocks: int = 64,
    budget_s: float | None = None,
    warmup_blocks: int = 2,
    clock: Callable[[], float] = time.perf_counter,
    load_probe: LoadProbe | None = None,
    alpha: float = 0.05,
    load_tolerance: float = 0.2,
    max_loaded: float = MAX_LOADED,
    on_block: Callable[[int, dict[str, float]], None] | None = None,
) -> list[Comparison]:
    """Compare every arm with ``baseline`` in alternating blocks; one :class:`Comparison` per other arm, in order.

    ``arms`` maps a name to a zero-argument callable (one unit of work).
    ``on_block(index, seconds_per_arm)`` is called after each measured block
    (progress bars; arms that record extra per-block data). See the NOTE for
    the rules. Raises ``ValueError`` (state untouched, nothing run) when the
    baseline is missing, there is no other arm, or a bound is out of range.
    """
    if baseline not in arms or len(arms) < 2:
        raise ValueError(f"expected a baseline among >= 2 arms, found baseline {baseline!r} and arms {list(arms)}")
    if not 0 <= gate < 1 or max_blocks < 1 or warmup_blocks < 1 or (budget_s is not None and budget_s <= 0):
        raise ValueError(
            f"expected 0 <= gate < 1, max_blocks >= 1, warmup_blocks >= 1 (the load probe calibrates on them), "
            f"budget_s > 0 or None; found gate={gate}, max_blocks={max_blocks}, warmup_blocks={warmup_blocks}, "
            f"budget_s={budget_s}"
        )
    probe = load_probe if load_probe is not None else CpuShare()
    plan = stats.planned_looks(max_blocks)
    confidence = stats.look_confidence(alpha, len(plan))
    summarise = dict(baseline=baseline, gate=gate, confidence=confidence, max_loaded=max_loaded, alpha=alpha)
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    shares, started = [], clock()
    for index in range(warmup_blocks):
        probe.start()
        run_block(arms, index, clock)
        shares.append(probe.stop())
    calibration = float(np.median(shares))
    flagged: list[bool] = []
    looks: list[int] = []
    while True:
        index = len(flagged)
        probe.start()
        times = run_block(arms, warmup_blocks + index, clock)
        flagged.append(probe.stop() < (1 - load_tolerance) * calibration)
        for name, value in times.items():
            seconds[name].append(value)
        if on_block is not None:
            on_block(index, times)
        out_of_budget = budget_s is not None and clock() - started >= budget_s
        if len(flagged) not in plan and not out_of_budget:
            continue
        looks.append(len(flagged))
        results = _summaries(seconds, flagged, looks=tuple(looks), with_drift=False, **summarise)
        if all(r.verdict != "inconclusive" for r in results) or out_of_budget or len(flagged) >= max_blocks:
            return _summaries(seconds, flagged, looks=tuple(looks), **summarise)
