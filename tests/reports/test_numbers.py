"""No "nan" reaches a person: the page, the summary, the PR comment and the terminal say "n/a" where a number is missing."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from canaries.benchmark.command import _print_record
from canaries.cli import main
from reports.learning import _headline, verdict_table
from validation.evidence import make_record, write_once

FIXTURES = Path(__file__).parents[1] / "fixtures" / "evidence"
NAN = re.compile(r"\bnan\b", re.IGNORECASE)


def _no_nan(text: str) -> list[str]:
    text = re.sub(r"data:image/png;base64,[^\"]*", "", text)  # a PNG's bytes are not text a person reads
    return [line for line in text.splitlines() if NAN.search(line)]


def _benchmark_without_intervals() -> dict:
    """The committed benchmark record with every comparison undecidable: no ratio, interval or drift."""
    record = json.loads((FIXTURES / "benchmark.json").read_text())
    for group in record["measurements"]["groups"]:
        for comparison in group["comparisons"] + ([group["replay_floor"]] if group["replay_floor"] else []):
            comparison.update(ratio=math.nan, ci95=[math.nan, math.nan], verdict="regression")
            comparison["drift"]["rho"] = math.nan
    return make_record(
        record["kind"],
        config=record["config"],
        checks={"retain@s0 is not a regression": False},
        measurements=record["measurements"],
    )


def test_missing_numbers_read_n_a_on_the_page_the_summary_the_comment_and_the_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = _benchmark_without_intervals()
    write_once(tmp_path / "run" / "benchmark.json", record)
    main(["report", "--in", str(tmp_path / "run"), "--out", str(tmp_path / "page" / "index.md"), "--summary"])
    _print_record(record)
    shown = {"terminal": capsys.readouterr().out}
    shown |= {
        path.name: path.read_text() for path in (tmp_path / "page").glob("*.*") if path.suffix in (".md", ".html")
    }
    assert {"index.md", "index.html", "summary.md", "pr-comment.md"} <= set(shown)
    assert {name: _no_nan(text) for name, text in shown.items()} == {name: [] for name in shown}
    assert "n/a" in shown["summary.md"] and "n/a" in shown["index.md"]


def test_a_learning_comparison_without_an_interval_says_n_a() -> None:
    learning = json.loads((FIXTURES / "learning.json").read_text())
    workload = learning["measurements"]["workloads"]["next_byte"]
    for verdict in workload["verdicts"]:
        verdict.update(ci_low=math.nan, ci_high=math.nan, p_tost=math.nan, mean_difference=math.nan)
    key, lines, _ = _headline({"next_byte": workload})
    table = verdict_table(workload).to_string()
    assert not _no_nan("\n".join([key, *lines, table])) and "n/a" in key and "no interval" in key
