"""Termination receipts: what a GPU CI run asked for, what it saw, whether the cluster is proven gone, what it cost.

A receipt is a write-once evidence record (``validation.evidence``) of kind
``gpu-receipt``, written by every ``rtv gpu launch`` and ``rtv gpu down``
whatever happened, at ``evidence_path(out_dir, "gpu-receipt")``. Its checks
are the facts the exit code comes from (``job_succeeded``,
``evidence_verified``, ``evidence_passed``, ``not_interrupted``,
``absence_confirmed``), so ``passed`` is true exactly when the run passed.

Cost is estimated from SkyPilot's own catalog price for what was launched
(``Resources.get_cost`` on the resources of the launch handle, or of the
handle a ``status`` census found when the launch returned none: one that
provisioned and then failed still bills what ran), times the nodes: the
hourly price times the billed span, from the cluster's own launch time (its
status record's ``launched_at``, else the first time a census saw it) to
its proven absence (``ci.teardown.RunState.billed_s``; a request that never
provisioned bills nothing). Infrastructure without a price (Slurm,
Kubernetes, an unknown instance) is recorded as ``"unpriced"`` with the
reason, never as zero.

The receipt is cross-checked against SkyPilot's own cost report
(``sky.cost_report``, which lists every user's clusters, downed ones
included) once absence is proven: :func:`cost_cross_check` takes the
latest report row of the cluster's name (a name reused after a teardown is
another row) and adds up its usage intervals. SkyPilot opens one when
provisioning starts and stamps the status record's ``launched_at`` only when
the cluster is up (seen on the local-Slurm stage: 23 s later), so its count
is usually the longer one: the receipt bills the larger of the two counts
(``billed_from``), never fewer seconds than SkyPilot counted. The receipt
``agrees`` when SkyPilot closed the cluster's interval no later than the
receipt proved it absent (within :data:`SLACK_S` of clock rounding; an
interval still open means SkyPilot still counts a cluster the receipt calls
gone) and, where both have a price, the hourly prices match within 1%. A
report that cannot be had is recorded as unchecked, with why.
A task of failover alternatives records which one ran (``alternative``,
its label: ``ci.tasks.chosen_alternative``); the price is that one's, as
the launch handle carries what was launched.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from reports.kinds import RECEIPT_KIND
from validation.evidence import Checks, evidence_path, make_record, source_fingerprint, write_once

from .tasks import chosen_alternative

__all__ = ["SLACK_S", "hourly_price", "commit", "cost_cross_check", "write_receipt"]

SLACK_S = 5.0  # seconds of rounding between SkyPilot's integer interval ends and the launcher's clock


def hourly_price(handle: Any) -> tuple[float | None, str]:
    """USD per hour for the whole cluster behind a SkyPilot launch handle, or (None, why it is unpriced)."""
    resources = getattr(handle, "launched_resources", None)
    if resources is None:
        return None, "nothing was launched"
    nodes = int(getattr(handle, "launched_nodes", 1) or 1)
    try:
        per_node = float(resources.get_cost(3600))
    except Exception as error:  # noqa: BLE001 - any catalog miss means "no price", which the receipt says
        return None, f"no catalog price for {resources}: {type(error).__name__}: {error}"
    if per_node <= 0:
        return None, f"{resources} has no price in SkyPilot's catalog"
    return per_node * nodes, f"SkyPilot catalog: {resources} x {nodes} node(s)"


def commit() -> str:
    """The commit under test: the CI's ``GITHUB_SHA`` when set, else the checkout's HEAD."""
    return os.environ.get("GITHUB_SHA") or source_fingerprint()["git_commit"]


def _cost(price: float | None, reason: str, seconds: float) -> dict[str, Any]:
    if price is None:
        return {"estimate": "unpriced", "reason": reason}
    return {"estimate": round(price * seconds / 3600, 6), "currency": "USD", "hourly": price, "source": reason}


def cost_cross_check(rows: list[dict[str, Any]], cluster: str, *, until: float, price: float | None) -> dict[str, Any]:
    """SkyPilot's cost report rows for ``cluster`` checked against a receipt (module docstring).

    ``until``: the receipt's proven absence (an interval SkyPilot has not
    closed yet ends there). Returns the fields the receipt records.
    """
    mine = [row for row in rows if row.get("name") == cluster]
    if not mine:
        return {"checked": False, "reason": f"sky.cost_report lists no cluster named {cluster!r}"}
    row = max(mine, key=lambda r: r.get("launched_at") or 0)
    intervals = [
        (float(start), None if end is None else float(end))
        for start, end in row.get("usage_intervals") or []
        if start is not None
    ]
    closed_at = intervals[-1][1] if intervals else None
    check: dict[str, Any] = {
        "checked": True,
        "reported_s": round(sum((until if end is None else end) - start for start, end in intervals), 3),
        "started_at": intervals[0][0] if intervals else None,
        "closed_at": closed_at,
        "total_cost": row.get("total_cost"),
        "closed_by_absence": closed_at is not None and closed_at <= until + SLACK_S,
    }
    duration, total = float(row.get("duration") or 0), float(row.get("total_cost") or 0.0)
    if price is not None and duration > 0 and total > 0:
        check["hourly"] = round(total * 3600 / duration, 6)
    check["agrees"] = check["closed_by_absence"] and (
        "hourly" not in check or abs(check["hourly"] - price) <= 0.01 * price
    )
    return check


def write_receipt(
    out_dir: Path,
    *,
    command: str,
    cluster: str,
    requested: dict[str, Any],
    observed: dict[str, Any],
    checks: Checks,
    outcome: str,
    exit_code: int,
    timings: dict[str, float],
    gpus: int,
    billed_s: float,
    handle: Any = None,
    reported: dict[str, Any] | None = None,
) -> Path:
    """Build and write the receipt; returns its path (see the module docstring for the fields).

    ``reported``: :func:`cost_cross_check`'s answer (None: not asked, as
    when absence is unproven); SkyPilot's seconds win when they are more.
    """
    price, reason = hourly_price(handle)
    reported = reported or {"checked": False, "reason": "absence unproven: SkyPilot's interval may still be open"}
    launcher_s = billed_s
    from_report = reported["checked"] and reported["reported_s"] > launcher_s
    billed_s = reported["reported_s"] if from_report else launcher_s
    measurements = {
        "cluster": cluster,
        "commit": commit(),
        "requested": requested,
        "observed": observed,
        "outcome": outcome,
        "exit_code": exit_code,
        "absence": "confirmed" if any(c.name == "absence_confirmed" and c.ok for c in checks) else "unproven",
        "timings_s": {name: round(seconds, 3) for name, seconds in timings.items()},
        "billed_s": round(billed_s, 3),
        "billed_from": "sky.cost_report" if from_report else "launcher",
        "launcher_s": round(launcher_s, 3),
        "gpu_minutes": round(gpus * billed_s / 60, 3),
        "alternative": chosen_alternative(handle),  # which failover alternative ran (None: one entry, or none ran)
    }
    measurements["cost"] = _cost(price, reason, billed_s) | {"sky_cost_report": reported}
    record = make_record(
        RECEIPT_KIND,
        config={"command": command, "cluster": cluster, "task": requested.get("task")},
        checks=checks,
        measurements=measurements,
    )
    return write_once(evidence_path(out_dir, RECEIPT_KIND), record)
