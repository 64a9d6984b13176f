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
reason, never as zero. Not done: a cross-check against ``sky.cost_report``.
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

__all__ = ["hourly_price", "commit", "write_receipt"]


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
) -> Path:
    """Build and write the receipt; returns its path (see the module docstring for the fields)."""
    price, reason = hourly_price(handle)
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
        "gpu_minutes": round(gpus * billed_s / 60, 3),
        "alternative": chosen_alternative(handle),  # which failover alternative ran (None: one entry, or none ran)
    }
    measurements["cost"] = _cost(price, reason, billed_s)
    record = make_record(RECEIPT_KIND, config={"command": command, "cluster": cluster, "task": requested.get("task")},
                         checks=checks, measurements=measurements)
    return write_once(evidence_path(out_dir, RECEIPT_KIND), record)
