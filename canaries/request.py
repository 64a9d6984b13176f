"""What a canary is asked to judge: :class:`CanaryRun`, one resolved request in, one ``Judged`` out.

A canary never rebuilds its context: the caller resolves the preset once
(:func:`canary_run`: the name, the process count, this machine's stand-in)
and every canary of the run reads the same request. ``rtv run`` builds one
for the whole run (``canaries.suite``), ``rtv canary`` one for its canary
(``canaries.cli``), the mutation suite one per focused run (``checks=`` and
:func:`silent`).

- ``preset``: the resolved ``canaries.presets.Preset``, as it runs on this
  machine (``Preset.on_this_machine``); its ``processes`` is the process
  count of the logical-rank parts (``rtv run --nproc``, or the torchrun
  world's size), so the count travels in the request, never in ambient state.
- ``profile``: one of ``canaries.registry.PROFILES``.
- ``gate``: enforce the verdicts a canary otherwise only shows (the
  learning canary's equivalence verdicts). A canary with no shown verdicts
  enforces every check already, so it honours ``gate`` by ignoring it.
- ``checks``: the names of the only checks to run (``None``: all; the
  mutation suite's focused runs, NOTE [Mutation verdicts] Rule 4). A canary
  that cannot run a subset says so before it runs anything:
  :meth:`CanaryRun.runs_every_check` raises :class:`CannotFocus`, so the
  canary module is the one place that knows what it can focus on (no flag in
  the registry mirrors its signature).
- ``echo``: where the canary's lines go (each check's verdict through
  ``validation.evidence.Checks(echo=...)``); :func:`echo_line` prints and
  flushes, :func:`silent` drops them.

This module imports no torch, so ``rtv --help`` stays instant.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from validation.errors import SetupError

if TYPE_CHECKING:
    from .presets import Preset

__all__ = ["CanaryRun", "CannotFocus", "canary_run", "echo_line", "silent"]

PROFILES = ("quick", "default", "nightly")


def echo_line(line: str) -> None:
    """Print ``line`` and flush (a canary's lines interleave with its spawned processes' output)."""
    print(line, flush=True)


def silent(line: str) -> None:
    """Drop ``line`` (the mutation suite's runs, whose records it summarises)."""


class CannotFocus(SetupError):
    """A canary asked for a subset of its checks (``CanaryRun.checks``) that it can only run whole."""


@dataclass(frozen=True, kw_only=True)
class CanaryRun:
    """One request to a canary (module docstring); :func:`canary_run` resolves the preset and builds it."""

    preset: Preset
    profile: str
    gate: bool = False
    checks: tuple[str, ...] | None = None
    echo: Callable[[str], None] = echo_line

    def __post_init__(self) -> None:
        if isinstance(self.preset, str):
            raise SetupError(
                f"CanaryRun: expected a resolved canaries.presets.Preset, found the name {self.preset!r}",
                fix="build the request with canaries.request.canary_run(name, profile)",
            )
        if self.profile not in PROFILES:
            raise SetupError(f"unknown profile {self.profile!r}", fix=f"use one of {', '.join(PROFILES)}")
        if self.checks is not None and (isinstance(self.checks, str) or not isinstance(self.checks, tuple)):
            raise SetupError(
                f"CanaryRun.checks: expected a tuple of check names or None, found {self.checks!r}",
                fix="pass checks=tuple(names)",
            )

    def runs_every_check(self, canary: str) -> None:
        """:class:`CannotFocus` when ``checks`` asks for a subset: the start of a canary that runs whole."""
        if self.checks is not None:
            raise CannotFocus(
                f"canary {canary!r} runs all its checks, asked for only {list(self.checks)}",
                fix="run it without checks=",
            )


def canary_run(
    preset_name: str,
    profile: str,
    *,
    processes: int | None = None,
    gate: bool = False,
    checks: Sequence[str] | None = None,
    echo: Callable[[str], None] = echo_line,
) -> CanaryRun:
    """The request for preset ``preset_name`` on ``processes`` processes (``None``: the preset's own), resolved
    once as it runs on this machine; ``SetupError`` for an unknown preset or profile or a bad count."""
    from .presets import preset

    return CanaryRun(
        preset=preset(preset_name, processes).on_this_machine(),
        profile=profile,
        gate=gate,
        checks=None if checks is None else tuple(checks),
        echo=echo,
    )
