"""Paired comparisons in alternating blocks: ``compare`` (docs/harness.md#paired-comparisons).

NOTE [Alternating blocks]
1. Arms on one machine drift together (thermal state, other load), so they
   are never timed as separate series: block ``i`` runs every arm in order and
   reversed (A B B A), the next block starts reversed (B A A B), and an arm's
   block time is the mean of its two runs, which cancels a linear drift.
2. ``warmup_blocks`` blocks run first and are discarded (caches, allocator,
   the load probe's calibration).
3. Each measured block gives one ratio per arm (arm time / baseline time);
   statistics, looks and verdicts are ``validation.stats`` (NOTE [Verdicts
   under repeated looks]). The run stops at the first planned look where
   every verdict is decided, after ``max_blocks`` unloaded blocks, or once
   ``budget_s`` (on ``clock``) is spent. A forced stop is examined as the
   next planned look, so the looks never exceed the plan.
4. Two witnesses flag a block as loaded (left out of the statistics): the
   relative load probe (default :class:`CpuShare`, process CPU seconds / wall
   seconds) when below ``(1 - load_tolerance)`` of its warm-up median, and
   the absolute machine meter (``validation.load.Meter``, NOTE [Machine
   load]) when other work kept more than ``LOADED_CORES`` cores busy.
5. A loaded block counts towards neither the looks nor ``max_blocks``: with a
   budget the run replaces it, up to :data:`EXTENSION` times ``max_blocks``
   blocks. More than ``max_loaded`` loaded blocks make every verdict
   ``inconclusive``: a loaded machine must never produce a gain or a
   regression.
6. An ``inconclusive`` verdict is *loaded* (``Comparison.load``; it reads
   ``inconclusive (loaded: ...)``) when blocks were loaded and either more
   than ``max_loaded`` were or the run ended short of ``max_blocks``
   unloaded blocks: the machine was too busy to decide. Otherwise it is the
   data's own answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np

from . import stats
from .load import Load, Meter, inconclusive

__all__ = [
    "Comparison",
    "LoadProbe",
    "LoadMeter",
    "CpuShare",
    "witnesses",
    "compare",
    "run_block",
    "loaded_reason",
    "MAX_LOADED",
    "EXTENSION",
]

MAX_LOADED = 0.25  # Rule 5: above this share of loaded blocks every verdict is inconclusive
EXTENSION = 4  # Rule 5: at most this many times max_blocks blocks, loaded ones replaced


class LoadProbe(Protocol):
    """Measures one block: ``start()`` before it, ``stop()`` after it returns its busy share."""

    def start(self) -> None: ...

    def stop(self) -> float: ...


class LoadMeter(Protocol):
    """Measures one block of the machine: ``start()`` before it, ``stop()`` after it (``validation.load.Meter``)."""

    def start(self) -> None: ...

    def stop(self) -> Load: ...


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


def witnesses(probe: LoadProbe | None, meter: LoadMeter | None) -> tuple[LoadProbe, LoadMeter | None]:
    """Rule 4's two witnesses as a caller's options give them: without a ``probe``, the real ones (:class:`CpuShare`
    and ``validation.load.Meter``, or the ``meter`` given); an injected ``probe`` (a fake) replaces both defaults,
    so the machine is metered then only by a ``meter`` given too."""
    if probe is None:
        return CpuShare(), meter if meter is not None else Meter()
    return probe, meter


@dataclass(frozen=True)
class Comparison:
    """One arm against the baseline.

    ``blocks``: the blocks the statistics use (measured, not loaded);
    ``ratio``: their median ratio; ``ci95``: its interval at the per-look
    level ``confidence`` (95% family-wise over the planned looks);
    ``loaded``: indices (into ``ratios``) of blocks flagged loaded (Rule 4);
    ``ratios``, ``arm_seconds``, ``baseline_seconds``: every measured block;
    ``others``: per measured block, the cores other work kept busy (empty
    without a machine meter); ``load``: why an ``inconclusive`` verdict is
    the machine's (Rule 6), else empty.
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
    others: tuple[float, ...] = ()
    load: str = ""

    @property
    def reading(self) -> str:
        """The verdict as shown: ``inconclusive (loaded: ...)`` for a loaded one (Rule 6)."""
        return inconclusive(self.load) if self.load else self.verdict

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON types (for evidence), ``reading`` included (reports show it without importing this module)."""
        return {**asdict(self), "reading": self.reading}


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


def loaded_reason(flagged: list[bool] | np.ndarray, readings: list[Load]) -> str:
    """Rule 6's words: how many blocks were loaded, and the median load the meter read in them (when metered)."""
    flagged = np.asarray(flagged, dtype=bool)
    reason = f"{int(flagged.sum())} of {flagged.size} blocks loaded"
    if len(readings) == flagged.size and flagged.any():
        others = np.median([r.others for r, f in zip(readings, flagged) if f])
        reason += f", median {float(others):.2f} of {readings[0].cores} cores busy with other work"
    return reason


