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
    return main(["report", "--in", str(folder / "bench"), "--out", str(folder / "report" / "index.md"), "--summary"]), folder / "report"


def test_a_tie_run_writes_a_summary_and_no_pr_comment(tmp_path: Path) -> None:
    code, report = _summarise(tmp_path, {"retain@s0": 1.0, "replay@s0": 1.0, "offload@s2": 1.0})
    summary = (report / "summary.md").read_text()
    assert code == 0 and not (report / "pr-comment.md").exists()
    assert "no regression in 4 comparisons" in summary and "| retain@s0 vs plain | 1.000 [1.000, 1.000] | **tie**" in summary
    assert "[full report](index.html)" in summary and "(../bench/benchmark-cpu-" in summary


def test_a_regression_run_writes_a_pr_comment_with_the_regressions_only(tmp_path: Path) -> None:
    code, report = _summarise(tmp_path, {"retain@s0": 1.2, "replay@s0": 1.0, "offload@s2": 1.0})
    comment = (report / "pr-comment.md").read_text()
    assert code == 1 and "1 regression(s) in 4 comparisons" in (report / "summary.md").read_text()
    assert "found 1 regression(s)" in comment and "| retain@s0 vs plain | 1.200 [1.200, 1.200] | **regression**" in comment
    assert "replay@s0 vs plain" not in comment


def test_a_stale_comment_is_removed_when_the_run_has_no_regression(tmp_path: Path) -> None:
    stale = tmp_path / "report" / "pr-comment.md"
    stale.parent.mkdir(parents=True)
    stale.write_text("an earlier run's comment")
    _summarise(tmp_path, {})
    assert not stale.exists()
