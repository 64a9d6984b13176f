"""Termination receipts: write-once evidence with cost from SkyPilot's catalog or "unpriced", shown in the report."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from validation.evidence import Checks, EvidenceError, verify

from .conftest import H200_TYPES


def _receipt(tmp_path: Path, *, handle, absent: bool = True, billed_s: float = 1800.0) -> dict:
    from ci.receipts import write_receipt

    path = write_receipt(
        tmp_path,
        command="launch",
        cluster="rtv-gate-9-1",
        requested={
            "task": "ci/gate.sky.yaml",
            "accelerators": {"H200": 2},
            "job_deadline_s": 3720,
            "evidence_dir": "rtv-out/ci/gate",
        },
        observed={"job_status": "SUCCEEDED", "last_seen": "UP", "teardown": [{"step": "down", "ok": absent}]},
        checks=Checks.of({"absence_confirmed": absent, "job_succeeded": True}),
        outcome="passed" if absent else "absence unproven",
        exit_code=0 if absent else 6,
        timings={"job": 1500.0, "teardown": 60.0},
        gpus=2,
        billed_s=billed_s,
        handle=handle,
    )
    return verify(path) | {"_path": path}


def test_a_receipt_is_priced_from_skypilots_catalog(sky_sandbox, tmp_path):
    resources = sky_sandbox.Resources(infra="lambda/us-east-1", instance_type="gpu_8x_h200")
    record = _receipt(tmp_path, handle=SimpleNamespace(launched_resources=resources, launched_nodes=2))
    _, hourly = H200_TYPES["gpu_8x_h200"]
    assert record["measurements"]["cost"]["hourly"] == pytest.approx(hourly * 2)
    assert record["measurements"]["cost"]["estimate"] == pytest.approx(hourly * 2 * 0.5)
    assert record["measurements"]["gpu_minutes"] == pytest.approx(2 * 30)
    assert len(record["measurements"]["commit"]) == 40 and record["passed"] is True


@pytest.mark.parametrize("handle_kind", ["slurm", "nothing launched"])
def test_infrastructure_without_a_price_is_unpriced_never_zero(sky_sandbox, tmp_path, handle_kind):
    handle = (
        SimpleNamespace(launched_resources=sky_sandbox.Resources(infra="slurm", cpus=1), launched_nodes=1)
        if handle_kind == "slurm"
        else None
    )
    cost = _receipt(tmp_path, handle=handle)["measurements"]["cost"]
    assert cost["estimate"] == "unpriced" and cost["reason"]


def test_a_receipt_is_written_once(tmp_path):
    record = _receipt(tmp_path, handle=None)
    path: Path = record["_path"]
    path.write_text(path.read_text().replace('"rtv-gate-9-1"', '"rtv-gate-9-2"'))
    with pytest.raises(EvidenceError):
        verify(path)


def test_the_report_section_says_absence_cost_and_what_to_do(sky_sandbox, tmp_path):
    from reports.context import Section
    from reports.receipts import section

    resources = sky_sandbox.Resources(infra="lambda/us-east-1", instance_type="gpu_2x_h200")
    handle = SimpleNamespace(launched_resources=resources, launched_nodes=1)
    good = section(_receipt(tmp_path / "a", handle=handle), tmp_path)
    assert isinstance(good, Section) and good.passed and good.verdict == "passed"
    _, hourly = H200_TYPES["gpu_2x_h200"]
    assert "absence confirmed" in good.key_figure and f"${hourly * 0.5:.2f}" in good.key_figure
    assert set(good.tables) == {"Requested and observed", "Teardown", "Timings (s)"}
    bad = section(_receipt(tmp_path / "b", handle=None, absent=False), tmp_path)
    assert not bad.passed and bad.verdict == "absence unproven" and "unpriced" in bad.key_figure
    assert "rtv gpu down rtv-gate-9-1" in bad.lines[0]
    assert bad.lines[1].startswith("SkyPilot's cost report: not checked (absence unproven")


# --- the cross-check against SkyPilot's cost report ---------------------------------------------------


def _row(name="rtv-gate-9-1", intervals=((1000, 1600),), total_cost=0.0, launched_at=None):
    return {
        "name": name,
        "launched_at": launched_at or intervals[-1][0],
        "usage_intervals": [list(i) for i in intervals],
        "duration": sum(end - start for start, end in intervals if end is not None),
        "total_cost": total_cost,
    }


def test_the_cross_check_adds_up_the_latest_launchs_usage_intervals():
    from ci.receipts import cost_cross_check

    rows = [
        _row(intervals=((100, 400),), launched_at=100),  # an earlier cluster of the same name
        _row(intervals=((900, 950), (1000, 1600)), launched_at=900),  # this one, started twice
        _row(name="rtv-other", intervals=((0, 5000),)),
    ]
    check = cost_cross_check(rows, "rtv-gate-9-1", until=1610, price=None)
    assert check == {
        "checked": True,
        "reported_s": 650.0,
        "started_at": 900,
        "closed_at": 1600,
        "total_cost": 0.0,
        "closed_by_absence": True,
        "agrees": True,
    }
    missing = cost_cross_check(rows, "rtv-gate-7-1", until=1600, price=None)
    assert missing["checked"] is False and "rtv-gate-7-1" in missing["reason"]


def test_skypilot_counting_past_the_proven_absence_or_another_price_disagrees():
    from ci.receipts import SLACK_S, cost_cross_check

    rows = [_row(intervals=((1000, 1600),), total_cost=10.0)]  # 600 s for $10: $60 an hour
    ok = cost_cross_check(rows, "rtv-gate-9-1", until=1600 - SLACK_S, price=60.0)
    assert ok["agrees"] and ok["hourly"] == pytest.approx(60.0)
    assert not cost_cross_check(rows, "rtv-gate-9-1", until=1590, price=60.0)["agrees"]  # closed after "absence"
    assert not cost_cross_check(rows, "rtv-gate-9-1", until=1600, price=50.0)["agrees"]
    still_open = cost_cross_check([_row(intervals=((1000, None),))], "rtv-gate-9-1", until=1300, price=None)
    assert still_open["reported_s"] == 300 and not still_open["agrees"]


def test_a_receipt_bills_skypilots_seconds_when_they_are_more_and_says_so(tmp_path):
    from ci.receipts import cost_cross_check, write_receipt

    # SkyPilot counted an hour from the start of provisioning; the launcher saw the last half.
    reported = cost_cross_check([_row(intervals=((1000, 4600),))], "rtv-gate-9-1", until=4610, price=None)
    path = write_receipt(
        tmp_path,
        command="down",
        cluster="rtv-gate-9-1",
        requested={"task": None},
        observed={},
        checks=Checks.of({"absence_confirmed": True}),
        outcome="absent",
        exit_code=0,
        timings={},
        gpus=2,
        billed_s=1810,
        handle=None,
        reported=reported,
    )
    m = verify(path)["measurements"]
    assert (m["billed_s"], m["billed_from"], m["launcher_s"], m["gpu_minutes"]) == (3600, "sky.cost_report", 1810, 120)
    assert m["cost"]["sky_cost_report"]["agrees"] is True
    from reports.receipts import section

    line = section(verify(path), tmp_path).lines[1]
    assert (
        line == "SkyPilot's cost report agrees: it counts 3600.0 s, the receipt bills 3600.0 s (from sky.cost_report)"
    )
