"""Sensitivity suite: deliberately injected trainer bugs that the canaries must catch.

Every injected bug is declared and implemented in ``canaries.mutations.catalogue``:
each :class:`Mutation` monkeypatches the trainer in this process for the
duration of a ``with mutation.apply():`` block (``unittest.mock.patch``), so
nothing outside the block is affected. :func:`judge` (the registry's entry point) runs each
catching canary unmutated (it must pass), then, through the registry, the
catching canary once per mutation (it must fail); its record (written by the
registry) lists what ran, what was caught, and what did not apply to the preset.

NOTE [Mutation verdicts]
  1. A mutation is caught when the canary named by ``caught_by`` (a name in
     ``canaries.registry.CANARIES``) writes a failed record while the bug is
     active. The mutated canaries run on the ``quick`` profile whatever the
     suite's profile, and their records go to a scratch folder: they are
     failures by design, summarised in the suite's own record.
  2. A mutation that passes fails the suite, and so does an unmutated canary
     that fails (it would "catch" every mutation vacuously).
  3. A mutation whose bug cannot show on the preset (replay without RNG
     restore needs dropout) is listed as inapplicable, never silently passed.
  4. A mutation names the check meant to catch it (``Mutation.check``).
     Where its canary runs single checks (it does not refuse a focused
     ``CanaryRun.checks`` with ``canaries.request.CannotFocus``), the
     unmutated baseline runs the selected mutations' checks and each mutated
     run only its own: a mutation then costs about one check, not a whole
     canary run (the whole canary runs unmutated in ``rtv run`` and ``rtv
     canary``). The derivative canary runs exactly the checks named; the
     memory canary runs its admission intersections alone, and the whole
     canary for any other check. The evidence lists every check that failed.
  5. A clock cannot hide a bug it did not see, nor invent one. A mutated run
     with no failed check whose named check (any check, for a mutation that
     names none) was skipped as ``inconclusive (loaded: ...)`` (NOTE [Planner
     certificate] Rule 9) is "not caught: inconclusive (loaded)": its
     ``caught:`` check is a skip saying so, neither a pass (the suite did not
     see the bug caught) nor a failure (a loaded machine is not a wrong
     trainer); the record lists it under ``inconclusive``. A mutation whose
     named check reads no clock is never excused this way.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from validation.evidence import Check, Checks, checks_of, verify
from validation.load import is_inconclusive

from ..registry import Judged, canary
from ..request import CanaryRun, CannotFocus, silent
from .catalogue import MUTATIONS, Mutation, mutation

__all__ = ["Mutation", "MUTATIONS", "mutation", "MutationOutcome", "judge_mutation", "judge"]

MUTATED_PROFILE = "quick"


# --- the suite (NOTE Rules 1-4) --------------------------------------------------------------


@dataclass(frozen=True)
class MutationOutcome:
    name: str
    caught_by: str
    applicable: bool
    caught: bool
    failed_checks: tuple[str, ...]
    first_failure: str
    seconds: float
    inconclusive: str = ""  # Rule 5: why the named check could not decide on this machine ("" when it did)


def _failures(record: dict) -> tuple[tuple[str, ...], str]:
    failed = [c for c in checks_of(record) if c.failed]  # sorted by name in the file
    first = next((c.detail for c in failed if c.detail), failed[0].name if failed else "")
    return tuple(c.name for c in failed), first[:2000]


def _inconclusive(checks: list[Check], named: str | None) -> str:
    """Rule 5: the detail of the named check (any check when ``named`` is None) skipped as loaded, else ""."""
    return next((c.detail for c in checks if c.skipped and is_inconclusive(c.detail) and named in (None, c.name)), "")


def _focused_record(name: str, selected: Sequence[Mutation], run: CanaryRun, scratch: Path) -> dict:
    """Canary ``name``'s record, silent, on the mutated profile: only the checks of ``selected`` (Rule 4), or
    the whole canary when one of them names none or the canary refuses a subset (:class:`CannotFocus`)."""
    mine = [m for m in selected if m.caught_by == name]
    focus = None if any(m.check is None for m in mine) else tuple(dict.fromkeys(m.check for m in mine))
    asked = dataclasses.replace(run, profile=MUTATED_PROFILE, checks=focus, echo=silent)
    try:
        return verify(canary(name).run(asked, scratch))
    except CannotFocus:  # raised before the canary ran anything
        return verify(canary(name).run(dataclasses.replace(asked, checks=None), scratch))


def judge_mutation(mutation_: Mutation, run: CanaryRun, *, scratch: Path) -> MutationOutcome:
    """Run the canary that must catch ``mutation_`` with the bug injected (NOTE Rule 1)."""
    if not mutation_.applies_to(run.preset):
        return MutationOutcome(mutation_.name, mutation_.caught_by, False, False, (), "", 0.0)
    started = time.perf_counter()
    with mutation_.apply():
        record = _focused_record(mutation_.caught_by, [mutation_], run, scratch)
    failed, first = _failures(record)
    inconclusive = "" if failed else _inconclusive(checks_of(record), mutation_.check)
    return MutationOutcome(
        mutation_.name,
        mutation_.caught_by,
        True,
        bool(failed),
        failed,
        first,
        time.perf_counter() - started,
        inconclusive[:2000],
    )


def judge(run: CanaryRun, *, names: Sequence[str] | None = None) -> Judged:
    """The registry's entry point: the unmutated canaries (must pass), then every selected mutation (each must
    be caught; all of :data:`MUTATIONS` by default). The canaries run through the registry, each with
    ``run``'s preset, silent, into a scratch folder that is removed after: only the suite's own record is
    evidence of this run."""
    run.runs_every_check("mutations")
    selected = [mutation(n) for n in (names if names is not None else MUTATIONS)]
    checks = Checks(echo=run.echo)
    unmutated: dict[str, str] = {}
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="rtv-mutations-") as scratch:
        for name in dict.fromkeys(m.caught_by for m in selected):
            record = _focused_record(name, selected, run, Path(scratch))
            unmutated[name] = _failures(record)[1]
            checks.check(f"unmutated:{name} passes", record["passed"], unmutated[name] or "every check passed")
        for m in tqdm(selected, desc="mutations", unit="mutation", leave=False):
            outcome = judge_mutation(m, run, scratch=Path(scratch))
            outcomes.append(outcome)
            if outcome.inconclusive:
                checks.skip(f"caught:{m.name}", f"not caught: {outcome.inconclusive}")
            elif outcome.applicable:
                checks.check(
                    f"caught:{m.name}",
                    outcome.caught,
                    f"failed {', '.join(outcome.failed_checks)}: {outcome.first_failure}"
                    if outcome.caught
                    else f"every check of the {m.caught_by} canary passed with the bug injected",
                )
            else:
                checks.skip(f"caught:{m.name}", f"does not apply to preset {run.preset.name!r}")
    return Judged(
        "mutation-suite",
        {
            "preset": run.preset.describe(),
            "profile": run.profile,
            "mutated_profile": MUTATED_PROFILE,
            "mutations": [m.name for m in selected],
            "checks": {m.name: m.check for m in selected},
        },
        checks,
        {
            "mutations": {
                o.name: {
                    "description": MUTATIONS[o.name].description,
                    "caught_by": o.caught_by,
                    "applicable": o.applicable,
                    "caught": o.caught,
                    "failed_checks": list(o.failed_checks),
                    "first_failure": o.first_failure,
                    "seconds": round(o.seconds, 3),
                    "inconclusive": o.inconclusive,
                }
                for o in outcomes
            },
            "run": [o.name for o in outcomes if o.applicable],
            "caught": [o.name for o in outcomes if o.caught],
            "inapplicable": [o.name for o in outcomes if not o.applicable],
            "inconclusive": [o.name for o in outcomes if o.inconclusive],
            "unmutated_failures": {name: text for name, text in unmutated.items() if text},
        },
    )
