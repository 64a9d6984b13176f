"""The report's view of a GPU CI termination receipt (kind ``gpu-receipt``, written by ``ci.receipts``).

One line says what happened and whether the cluster is proven gone; the
key figure is the cluster's absence and what the run cost; tables give
requested against observed, the teardown steps and the timings. It reads
the record only (no figures).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from .context import Section
from .kinds import RECEIPT_KIND

__all__ = ["section"]


def _cost(cost: dict[str, Any]) -> str:
    if cost.get("estimate") == "unpriced":
        return f"unpriced ({cost.get('reason', 'no catalog price')})"
    return f"≈ ${float(cost['estimate']):.2f} at ${float(cost['hourly']):.2f}/h"


def _cross_check(m: dict[str, Any]) -> str:
    reported = (m.get("cost") or {}).get("sky_cost_report") or {}
    if not reported.get("checked"):
        return f"SkyPilot's cost report: not checked ({reported.get('reason', 'an older receipt')})"
    verdict = "agrees" if reported.get("agrees") else "DISAGREES"
    return (
        f"SkyPilot's cost report {verdict}: it counts {reported.get('reported_s')} s, the receipt bills "
        f"{m.get('billed_s')} s (from {m.get('billed_from', 'launcher')})"
    )


def _requested_observed(m: dict[str, Any]) -> pd.DataFrame:
    requested, observed = m.get("requested") or {}, m.get("observed") or {}
    launched = observed.get("launched") or {}
    interruption = observed.get("interruption") or {}
    evidence = observed.get("evidence") or {}
    rows = [
        ("task", requested.get("task"), launched.get("resources", "nothing launched")),
        ("accelerators", requested.get("accelerators"), f"{launched.get('nodes', 0)} node(s)"),
        ("job", f"finish within {requested.get('job_deadline_s', '-')} s", observed.get("job_status") or "no status"),
        ("evidence", requested.get("evidence_dir"), evidence.get("summary", "not fetched")),
        (
            "interruption",
            "none",
            f"{interruption.get('kind')} during {interruption.get('phase')}: {interruption.get('detail')}"
            if interruption
            else "none",
        ),
    ]
    return pd.DataFrame(rows, columns=["what", "requested", "observed"])


def _teardown(steps: list[dict[str, Any]]) -> pd.DataFrame:
    """The teardown steps (``ci.teardown``), each step's ``ok`` as its ``result`` (a failed step is red on the page)."""
    rows = [
        {
            "step": s.get("step"),
            "result": "pass" if s.get("ok") else "FAIL",
            "detail": s.get("detail"),
            "seconds": s.get("seconds"),
        }
        for s in steps
    ]
    return pd.DataFrame(rows, columns=["step", "result", "detail", "seconds"])


def section(record: dict[str, Any], folder: Path) -> Section:
    """The receipt's section (``folder`` is unused: a receipt has no figures)."""
    m = record["measurements"]
    absence = m.get("absence", "unproven")
    observed = m.get("observed") or {}
    line = (
        f"{m.get('outcome')} (exit {m.get('exit_code')}): cluster {m.get('cluster')} at commit "
        f"{str(m.get('commit'))[:12]}, absence {absence}"
    )
    if absence != "confirmed":
        line += f"; last seen: {observed.get('last_seen')}. Run `rtv gpu down {m.get('cluster')}` now"
    tables = {"Requested and observed": _requested_observed(m)}
    steps = observed.get("teardown") or []
    if steps:
        tables["Teardown"] = _teardown(steps)
    tables["Timings (s)"] = pd.DataFrame(sorted((m.get("timings_s") or {}).items()), columns=["phase", "seconds"])
    return Section(
        kind=RECEIPT_KIND,
        title=f"GPU CI receipt: {m.get('cluster')}",
        passed=bool(record.get("passed")),
        verdict=str(m.get("outcome")),
        key_figure=f"absence {absence}; {m.get('gpu_minutes', 0):g} GPU-minutes, {_cost(m.get('cost') or {})}",
        lines=[line, _cross_check(m)],
        tables=tables,
    )
