"""Test hooks: make the next backward fail at a named stage; substitute the device's capacity and context.

Used by tests and by the canaries' mutation suite. The trainer consults
:func:`maybe_fail` at each stage of a backward (see NOTE [Gradient commit] in
``commit.py``); a fault fires once and then disarms. It reads the device's
capacity through ``admission.device_capacity``, which defers to
:func:`substitute_device_capacity` inside its block. Threads that run a
logical rank enter the trainer's device through :func:`device_context`
(``torch.cuda.device`` on CUDA), which defers to
:func:`substitute_device_context` inside its block. Every host read of a
device value (NOTE [Host syncs] in ``host_reads.py``) is reported to
:func:`observe_host_reads`. Forwards are timed by ``timing.start_stopwatch``
(CUDA events on CUDA), which defers to :func:`substitute_stopwatch`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from .errors import ConfigError

__all__ = [
    "FAULT_STAGES",
    "InjectedFault",
    "capacity_override",
    "device_context",
    "inject_fault",
    "note_host_read",
    "observe_host_reads",
    "substitute_device_capacity",
    "substitute_device_context",
    "substitute_stopwatch",
    "stopwatch_override",
]

FAULT_STAGES = ("user_autograd", "model_backward", "validate", "publish")


@contextmanager
def _pushed(stack: list, item: Any) -> Iterator[Any]:
    """``item`` is on ``stack`` (innermost last) for the duration of the block; removed by identity."""
    stack.append(item)
    try:
        yield item
    finally:
        del stack[next(i for i, entry in enumerate(stack) if entry is item)]


class InjectedFault(RuntimeError):
    """The failure that :func:`inject_fault` arranges."""


@dataclass
class _Armed:
    stage: str
    index: int | None
    fired: bool = False


_armed: list[_Armed] = []


@contextmanager
def inject_fault(stage: str, *, index: int | None = None) -> Iterator[None]:
    """Inside the block, the next backward fails at ``stage``.

    ``stage`` is one of ``FAULT_STAGES``; for ``"publish"``, ``index`` is the
    position (0-based, in publication order) of the parameter whose
    publication fails (default 0). ``index`` is only valid with ``"publish"``.
    """
    if stage not in FAULT_STAGES:
        raise ConfigError("stage", stage, f"one of {FAULT_STAGES}")
    if index is not None and stage != "publish":
        raise ConfigError("index", index, "None unless stage='publish'")
    with _pushed(_armed, _Armed(stage, index if stage != "publish" or index is not None else 0)):
        yield


def maybe_fail(stage: str, index: int | None = None) -> None:
    """Raise :class:`InjectedFault` if a fault is armed for this stage (and index)."""
    for armed in _armed:
        if not armed.fired and armed.stage == stage and armed.index == index:
            armed.fired = True
            raise InjectedFault(f"injected fault at stage {stage!r}" + (f" index {index}" if index is not None else ""))


_capacities: list[Callable[[torch.device], tuple[int, int] | None]] = []


@contextmanager
def substitute_device_capacity(capacity: int | Callable[[torch.device], int | None], *, in_use: int = 0) -> Iterator[None]:
    """Inside the block, a trainer built with ``memory_limit_bytes=None`` sees a device of ``capacity`` total bytes.

    ``capacity``: bytes (any device, CPU included), or a function of the
    device returning bytes or ``None`` (unbounded). ``in_use``: bytes of it
    that others use (not free) when the trainer is built.
    """
    if not callable(capacity) and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
        raise ConfigError("capacity", capacity, "an int >= 0 or a function of the device")
    if isinstance(in_use, bool) or not isinstance(in_use, int) or in_use < 0:
        raise ConfigError("in_use", in_use, "an int >= 0")
    total_of = capacity if callable(capacity) else (lambda device: capacity)

    def sizes(device: torch.device) -> tuple[int, int] | None:
        total = total_of(device)
        return None if total is None else (total, max(0, total - in_use))

    with _pushed(_capacities, sizes):
        yield


def capacity_override() -> Callable[[torch.device], tuple[int, int] | None] | None:
    """The innermost substituted capacity, a function of the device returning ``(total, free)`` or ``None``."""
    return _capacities[-1] if _capacities else None


_device_contexts: list[Callable[[torch.device], AbstractContextManager]] = []


@contextmanager
def substitute_device_context(enter: Callable[[torch.device], AbstractContextManager]) -> Iterator[None]:
    """Inside the block, :func:`device_context` returns ``enter(device)`` (for any device, CPU included)."""
    if not callable(enter):
        raise ConfigError("enter", type(enter).__name__, "a function of the device returning a context manager")
    with _pushed(_device_contexts, enter):
        yield


def device_context(device: torch.device) -> AbstractContextManager:
    """The context that makes ``device`` the thread's current device: ``torch.cuda.device`` on CUDA, else nothing."""
    if _device_contexts:
        return _device_contexts[-1](device)
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


_host_reads: list[list[tuple[str, torch.device]]] = []


@contextmanager
def observe_host_reads() -> Iterator[list[tuple[str, torch.device]]]:
    """Inside the block, every host read of the trainer (NOTE [Host syncs]) appends ``(why, device)`` to the list yielded."""
    with _pushed(_host_reads, []) as reads:
        yield reads


def note_host_read(why: str, device: torch.device) -> None:
    for reads in _host_reads:
        reads.append((why, device))


_stopwatches: list[Callable[[torch.device], Any]] = []


@contextmanager
def substitute_stopwatch(factory: Callable[[torch.device], Any]) -> Iterator[None]:
    """Inside the block, the trainer times forwards with ``factory(device)``.

    The object returned needs ``stop()`` (returning itself) and ``seconds()``
    (a float, or ``None`` while the device has not finished: ``timing.Stopwatch``).
    """
    if not callable(factory):
        raise ConfigError("factory", type(factory).__name__, "a function of the device returning a stopwatch")
    with _pushed(_stopwatches, factory):
        yield


def stopwatch_override() -> Callable[[torch.device], Any] | None:
    """The innermost substituted stopwatch factory, or ``None``."""
    return _stopwatches[-1] if _stopwatches else None