def _summaries(
    seconds: dict[str, list[float]],
    flagged: list[bool],
    readings: list[Load],
    *,
    baseline: str,
    gate: float,
    confidence: float,
    max_loaded: float,
    max_blocks: int,
    alpha: float,
    looks: tuple[int, ...],
    with_drift: bool = True,
) -> list[Comparison]:
    """One :class:`Comparison` per non-baseline arm; ``with_drift=False`` (a look that may not stop) skips the drift test."""
    keep = ~np.asarray(flagged, dtype=bool)
    base = np.asarray(seconds[baseline])
    too_loaded = (~keep).mean() > max_loaded
    cut_short = (~keep).any() and (too_loaded or keep.sum() < max_blocks)  # Rule 6
    results = []
    for arm, values in seconds.items():
        if arm == baseline:
            continue
        ratios = np.asarray(values) / base
        used = ratios[keep]
        low, high = stats.median_ci(used, confidence) if used.size else (np.nan, np.nan)
        decided = "inconclusive" if too_loaded else str(stats.verdict(low, high, gate))
        results.append(
            Comparison(
                arm=arm,
                baseline=baseline,
                gate=gate,
                blocks=int(used.size),
                ratio=float(np.median(used)) if used.size else float("nan"),
                ci95=(float(low), float(high)),
                confidence=confidence,
                drift=stats.drift(used, alpha) if with_drift else stats.Drift(0.0, 1.0, False),
                loaded=tuple(int(i) for i in np.flatnonzero(~keep)),
                verdict=decided,
                looks=looks,
                ratios=tuple(ratios.tolist()),
                arm_seconds=tuple(values),
                baseline_seconds=tuple(seconds[baseline]),
                others=tuple(r.others for r in readings),
                load=loaded_reason(flagged, readings) if decided == "inconclusive" and cut_short else "",
            )
        )
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
    meter: LoadMeter | None = None,
    alpha: float = 0.05,
    load_tolerance: float = 0.2,
    max_loaded: float = MAX_LOADED,
    on_block: Callable[[int, dict[str, float]], None] | None = None,
) -> list[Comparison]:
    """Compare every arm with ``baseline`` in alternating blocks; one :class:`Comparison` per other arm, in order.

    ``arms`` maps a name to a zero-argument callable (one unit of work).
    ``on_block(index, seconds_per_arm)`` is called after each measured block
    (progress bars; arms that record extra per-block data). ``load_probe``
    and ``meter`` are Rule 4's witnesses; an injected ``load_probe`` (a
    fake) replaces both defaults, so the machine is metered then only when
    ``meter`` is given too. See the NOTE for the rules. Raises
    ``ValueError`` (state untouched, nothing run) when the baseline is
    missing, there is no other arm, or a bound is out of range.
    """
    if baseline not in arms or len(arms) < 2:
        raise ValueError(f"expected a baseline among >= 2 arms, found baseline {baseline!r} and arms {list(arms)}")
    if not 0 <= gate < 1 or max_blocks < 1 or warmup_blocks < 1 or (budget_s is not None and budget_s <= 0):
        raise ValueError(
            f"expected 0 <= gate < 1, max_blocks >= 1, warmup_blocks >= 1 (the load probe calibrates on them), "
            f"budget_s > 0 or None; found gate={gate}, max_blocks={max_blocks}, warmup_blocks={warmup_blocks}, "
            f"budget_s={budget_s}"
        )
    load_probe, meter = witnesses(load_probe, meter)
    plan = stats.planned_looks(max_blocks)
    confidence = stats.look_confidence(alpha, len(plan))
    cap = max_blocks if budget_s is None else EXTENSION * max_blocks  # Rule 5
    summarise: dict[str, Any] = dict(
        baseline=baseline, gate=gate, confidence=confidence, max_loaded=max_loaded, max_blocks=max_blocks, alpha=alpha
    )
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    shares, started = [], clock()
    for index in range(warmup_blocks):
        load_probe.start()
        run_block(arms, index, clock)
        shares.append(load_probe.stop())
    calibration = float(np.median(shares))
    flagged: list[bool] = []
    readings: list[Load] = []
    looks: list[int] = []
    while True:
        index = len(flagged)
        load_probe.start()
        if meter is not None:
            meter.start()
        times = run_block(arms, warmup_blocks + index, clock)
        busy = meter.stop() if meter is not None else None
        low_share = load_probe.stop() < (1 - load_tolerance) * calibration
        flagged.append(low_share or (busy is not None and busy.loaded))
        if busy is not None:
            readings.append(busy)
        for name, value in times.items():
            seconds[name].append(value)
        if on_block is not None:
            on_block(index, times)
        clean = flagged.count(False)
        out_of_budget = budget_s is not None and clock() - started >= budget_s
        at_end = out_of_budget or len(flagged) >= cap or clean >= max_blocks
        if not at_end and (flagged[-1] or clean not in plan):
            continue
        looks.append(clean)
        results = _summaries(seconds, flagged, readings, looks=tuple(looks), with_drift=False, **summarise)
        if all(r.verdict != "inconclusive" for r in results) or at_end:
            return _summaries(seconds, flagged, readings, looks=tuple(looks), **summarise)
