"""The verdict board says what each record is: red only for what failed, shown verdicts as shown, one name per canary."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from canaries.registry import CANARIES
from reports import render_report
from reports.kinds import KINDS
from validation.evidence import make_record, write_once

WORDS = "the regression check failed: a failed backward is a regression"


@pytest.fixture
def fixture_page(fixture_report) -> tuple[str, str]:
    """The committed records of a passing run, rendered once (``conftest.py``): (Markdown, HTML)."""
    assert fixture_report.passed
    return fixture_report.markdown.read_text(), fixture_report.html.read_text()


def _board(markdown: str) -> dict[str, str]:
    """The board's rows: canary name -> verdict cell."""
    board = markdown[markdown.index("## Verdict board") : markdown.index("## Environment")]
    return {
        cells[0]: cells[1]
        for cells in (line.strip("| ").split(" | ") for line in board.splitlines() if "](#section-" in line)
    }


def _mutations(caught: bool) -> dict:
    one = {
        "description": WORDS,
        "caught_by": "derivative",
        "applicable": True,
        "caught": caught,
        "failed_checks": ["regression: failed"] if caught else [],
        "first_failure": "",
        "seconds": 1,
    }
    return make_record(
        "mutation-suite",
        config={},
        checks={f"caught: {WORDS}": caught},
        measurements={
            "mutations": {"failed_regression": one},
            "run": ["failed_regression"],
            "caught": ["failed_regression"] if caught else [],
            "inapplicable": [],
        },
    )


def _classes(html: str) -> set[str]:
    return set(re.findall(r'class="([^"]*)"', html))


@pytest.mark.slow  # renders a whole run's page (about 3 s); a row's class from its result is checked cell by cell in test_failed_rows.py
def test_a_passing_run_whose_cells_say_failed_or_regression_has_no_red_cell(
    tmp_path: Path, fixture_page: tuple[str, str]
) -> None:
    write_once(tmp_path / "run" / "mutations.json", _mutations(caught=True))
    html = render_report(tmp_path / "run", tmp_path / "page" / "index.md").html.read_text()
    assert WORDS in html and "failed" not in _classes(html), "red means failed: a passing run has no red"
    vocabulary = {"passed", "failed", "shown", "skipped", "links"}  # reports.classes.CLASSES and the links list
    assert _classes(html) <= vocabulary and _classes(fixture_page[1]) <= vocabulary
    assert "failed" not in _classes(fixture_page[1])
    write_once(tmp_path / "bad" / "mutations.json", _mutations(caught=False))
    html = render_report(tmp_path / "bad", tmp_path / "bad-page" / "index.md").html.read_text()
    assert '<td class="failed">NOT CAUGHT</td>' in html and '<td class="failed">FAIL</td>' in html
    assert f"<td>{WORDS}</td>" in html, "a cell's text never picks its class"


def test_the_class_vocabulary_is_fixed_and_an_unknown_word_is_never_red() -> None:
    from reports.classes import result_class

    assert [
        result_class(w)
        for w in (
            "pass",
            "FAIL",
            "caught",
            "NOT CAUGHT",
            "skipped",
            "tie",
            "regression",
            "worse",
            "inconclusive",
            "DIFFERS at step 3",
            "some new word",
        )
    ] == ["passed", "failed", "passed", "failed", "skipped", "passed", "shown", "shown", "shown", "failed", "shown"]


def test_a_shown_verdict_reads_shown_never_passed_beside_it(fixture_page: tuple[str, str]) -> None:
    board = _board(fixture_page[0])
    assert board["learning"] == "shown: worse, inconclusive"
    assert board["benchmark"] == "tie (passed)", "the committed benchmark's gated comparison is enforced, not shown"
    assert board["derivative"] == "passed"
    assert '<td class="shown">shown: worse, inconclusive</td>' in fixture_page[1]


def test_the_board_names_each_canary_as_the_command_line_does(fixture_page: tuple[str, str]) -> None:
    assert set(_board(fixture_page[0])) == {"benchmark", "derivative", "learning", "memory", "mutations", "smoke"}
    labels = {declared.label for declared in KINDS.values()}
    assert set(CANARIES) <= labels, "every registered canary's records are shown under its CLI name"


def test_every_board_label_is_a_name_the_command_line_or_the_evidence_uses() -> None:
    """A canary's name (``rtv canary NAME``), with a flag of its command (``benchmark --baseline``), else the kind's."""
    for declared in KINDS.values():
        command = re.fullmatch(r"([a-z]+)(?: --[a-z-]+)?", declared.label)
        assert declared.label == declared.name or (command and command[1] in CANARIES), declared
