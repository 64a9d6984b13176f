"""Every registered canary, one after another, into one run folder: the loop ``rtv run`` uses on every preset.

:func:`run_canaries` runs each canary of ``canaries.registry.CANARIES`` on
one preset and profile, prints a line per canary as it finishes, and returns
one :class:`Outcome` per canary. A canary that raises is recorded as failed
(its traceback printed) and the others still run, with one exception: a
full disk (:class:`validation.errors.OutOfSpace`) stops the run, since no
later canary could write its evidence either.

Whether an outcome fails the run is :attr:`Outcome.fails_run`: a canary
registered ``enforced`` fails it when its evidence does not say passed;
a shown-not-enforced canary (the benchmark) fails it only under ``gate``
(``rtv run --gate``), which also asks the canaries that take it (the learning
canary's equivalence verdicts) to enforce their comparisons.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from validation.errors import OutOfSpace
from validation.evidence import verify

from . import registry

__all__ = ["Outcome", "run_canaries"]


@dataclass(frozen=True)
class Outcome:
    """One canary's result: its evidence (None when it raised), whether it passed, whether that fails the run."""

    name: str
    label: str
    passed: bool
    enforced: bool
    where: str  # the evidence path, or why there is none

    @property
    def fails_run(self) -> bool:
        return self.enforced and not self.passed

    @property
    def state(self) -> str:
        if self.passed:
            return "PASS"
        return "FAIL" if self.enforced else "SHOWN"  # a failed verdict the run shows but does not enforce


def run_canaries(preset: str, profile: str, run_dir: Path, *, gate: bool = False,
                 echo: Callable[[str], None] = print) -> list[Outcome]:
    """Run every registered canary on ``preset`` x ``profile`` into ``run_dir`` (module docstring)."""
    outcomes = []
    for canary in registry.CANARIES.values():
        label = f"canary {canary.name} ({profile})"
        enforced = canary.enforced or gate
        echo(f"\n== {label} ==")
        try:
            options = {"gate": True} if gate and canary.takes_gate else {}
            path = canary.run(preset, profile, run_dir, **options)
            passed, where = bool(verify(path)["passed"]), str(path)
        except OutOfSpace:
            raise
        except Exception as error:  # noqa: BLE001 - one broken canary must not hide the others (HarnessError too)
            traceback.print_exc()
            passed, where = False, f"raised {type(error).__name__}: {error}"
        outcome = Outcome(canary.name, label, passed, enforced, where)
        echo(f"{outcome.state}  {label}: {where}")
        outcomes.append(outcome)
    return outcomes
