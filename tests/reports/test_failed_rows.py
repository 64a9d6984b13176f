"""Red means "this failed the record": a row the record's checks failed is red whatever its word, a shown one amber."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from reports import render_report
from reports.classes import classed_rows
from validation.evidence import make_record, write_once

FIXTURES = Path(__file__).parents[1] / "fixtures" / "evidence"
RETAIN_CHECK = "small 4x64 full: retain@s0 vs plain is not a regression (±5% gate)"


def _benchmark(*, gated: bool, retain: str) -> dict:
    """The committed benchmark record with retain@s0's verdict set; its gated check follows the verdict."""
    record = json.loads((FIXTURES / "benchmark.json").read_text())
    checks = {name: ok for name, ok in record["checks"].items() if gated or name.endswith("equals plain's")}
    for group in record["measurements"]["groups"]:
        group["gated"] = gated
        for comparison in group["comparisons"]:
            if comparison["arm"] == "retain@s0":
                comparison["verdict"] = retain
    if gated:
        checks[RETAIN_CHECK] = retain != "regression"
    return make_record("benchmark", config=record["config"], checks=checks, measurements=record["measurements"])


def _result_cells(html: str, title: str) -> list[tuple[str, str]]:
    """(class, text) of each result cell of the table after the paragraph ``title``: in the Comparisons table
    the verdict is the 10th cell of a row."""
    table = html[html.index(f"<p>{title}:</p>") :]
    table = table[: table.index("</table>")]
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)[1:]
    cells = [re.findall(r'<td(?: class="([^"]*)")?>(.*?)</td>', row, re.S) for row in rows]
    return [next((css, text) for css, text in row if css) for row in cells]


def _page(tmp_path: Path, record: dict) -> str:
    write_once(tmp_path / "run" / "benchmark.json", record)
    return render_report(tmp_path / "run", tmp_path / "page" / "index.md").html.read_text()


def test_an_enforced_regression_is_red_and_a_reported_one_amber(tmp_path: Path) -> None:
    html = _page(tmp_path, _benchmark(gated=True, retain="regression"))
    # retain@s0 vs plain: enforced (its check failed); replay@s0 vs plain: reported only; replay's floor: enforced, held
    assert _result_cells(html, "Comparisons") == [
        ("failed", "regression"),
        ("shown", "regression"),
        ("shown", "inconclusive"),
    ]


def test_a_benchmark_with_no_comparison_enforced_shows_a_regression_amber_and_its_verdict_as_shown(
    tmp_path: Path,
) -> None:
    html = _page(tmp_path, _benchmark(gated=False, retain="regression"))
    assert [css for css, _ in _result_cells(html, "Comparisons")] == ["shown", "shown", "shown"]
    assert '<td class="shown">shown: ' in html


def test_a_gated_benchmark_never_reads_shown_on_the_board(tmp_path: Path) -> None:
    html = _page(tmp_path, _benchmark(gated=True, retain="tie"))
    board = html[html.index('id="verdict-board"') : html.index('id="environment"')]
    assert "shown:" not in board and '<td class="passed">tie (passed)</td>' in board


@pytest.mark.parametrize(
    ("control", "arm", "expected"),
    [
        ("gain", "tie", ["failed", "passed"]),  # the A/A control decided: the method failed
        ("tie", "regression", ["passed", "failed"]),
        ("tie", "gain", ["passed", "shown"]),  # an arm's gain fails nothing
    ],
)
def test_the_baseline_rows_that_failed_its_checks_are_red(
    tmp_path: Path, control: str, arm: str, expected: list[str]
) -> None:
    from reports.baseline import section
    from tests.reports.test_baseline_report import _comparison, _record

    record = _record()
    record["measurements"]["comparisons"] = [
        _comparison("plain", 1.0, 0.9, 0.95, control),
        _comparison("retain@s0", 1.1, 1.08, 1.12, arm),
    ]
    built = section(record, tmp_path)
    table = built.tables["HEAD against its base"]
    rows = classed_rows(table, built.failed_rows["HEAD against its base"])
    assert [next(css for _, css in row if css) for row in rows] == expected


@pytest.mark.slow  # draws a learning section (about 2 s); the benchmark's red and amber rows are checked in the default run
def test_a_failed_gated_learning_verdict_is_red_and_an_ungated_worse_amber(tmp_path: Path) -> None:
    from reports.learning import section

    record = json.loads((FIXTURES / "learning.json").read_text())
    name, workload = next(iter(record["measurements"]["workloads"].items()))
    checks = {k: v for k, v in record["checks"].items()}
    checks[f"{name}: stale1_corrected equivalent to strict (final, gated)"] = False  # the canary's --gate check
    gated = make_record(
        "learning", config={**record["config"], "gate": True}, checks=checks, measurements=record["measurements"]
    )
    built = section(gated, tmp_path)
    title = f"{name}: verdicts (paired TOST, α = 0.05)"
    classes = [
        next(css for _, css in row if css)
        for row in classed_rows(built.tables[title], built.failed_rows.get(title, ()))
    ]
    verdicts = list(built.tables[title]["verdict"])
    failed = [(v["arm"], v["metric"]) for v, css in zip(workload["verdicts"], classes) if css == "failed"]
    assert failed == [("stale1_corrected", "final")]
    assert {css for v, css in zip(verdicts, classes) if v == "worse"} == {"failed", "shown"}


def test_a_failed_teardown_step_is_red(tmp_path: Path) -> None:
    from reports.receipts import section

    steps = [
        {"step": "sky down", "ok": False, "detail": "timed out", "seconds": 1.0},
        {"step": "sky status", "ok": True, "detail": "gone", "seconds": 0.5},
    ]
    record = {
        "kind": "gpu-receipt",
        "passed": False,
        "measurements": {
            "observed": {"teardown": steps},
            "outcome": "failed",
            "absence": "unproven",
            "cost": {"estimate": "unpriced"},
        },
    }
    table = section(record, tmp_path).tables["Teardown"]
    assert [next(css for _, css in row if css) for row in classed_rows(table)] == ["failed", "passed"]
