"""How long a forward took on its device, without waiting for the device.

On the CPU the work is done when the call returns: the wall clock measures it.
On CUDA a call returns once its kernels are queued, so a wall clock measures
launches, not work (replay would look nearly free to the planner). There a
:class:`Stopwatch` records a CUDA event before and after the forward and
reads their elapsed time only once the device has passed the second event
(``Event.query``, which never blocks): the measurement arrives a little late
and costs no host sync. Tests substitute the stopwatch with
``testing.substitute_stopwatch``.
"""

from __future__ import annotations

import time

import torch

from . import seams

__all__ = ["Stopwatch", "start_stopwatch"]


class Stopwatch:
    """Seconds between :meth:`__init__` and :meth:`stop` of work on ``device``; ``None`` until known."""

    def __init__(self, device: torch.device) -> None:
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._seconds: float | None = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record(torch.cuda.current_stream(device))
            self._device = device
        else:
            self._started = time.perf_counter()

    def stop(self) -> Stopwatch:
        if self._events is not None:
            self._events[1].record(torch.cuda.current_stream(self._device))
        else:
            self._seconds = time.perf_counter() - self._started
        return self

    def seconds(self) -> float | None:
        """The measured seconds, or ``None`` while the device has not finished the work (never blocks)."""
        if self._seconds is None and self._events is not None and self._events[1].query():
            self._seconds = self._events[0].elapsed_time(self._events[1]) / 1e3
        return self._seconds


def start_stopwatch(device: torch.device) -> Stopwatch:
    """A running stopwatch for work on ``device`` (the substituted one inside ``testing.substitute_stopwatch``)."""
    factory = seams.stopwatch_override()
    return factory(device) if factory is not None else Stopwatch(device)
