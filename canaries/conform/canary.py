"""The conformance suite's part of ``rtv run``: this trainer's adapter passes, the negative control fails.

``judge`` runs ``validation.conform`` on the ``reference`` adapter (this
project's trainer: every check must pass) and on ``naive-async``, the
negative control (a stale backward through weights updated in place: its
*stale* check must fail, its others pass), on the default tiny spec, on the
CPU whatever the preset (the spec is a few thousand weights). The *processes*
check, which starts two processes of its own, is left out (a skip that says
why; ``rtv conform reference`` runs it) on the ``quick`` profile (``rtv run``
on ``cpu``) and inside a torchrun world (NOTE [Joined worlds] in
``validation.world``: its ranks serve rank 0's calls); otherwise every check
runs. One record of kind ``conform``.
"""

from __future__ import annotations

import time

from validation.conform import CHECKS, KIND, NEGATIVE_CONTROLS, REQUIRES, ConformSpec, conform, record_parts
from validation.world import given_world

from ..registry import Judged
from ..request import CanaryRun

__all__ = ["judge"]

ADAPTERS = ("reference", "naive-async")


def _left_out(profile: str) -> str | None:
    """Why the *processes* check is left out here, or None (module docstring)."""
    if profile == "quick":
        return f"not run on the {profile} profile"
    if given_world() is not None:
        return "not run inside a torchrun world"
    return None


def judge(run: CanaryRun) -> Judged:
    """The reference adapter and the naive-async negative control through the suite (module docstring)."""
    run.runs_every_check("conform")
    spec, started, why = ConformSpec(), time.monotonic(), _left_out(run.profile)
    checks = tuple(c for c in CHECKS if why is None or c != "processes")
    reports = [
        conform(
            adapter,
            spec,
            checks=checks,
            progress=lambda adapter, verdict: run.echo(f"  {verdict.status:15} {adapter} {verdict.check}"),
        )
        for adapter in ADAPTERS
    ]
    controls = {name: check for name, check in NEGATIVE_CONTROLS.items() if name in ADAPTERS}
    config, collected, measurements = record_parts(
        reports, spec, negative_controls=controls, seconds=round(time.monotonic() - started, 2)
    )
    for report in (r for r in reports if why is not None and REQUIRES["processes"] in r.capabilities):
        collected.skip(f"{report.name} processes", f"{why} (rtv conform {report.name} runs it)")
    return Judged(
        KIND, {**config, "preset": run.preset.name, "profile": run.profile, "device": "cpu"}, collected, measurements
    )
