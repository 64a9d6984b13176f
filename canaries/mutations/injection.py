"""What a mutation is: one known bug, the canary that must catch it, and how to inject it.

A :class:`Mutation` puts its bug back into the real trainer for the duration
of a ``with mutation.apply():`` block, by patching a named seam of the fixed
code with ``unittest.mock.patch`` (:func:`patched` for the one-line
replacements), and names the canary and the check meant to catch it
(NOTE [Mutation verdicts]). While a block is open, :func:`active_mutations`
names its bug, so a check that spawns ranks can apply it there too. The bugs
themselves are listed in ``canaries.mutations.catalogue``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

from ..presets import Preset

__all__ = ["Mutation", "active_mutations", "patched"]

_ACTIVE: list[str] = []  # the mutations applied now in this process, outermost first


def active_mutations() -> tuple[str, ...]:
    """The names of the mutations active in this process: a check that spawns ranks applies them there too."""
    return tuple(_ACTIVE)


@dataclass(frozen=True)
class Mutation:
    """A known bug: what it breaks, which registered canary (and which of its checks) must catch it, how to inject it."""

    name: str
    description: str
    caught_by: str
    inject: Callable[[], contextlib.AbstractContextManager[Any]]
    check: str | None = None  # the check of ``caught_by`` meant to catch it (NOTE [Mutation verdicts] Rule 4)
    needs_dropout: bool = False

    @contextlib.contextmanager
    def apply(self) -> Iterator[None]:
        """The bug, active inside the block; :func:`active_mutations` names it meanwhile (for spawned ranks)."""
        _ACTIVE.append(self.name)
        try:
            with self.inject():
                yield
        finally:
            _ACTIVE.remove(self.name)

    def applies_to(self, config: Preset) -> bool:
        return not self.needs_dropout or config.model.dropout > 0


def patched(target: Any, attribute: str, value: Any) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """An injector that replaces ``target.attribute`` by ``value`` inside its block."""
    return lambda: mock.patch.object(target, attribute, value)
