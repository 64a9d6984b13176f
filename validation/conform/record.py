"""A conformance run as one evidence record (kind ``conform``): checks, skips, and each verdict's evidence.

Each applicable check of each adapter is a check of the record named
``"<adapter> <check>"``; a check that is not applicable is a skip with its
reason (neither passed nor failed). A *negative control* (an adapter that
must fail one check, e.g. ``naive-async`` must fail ``stale``) records that
check as ``"<adapter> <check> fails (negative control)"``, passed only when
the check failed for the reason the control stands for (``fired``: a
*stale* failure must carry the diagnosis ``updated_weights``; not when the
adapter raised, failed for another reason, passed or was not applicable);
its other applicable checks must pass as usual.
``measurements["adapters"]`` holds every verdict with its status, reason and
evidence (the worst element and its oracle value for a failure), which the
report's table reads (``reports.conform``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from validation.evidence import Checks, make_record

from .checks import FAILED, NOT_APPLICABLE, PASSED, UPDATED_WEIGHTS, Verdict
from .protocol import ConformSpec
from .suite import CHECKS, AdapterReport

__all__ = ["KIND", "CONTROL_DIAGNOSES", "conform_record", "collect_checks", "fired", "record_parts"]

KIND = "conform"
CONTROL_DIAGNOSES = {"stale": UPDATED_WEIGHTS}  # check -> the diagnosis a control's failure of it must carry


def fired(verdict: Verdict) -> bool:
    """A negative control's check failed for the reason it stands for: its diagnosis, where the check makes one."""
    wanted = CONTROL_DIAGNOSES.get(verdict.check)
    return verdict.status == FAILED and (wanted is None or verdict.evidence.get("diagnosis") == wanted)


def _outcome(verdict: Verdict) -> str:
    return verdict.status if verdict.status != FAILED else "failed, but not for the reason it stands for"


def collect_checks(reports: Sequence[AdapterReport], negative_controls: Mapping[str, str]) -> Checks:
    """The record's checks (module docstring); ``negative_controls``: adapter name -> the check it must fail."""
    checks = Checks()
    for report in reports:
        control = negative_controls.get(report.name)
        for verdict in report.verdicts:
            name = f"{report.name} {verdict.check}"
            if verdict.check == control:  # a control that did not run (not applicable) did not fire either
                caught = fired(verdict)
                checks.check(
                    f"{name} fails (negative control)",
                    caught,
                    verdict.reason if caught else f"the negative control {_outcome(verdict)}: {verdict.reason}",
                )
            elif verdict.status == NOT_APPLICABLE:
                checks.skip(name, f"not applicable: {verdict.reason}")
            else:
                checks.check(name, verdict.status == PASSED, verdict.reason)
    return checks


def _adapter_measurements(report: AdapterReport) -> dict[str, Any]:
    return {
        "path": report.path,
        "capabilities": list(report.capabilities),
        "notes": report.notes,
        "verdicts": {
            v.check: {"status": v.status, "reason": v.reason, "evidence": v.evidence} for v in report.verdicts
        },
    }


def record_parts(
    reports: Sequence[AdapterReport],
    spec: ConformSpec,
    *,
    negative_controls: Mapping[str, str] | None = None,
    seconds: float | None = None,
) -> tuple[dict[str, Any], Checks, dict[str, Any]]:
    """The record's ``(config, checks, measurements)`` (module docstring), for ``make_record`` or a canary's ``Judged``."""
    controls = dict(negative_controls or {})
    config = {
        "spec": asdict(spec),
        "adapters": [r.path for r in reports],
        "negative_controls": controls,
        "check_order": list(CHECKS),
    }
    measurements = {"adapters": {r.name: _adapter_measurements(r) for r in reports}, "seconds": seconds}
    return config, collect_checks(reports, controls), measurements


def conform_record(
    reports: Sequence[AdapterReport],
    spec: ConformSpec,
    *,
    negative_controls: Mapping[str, str] | None = None,
    seconds: float | None = None,
) -> dict[str, Any]:
    """One schema-2 record of ``reports`` (``validation.evidence.make_record``)."""
    config, checks, measurements = record_parts(reports, spec, negative_controls=negative_controls, seconds=seconds)
    return make_record(KIND, config=config, checks=checks, measurements=measurements)
