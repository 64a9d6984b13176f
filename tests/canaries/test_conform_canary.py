"""The conformance suite's part of ``rtv run`` (``canaries/conform/canary.py``): the run passes only when the
reference adapter passes and the naive-async negative control fails its stale check.

The fast tests put the cheap ``snapshot-async`` adapter where ``reference``
stands (the wiring is the same); the slow one judges the real pair.
"""

from __future__ import annotations

import pytest

from canaries.conform import canary
from canaries.registry import CANARIES
from canaries.request import canary_run
from validation.evidence import checks_of, verify


@pytest.fixture
def cheap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(canary, "ADAPTERS", ("snapshot-async", "naive-async"))


def test_the_record_passes_when_the_negative_control_fails_stale(cheap: None, tmp_path) -> None:
    record = verify(CANARIES["conform"].record("cpu", canary.judge(canary_run("cpu", "quick")), tmp_path))
    assert record["kind"] == "conform" and record["passed"]
    assert record["checks"]["naive-async stale fails (negative control)"] is True
    assert record["checks"]["snapshot-async stale"] is True
    assert "snapshot-async processes" not in record["skips"]  # it does not claim processes: not applicable, no skip


def test_processes_is_left_out_on_quick_and_inside_a_torchrun_world(monkeypatch: pytest.MonkeyPatch) -> None:
    assert canary._left_out("quick") == "not run on the quick profile"
    monkeypatch.setenv("RANK", "0")
    for name, value in (("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    assert canary._left_out("default") == "not run inside a torchrun world"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name)
    assert canary._left_out("default") is None


def test_the_record_fails_when_the_negative_control_does_not_fire(
    cheap: None, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setattr(canary, "NEGATIVE_CONTROLS", {"naive-async": "splits"})  # a check it passes
    record = verify(CANARIES["conform"].record("cpu", canary.judge(canary_run("cpu", "quick")), tmp_path))
    assert not record["passed"]
    failed = {c.name: c.detail for c in checks_of(record) if c.failed}
    assert set(failed) == {"naive-async splits fails (negative control)", "naive-async stale"}
    assert failed["naive-async splits fails (negative control)"].startswith("the negative control passed")


@pytest.mark.slow
def test_the_reference_passes_and_naive_async_fails_stale_on_the_quick_profile(tmp_path) -> None:
    record = verify(CANARIES["conform"].record("cpu", canary.judge(canary_run("cpu", "quick")), tmp_path))
    assert record["passed"], record["details"]
    assert {name for name, ok in record["checks"].items() if ok} == {
        "reference sync",
        "reference stale",
        "reference splits",
        "reference resume",
        "naive-async sync",
        "naive-async stale fails (negative control)",
        "naive-async splits",
    }
    assert record["skips"]["reference processes"].startswith("not run on the quick profile")
