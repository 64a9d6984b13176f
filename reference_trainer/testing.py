"""Test hooks: make the next backward fail at a named stage.

Used by tests and by the canaries' mutation suite; the trainer consults
:func:`maybe_fail` at each stage of a backward (see NOTE [Gradient commit] in
``commit.py``). A fault fires once and then disarms.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["inject_fault", "InjectedFault", "FAULT_STAGES"]

FAULT_STAGES = ("user_autograd", "model_backward", "validate", "publish")


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
    armed = _Armed(stage, index if stage != "publish" or index is not None else 0)
    _armed.append(armed)
    try:
        yield
    finally:
        _armed.remove(armed)


def maybe_fail(stage: str, index: int | None = None) -> None:
    """Raise :class:`InjectedFault` if a fault is armed for this stage (and index)."""
    for armed in _armed:
        if not armed.fired and armed.stage == stage and armed.index == index:
            armed.fired = True
            raise InjectedFault(f"injected fault at stage {stage!r}" + (f" index {index}" if index is not None else ""))
