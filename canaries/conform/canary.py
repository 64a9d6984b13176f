"""The conformance suite's part of ``rtv run``: this trainer's adapter passes, the negative control fails.

``judge`` runs ``validation.conform`` on the ``reference`` adapter (this
project's trainer: every check must pass) and on ``naive-async``, the
negative control (a stale backward through weights updated in place: its
*stale* check must fail, its others pass), on the default tiny spec, on the
CPU whatever the preset (the spec is a few thousand weights). The ``quick``
profile (``rtv run`` on ``cpu``) leaves out the *processes* check, which
starts two processes (a skip that says so; ``rtv conform reference`` runs
it); the other profiles run every check. One record of kind ``conform``.
"""

from __future__ import annotations

import time

from validation.conform import CHECKS, NEGATIVE_CONTROLS, REQUIRES, ConformSpec, conform, record_parts

from ..registry import Judged

__all__ = ["judge"]

KIND = "conform"
ADAPTERS = ("reference", "naive-async")
QUICK_LEAVES_OUT = ("processes",)


def _print(adapter: str, verdict) -> None:
    print(f"  {verdict.status:15} {adapter} {verdict.check}", flush=True)


def judge(preset: str, profile: str) -> Judged:
    """The reference adapter and the naive-async negative control through the suite (module docstring)."""
    spec, started = ConformSpec(), time.monotonic()
    checks = tuple(c for c in CHECKS if profile != "quick" or c not in QUICK_LEAVES_OUT)
    reports = [conform(adapter, spec, checks=checks, progress=_print) for adapter in ADAPTERS]
    controls = {name: check for name, check in NEGATIVE_CONTROLS.items() if name in ADAPTERS}
    config, collected, measurements = record_parts(reports, spec, negative_controls=controls,
                                                   seconds=round(time.monotonic() - started, 2))
    for report in reports:
        for check in (c for c in QUICK_LEAVES_OUT if c not in checks and REQUIRES[c] in report.capabilities):
            collected.skip(f"{report.name} {check}", f"not run on the {profile} profile (rtv conform {report.name} "
                                                     "runs it)")
    return Judged(KIND, {**config, "preset": preset, "profile": profile, "device": "cpu"}, collected, measurements)
