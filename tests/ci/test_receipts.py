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
        tmp_path, command="launch", cluster="rtv-gate-9-1",
        requested={"task": "ci/gate.sky.yaml", "accelerators": {"H200": 2}, "job_deadline_s": 3720,
                   "evidence_dir": "rtv-out/ci/gate"},
        observed={"job_status": "SUCCEEDED", "last_seen": "UP", "teardown": [{"step": "down", "ok": absent}]},
        checks=Checks.of({"absence_confirmed": absent, "job_succeeded": True}),
        outcome="passed" if absent else "absence unproven", exit_code=0 if absent else 6,
        timings={"job": 1500.0, "teardown": 60.0}, gpus=2, billed_s=billed_s, handle=handle,
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
    handle = (SimpleNamespace(launched_resources=sky_sandbox.Resources(infra="slurm", cpus=1), launched_nodes=1)
              if handle_kind == "slurm" else None)
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
