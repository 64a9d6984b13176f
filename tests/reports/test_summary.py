"""``rtv report --summary``: the CI summary of benchmark records, and a PR comment only on a regression (fake clock)."""

from __future__ import annotations

from pathlib import Path

import pytest

from canaries.benchmark import canary as benchmark
from canaries.cli import main
from tests.benchmark_fakes import run_fake, tiny_plan


@pytest.fixture(autouse=True)
def tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(benchmark, "plan", tiny_plan)


def _summarise(folder: Path, costs: dict[str, float]) -> tuple[int, Path]:
    run_fake(folder / "bench", costs, real_steps=3)
    return main(
        ["report", "--in", str(folder / "bench"), "--out", str(folder / "report" / "index.md"), "--summary"]
    ), folder / "report"


def test_a_tie_run_writes_a_summary_and_no_pr_comment(tmp_path: Path) -> None:
    code, report = _summarise(tmp_path, {"retain@s0": 1.0, "replay@s0": 1.0, "offload@s2": 1.0})
    summary = (report / "summary.md").read_text()
    assert code == 0 and not (report / "pr-comment.md").exists()
    assert (
        "no regression in 4 comparisons" in summary
        and "| retain@s0 vs plain | 1.000 [1.000, 1.000] | **tie**" in summary
    )
    assert "[full report](index.html)" in summary and "(../bench/benchmark-cpu-" in summary


def test_a_regression_run_writes_a_pr_comment_with_the_regressions_only(tmp_path: Path) -> None:
    code, report = _summarise(tmp_path, {"retain@s0": 1.2, "replay@s0": 1.0, "offload@s2": 1.0})
    comment = (report / "pr-comment.md").read_text()
    assert code == 1 and "1 regression(s) in 4 comparisons" in (report / "summary.md").read_text()
    assert (
        "found 1 regression(s)" in comment and "| retain@s0 vs plain | 1.200 [1.200, 1.200] | **regression**" in comment
    )
    assert "replay@s0 vs plain" not in comment


@pytest.mark.slow  # a third summary run (about 0.8 s)
def test_a_stale_comment_is_removed_when_the_run_has_no_regression(tmp_path: Path) -> None:
    stale = tmp_path / "report" / "pr-comment.md"
    stale.parent.mkdir(parents=True)
    stale.write_text("an earlier run's comment")
    _summarise(tmp_path, {})
    assert not stale.exists()


FIXTURES = Path(__file__).parents[1] / "fixtures" / "evidence"


def test_a_reported_only_arm_slower_than_plain_by_design_is_no_regression_of_the_pr(tmp_path: Path) -> None:
    """The committed benchmark: replay@s0 vs plain is a regression by design (reported), every record passed."""
    from reports.summary import write_summary

    written = write_summary(FIXTURES, tmp_path)
    summary = written.summary.read_text()
    assert written.regressions == 0 and written.comment is None and not (tmp_path / "pr-comment.md").exists()
    assert "### rtv bench: no regression in 3 comparisons" in summary
    assert "| replay@s0 vs plain | " in summary and "**regression (reported)**" in summary


def test_a_baselines_arm_regression_counts_and_its_a_a_control_does_not(tmp_path: Path) -> None:
    from reports.summary import write_summary
    from tests.reports.test_baseline_report import _comparison, _record
    from validation.evidence import make_record, write_once

    record = _record()
    record["measurements"]["comparisons"] = [
        _comparison("plain", 1.1, 1.08, 1.12, "regression"),
        _comparison("retain@s0", 1.1, 1.08, 1.12, "regression"),
    ]
    write_once(
        tmp_path / "in" / "baseline.json",
        make_record(
            "benchmark-baseline", config=record["config"], checks=record["checks"], measurements=record["measurements"]
        ),
    )
    written = write_summary(tmp_path / "in", tmp_path / "out")
    assert written.regressions == 1 and "| retain@s0 vs v1 |" in written.comment.read_text()
    assert "| plain vs v1 |" not in written.comment.read_text()


def test_every_failed_or_invalid_record_leads_the_summary_and_makes_a_comment(tmp_path: Path) -> None:
    """A failed correctness canary (no comparison, no raise) and a file that does not verify are findings too; the
    committed fixtures (every record passed) are the control above: no comment."""
    import shutil

    from reports.summary import write_summary
    from validation.evidence import make_record, write_once

    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(FIXTURES / "memory.json", folder / "memory.json")  # passed: not listed
    checks = {"agrees with the FP64 oracle": False, "refuses a stale bound": True, "restores the RNG": False}
    config = {"preset": "cpu", "injected": {"mutation": "stale_weights"}}
    write_once(
        folder / "derivative.json", make_record("derivative-canary", config=config, checks=checks, measurements={})
    )
    (folder / "cut.json").write_text('{"schema_version": 2, "kind": "smo')  # cut off while written
    written = write_summary(folder, tmp_path / "out")
    assert (written.failed, written.raised, written.regressions) == (2, 0, 0) and written.comment is not None
    lines = written.comment.read_text().splitlines()
    assert lines[0] == "**FAILED: 2 record(s)**"
    assert (
        "| derivative | **failed 2 check(s): agrees with the FP64 oracle, restores the RNG** | mutation: stale_weights | "
        "- | [record](../in/derivative.json) |" in lines
    )
    assert any(line.startswith("| cut | **invalid: does not verify: ") for line in lines), lines
    assert "memory" not in written.summary.read_text().split("### rtv bench")[0]
