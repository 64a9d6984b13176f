"""Test hooks: make the next backward fail at a named stage; substitute the device's capacity, context and stopwatch.

Used by tests and by the canaries' mutation suite. Each context manager puts
a substitute in force for its block on one of the trainer's production seams
(``reference_trainer.seams``): the trainer consults ``seams.maybe_fail`` at
each stage of a backward (see NOTE [Gradient commit] in ``commit.py``; a
fault fires once and then disarms); it reads the device's capacity through
``admission.device_capacity``, which defers to
:func:`substitute_device_capacity`; threads that run a logical rank enter the
trainer's device through ``seams.device_context``, which defers to
:func:`substitute_device_context`; every host read of a device value (NOTE
[Host syncs] in ``host_reads.py``) is reported to :func:`observe_host_reads`;
forwards are timed by ``timing.start_stopwatch``, which defers to
:func:`substitute_stopwatch`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from . import seams
from .errors import ConfigError, int_at_least
from .seams import FAULT_STAGES, InjectedFault

__all__ = [
    "FAULT_STAGES",
    "InjectedFault",
    "inject_fault",
    "observe_host_reads",
    "substitute_device_capacity",
    "substitute_device_context",
    "substitute_stopwatch",
]


@contextmanager
def inject_fault(stage: str, *, index: int | None = None) -> Iterator[None]:
    """Inside the block, the next backward (or weight publication) fails at ``stage``.

    ``stage`` is one of ``FAULT_STAGES``; for ``"publish"``, ``index`` is the
    position (0-based, in publication order) of the parameter whose
    publication fails (default 0); for ``"weight_publication"``, the tensor
    of a rollout engine's weight publication whose staging fails (default 0).
    ``index`` is only valid with those two stages.
    """
    if stage not in FAULT_STAGES:
        raise ConfigError("stage", stage, f"one of {FAULT_STAGES}")
    indexed = stage in seams.INDEXED_STAGES
    if index is not None and not indexed:
        raise ConfigError("index", index, f"None unless stage is one of {seams.INDEXED_STAGES}")
    with seams.faults.pushed(seams.ArmedFault(stage, index if not indexed or index is not None else 0)):
        yield


@contextmanager
def substitute_device_capacity(
    capacity: int | Callable[[torch.device], int | None], *, in_use: int = 0
) -> Iterator[None]:
    """Inside the block, a trainer built with ``memory_limit_bytes=None`` sees a device of ``capacity`` total bytes.

    ``capacity``: bytes (any device, CPU included), or a function of the
    device returning bytes or ``None`` (unbounded). ``in_use``: bytes of it
    that others use (not free) when the trainer is built.
    """
    if not callable(capacity) and not int_at_least(capacity, 0):
        raise ConfigError("capacity", capacity, "an int >= 0 or a function of the device")
    if not int_at_least(in_use, 0):
        raise ConfigError("in_use", in_use, "an int >= 0")
    total_of = capacity if callable(capacity) else (lambda device: capacity)

    def sizes(device: torch.device) -> tuple[int, int] | None:
        total = total_of(device)
        return None if total is None else (total, max(0, total - in_use))

    with seams.capacities.pushed(sizes):
        yield


@contextmanager
def substitute_device_context(enter: Callable[[torch.device], AbstractContextManager[Any]]) -> Iterator[None]:
    """Inside the block, ``seams.device_context`` returns ``enter(device)`` (for any device, CPU included)."""
    if not callable(enter):
        raise ConfigError("enter", type(enter).__name__, "a function of the device returning a context manager")
    with seams.device_contexts.pushed(enter):
        yield


@contextmanager
def observe_host_reads() -> Iterator[list[tuple[str, torch.device]]]:
    """Inside the block, every host read of the trainer (NOTE [Host syncs]) appends ``(why, device)`` to the list yielded."""
    with seams.host_read_observers.pushed([]) as reads:
        yield reads


@contextmanager
def substitute_stopwatch(factory: Callable[[torch.device], Any]) -> Iterator[None]:
    """Inside the block, the trainer times forwards with ``factory(device)``.

    The object returned needs ``stop()`` (returning itself) and ``seconds()``
    (a float, or ``None`` while the device has not finished: ``timing.Stopwatch``).
    """
    if not callable(factory):
        raise ConfigError("factory", type(factory).__name__, "a function of the device returning a stopwatch")
    with seams.stopwatches.pushed(factory):
        yield
