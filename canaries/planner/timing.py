"""A planner cell's timed blocks: every arm in alternating blocks, the blocks a load witness flags left out.

The planner canary (``canary.py``) times each cell's admitted placements and ``auto`` here; the certificate
(NOTE [Planner certificate] Rule 9) judges only cells whose blocks were mostly unflagged. The witnesses are those
of NOTE [Alternating blocks] Rule 4 (``validation.abba``): the process's CPU share and the machine meter. The loop
is not ``abba.compare``'s: a cell has no baseline or looks, only a fixed number of blocks to keep within the grid's
budget.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from validation import abba
from validation.load import LOADED_CORES, Load

__all__ = ["LOAD_TOLERANCE", "Timing", "timed_blocks"]

LOAD_TOLERANCE = 0.2  # NOTE [Alternating blocks] Rule 4: a block below 80% of the reference share is loaded


@dataclass(frozen=True)
class Timing:
    """What :func:`timed_blocks` measured: each arm's seconds in the blocks kept, the blocks flagged as loaded and
    run, each block's CPU share, the reference share the flags were drawn against, and each block's machine reading
    (``validation.load.Load``; empty when no meter ran)."""

    seconds: dict[str, list[float]]
    loaded: int
    run: int
    shares: tuple[float, ...]
    reference: float
    readings: tuple[Load, ...] = ()

    @property
    def load(self) -> str | None:
        """The measured load when more than ``abba.MAX_LOADED`` of the blocks run were flagged, else None."""
        if self.loaded <= abba.MAX_LOADED * self.run:
            return None
        share = (
            f"{self.loaded} of {self.run} blocks loaded; CPU share median {statistics.median(self.shares):.2f} "
            f"(flagged under {1 - LOAD_TOLERANCE:.0%} of {self.reference:.2f})"
        )
        if not self.readings:
            return share
        others = statistics.median(r.others for r in self.readings)
        return f"{share}; other work median {max(others, 0.0):.2f} of {self.readings[0].cores} cores (flagged over {LOADED_CORES})"


def timed_blocks(
    arms: dict[str, Callable[[], object]],
    blocks: int,
    clock: Callable[[], float],
    probe: abba.LoadProbe,
    *,
    meter: abba.LoadMeter | None = None,
    idle_share: float = 0.0,
    extend_until: float | None = None,
) -> Timing:
    """Each arm's seconds in ``blocks`` alternating blocks after one warm-up, less the blocks flagged as loaded.

    Two witnesses flag a block (NOTE [Alternating blocks] Rule 4). The probe: its share falls below 80% of the
    reference, the warm-up's share or ``idle_share`` (what the process gets of an idle machine: one core for a
    single-threaded CPU run) when that is higher, so a machine loaded from the start is seen too. The ``meter``
    (``validation.load.Meter``; none when not given): other work kept more than ``LOADED_CORES`` cores busy, which
    the share cannot see when that work runs on the other cores (it still shares caches and memory bandwidth). A
    flagged block is replaced by a new one, at most ``blocks`` more, while one more block (as long as the last)
    ends before ``clock()`` reaches ``extend_until``."""
    probe.start()
    abba.run_block(arms, 0, clock)
    reference = max(probe.stop(), idle_share)
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    shares: list[float] = []
    readings: list[Load] = []
    kept, last = 0, 0.0  # blocks kept; the last block's seconds (a replacement must end before extend_until)

    def more() -> bool:
        if len(shares) < blocks:
            return True
        return extend_until is not None and kept < blocks and len(shares) < 2 * blocks and clock() + last < extend_until

    while more():
        probe.start()
        if meter is not None:
            meter.start()
        began = clock()
        times = abba.run_block(arms, len(shares) + 1, clock)
        last = clock() - began
        busy = meter.stop() if meter is not None else None
        shares.append(probe.stop())
        if busy is not None:
            readings.append(busy)
        if shares[-1] < (1 - LOAD_TOLERANCE) * reference or (busy is not None and busy.loaded):
            continue
        kept += 1
        for name, value in times.items():
            seconds[name].append(value)
    return Timing(seconds, len(shares) - kept, len(shares), tuple(shares), reference, tuple(readings))
