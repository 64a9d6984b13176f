"""How busy the machine was with other work while a clock was read: the one load measure of every timing check.

NOTE [Machine load]
1. Measure: over a window, the cores other work kept busy, on average:
   (busy CPU seconds of the whole machine from ``/proc/stat``: user, nice,
   system, irq, softirq and steal) minus (CPU seconds of the measuring
   process, from ``time.process_time``, and of the helper processes it
   names, from ``/proc/<pid>/stat``), over the window's wall seconds.
   Why this one: it is system-wide and exact over the window (what competed
   with the measurement, nothing else); the load average lags by a minute
   and counts the measurement's own threads; a process's CPU-over-wall share
   (``validation.abba.CpuShare``) is relative to a calibration, so load
   present from the start is invisible to it, and so is load on the other
   cores (caches, memory bandwidth and SMT siblings are shared); ``steal``
   is time a hypervisor gave to other guests. ``/proc/stat`` counts in clock
   ticks (usually 10 ms per core): a window of ``w`` seconds on ``c`` cores
   reads within about ``c * 0.01 / w`` cores of the truth, so windows are
   blocks of tens of milliseconds or more.
2. A window is loaded when other work kept more than :data:`LOADED_CORES`
   cores busy on average: another runnable process a good part of the time,
   which a single-threaded measurement cannot be told apart from.
3. Where there is no ``/proc/stat`` (not Linux), the 1-minute load average
   less one (the measurement's own thread) stands in, said in the reading.
4. A check that reads a clock and finds the machine loaded says so as
   ``inconclusive (loaded: <reading>)`` (:func:`inconclusive`): that is a
   skip, never a failure; on an unloaded machine a wrong timing still fails.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LOADED_CORES", "Load", "Meter", "CpuReading", "read_cpu", "between", "inconclusive", "is_inconclusive"]

LOADED_CORES = 0.5  # Rule 2
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (guest time is inside user)


@dataclass(frozen=True)
class Load:
    """Rule 1's reading of one window: ``others`` cores busy with other work, of ``cores``, over ``seconds``."""

    others: float
    cores: int
    seconds: float
    source: str = "/proc/stat"

    @property
    def loaded(self) -> bool:
        """Rule 2."""
        return self.others > LOADED_CORES

    def __str__(self) -> str:
        return f"{max(self.others, 0.0):.2f} of {self.cores} cores busy with other work over {self.seconds:.1f} s ({self.source})"


@dataclass(frozen=True)
class CpuReading:
    """Counters at one instant: machine busy seconds (None without ``/proc/stat``), own CPU seconds, wall seconds."""

    busy: float | None
    own: float
    wall: float


def _machine_busy() -> float | None:
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    return sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields)) / _TICK


def _cpu_of(pid: int) -> float:
    """A helper process's CPU seconds (0 once it has exited)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime: fields 14 and 15 of proc(5)


def read_cpu(pids: Iterable[int] = ()) -> CpuReading:
    """Rule 1's counters now; ``pids``: helper processes whose CPU counts as the measurement's own."""
    return CpuReading(_machine_busy(), time.process_time() + sum(_cpu_of(p) for p in pids), time.perf_counter())


class Meter:
    """Measures windows: ``start()`` before, ``stop()`` after returns the window's :class:`Load`.

    ``pids``: a callable giving the helper processes (workers) whose CPU is
    the measurement's own; ``sampler``: the counters (tests fake it).
    """

    def __init__(
        self, pids: Callable[[], Iterable[int]] = tuple, sampler: Callable[..., CpuReading] = read_cpu
    ) -> None:
        self.pids, self.sampler = pids, sampler
        self.began = self.sampler(self.pids())

    def start(self) -> None:
        self.began = self.sampler(self.pids())

    def stop(self) -> Load:
        end = self.sampler(self.pids())
        return between(self.began, end)


def between(began: CpuReading, end: CpuReading) -> Load:
    """Rule 1 (Rule 3 without ``/proc/stat``) from two samples."""
    cores = os.cpu_count() or 1
    wall = end.wall - began.wall
    if began.busy is None or end.busy is None:
        average = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        return Load(max(average - 1.0, 0.0), cores, wall, "1-minute load average less this process")
    if wall <= 0:
        return Load(0.0, cores, 0.0)
    others = ((end.busy - began.busy) - (end.own - began.own)) / wall
    return Load(others, cores, wall)


_INCONCLUSIVE = "inconclusive (loaded: "


def inconclusive(reading: object) -> str:
    """Rule 4's words for a check the machine was too busy to decide."""
    return f"{_INCONCLUSIVE}{reading})"


def is_inconclusive(detail: str) -> bool:
    """Whether ``detail`` (a check's skip reason) is :func:`inconclusive`'s: undecided by load, neither pass nor fail."""
    return detail.startswith(_INCONCLUSIVE)
