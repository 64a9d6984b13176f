"""The trainer's production seams: where it reads the device, enters it, reads a device value or may fail on purpose.

Each seam does the real thing unless a substitute is in force;
``reference_trainer.testing`` holds the context managers that put one in
force for a block (:class:`Overrides`, innermost wins). The trainer calls:

- :func:`maybe_fail` at each stage of a backward (NOTE [Gradient commit] in
  ``commit.py``) and at each tensor a rollout engine stages from a weight
  publication (``"weight_publication"``, NOTE [Weight publication]): raises
  :class:`InjectedFault` once if a fault is armed;
- :func:`capacity_override` from ``admission.device_capacity`` (the device's
  total and free memory);
- :func:`device_context` from threads that run a logical rank
  (``torch.cuda.device`` on CUDA);
- :func:`note_host_read` for every host read of a device value (NOTE [Host
  syncs] in ``host_reads.py``);
- :func:`stopwatch_override` from ``timing.start_stopwatch``;
- ``planner_miss_observers`` from ``misses.report`` (NOTE [Planner misses]).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

__all__ = [
    "FAULT_STAGES",
    "INDEXED_STAGES",
    "ArmedFault",
    "InjectedFault",
    "Overrides",
    "capacity_override",
    "capacities",
    "device_context",
    "device_contexts",
    "faults",
    "host_read_observers",
    "maybe_fail",
    "note_host_read",
    "planner_miss_observers",
    "stopwatch_override",
    "stopwatches",
]

T = TypeVar("T")

FAULT_STAGES = ("user_autograd", "model_backward", "validate", "publish", "weight_publication")
INDEXED_STAGES = ("publish", "weight_publication")  # a fault there names the tensor's index


class Overrides(Generic[T]):
    """A stack of substitutes for one seam; the innermost (last pushed) is in force."""

    def __init__(self) -> None:
        self._stack: list[T] = []

    @contextmanager
    def pushed(self, item: T) -> Iterator[T]:
        """``item`` is on the stack for the duration of the block; removed by identity (blocks may interleave)."""
        self._stack.append(item)
        try:
            yield item
        finally:
            del self._stack[next(i for i, entry in enumerate(self._stack) if entry is item)]

    def innermost(self) -> T | None:
        return self._stack[-1] if self._stack else None

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._stack))


class InjectedFault(RuntimeError):
    """The failure that ``testing.inject_fault`` arranges."""


@dataclass
class ArmedFault:
    """A fault armed for ``stage`` (and, for an indexed stage, the tensor ``index``); fires once."""

    stage: str
    index: int | None
    fired: bool = False


faults: Overrides[ArmedFault] = Overrides()
capacities: Overrides[Callable[[torch.device], tuple[int, int] | None]] = Overrides()
device_contexts: Overrides[Callable[[torch.device], AbstractContextManager[Any]]] = Overrides()
host_read_observers: Overrides[list[tuple[str, torch.device]]] = Overrides()
stopwatches: Overrides[Callable[[torch.device], Any]] = Overrides()
planner_miss_observers: Overrides[Callable[[Any], None]] = Overrides()


def maybe_fail(stage: str, index: int | None = None) -> None:
    """Raise :class:`InjectedFault` if a fault is armed for this stage (and index)."""
    for armed in faults:
        if not armed.fired and armed.stage == stage and armed.index == index:
            armed.fired = True
            raise InjectedFault(f"injected fault at stage {stage!r}" + (f" index {index}" if index is not None else ""))


def capacity_override() -> Callable[[torch.device], tuple[int, int] | None] | None:
    """The innermost substituted capacity, a function of the device returning ``(total, free)`` or ``None``."""
    return capacities.innermost()


def device_context(device: torch.device) -> AbstractContextManager[Any]:
    """The context that makes ``device`` the thread's current device: ``torch.cuda.device`` on CUDA, else nothing."""
    enter = device_contexts.innermost()
    if enter is not None:
        return enter(device)
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def note_host_read(why: str, device: torch.device) -> None:
    """Report a host read of a value on ``device`` to every observer in force."""
    for reads in host_read_observers:
        reads.append((why, device))


def stopwatch_override() -> Callable[[torch.device], Any] | None:
    """The innermost substituted stopwatch factory, or ``None``."""
    return stopwatches.innermost()
