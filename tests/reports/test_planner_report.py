"""The planner canary's section: both figures written, every planned cell in the table, failures listed."""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path

from canaries.planner.certificate import certify
from reports.planner import section
from tests.canaries.test_planner_canary import GOOD, _cell
from validation.evidence import Checks, make_record


def _record(cells: dict) -> dict:
    figures, verdicts = certify(list(cells), cells)
    checks = Checks()
    for name, ok, detail in verdicts:
        checks.skip(name, detail) if ok is None else checks.check(name, ok, detail)
    return make_record(
        "planner-canary",
        config={},
        checks=checks,
        measurements={"certificate": figures, "cells": {k: asdict(v) for k, v in cells.items()}},
    )


def test_the_section_plots_regret_and_bytes_and_lists_every_cell(tmp_path: Path) -> None:
    failed = _cell("b", GOOD)
    failed.error = "RuntimeError: boom"
    view = section(_record({"a": _cell("a", GOOD, auto_cost=1.1), "b": failed}), tmp_path)
    assert [f.path.name.rsplit("-", 1)[1] for f in view.figures] == ["regret.png", "bytes.png"]
    assert all(f.path.stat().st_size > 0 for f in view.figures)
    assert list(view.tables["cells"]["status"]) == ["measured", "failed"] and not view.passed
    assert any("every planned cell has a verdict" in line for line in view.lines)


def test_a_wrong_refusal_is_red_a_right_one_and_a_measured_cell_green(tmp_path: Path) -> None:
    from reports.classes import classed_rows

    wrong, right = _cell("wrong", GOOD), _cell("right", GOOD)
    wrong.auto, wrong.device_limit = None, 95  # every measured peak (90) fits: refusing it is wrong
    right.auto, right.device_limit = None, 80  # no peak fits: refusing it is right
    view = section(_record({"a": _cell("a", GOOD), "wrong": wrong, "right": right}), tmp_path)
    assert not view.passed and list(view.tables["cells"]["status"]) == ["measured", "refused", "refused"]
    rows = classed_rows(view.tables["cells"], view.failed_rows["cells"])
    assert [next(css for _, css in row if css) for row in rows] == ["passed", "failed", "passed"]


def test_a_loaded_run_renders_with_its_timing_checks_inconclusive(tmp_path: Path) -> None:
    loaded = _cell("a", GOOD)
    loaded.load = "16 of 16 blocks under 80% of CPU share 1.00, median share 0.33"
    record = _record({"a": loaded})
    view = section(record, tmp_path)
    assert record["passed"] and all(f.path.stat().st_size > 0 for f in view.figures)
    assert record["skips"]["certificate: worst regret"].startswith("inconclusive (loaded: 1 cells, a: 16 of 16")
    said = [view.key_figure, *view.lines, *record["details"].values(), *record["skips"].values()]
    assert not [text for text in said if re.search(r"\bnan\b|n/a%", str(text), re.IGNORECASE)], said
    # The board reads inconclusive (passed), never a bare passed beside figures it could not measure.
    assert (view.verdict, view.passed) == ("inconclusive", True)
    assert view.key_figure.startswith("timing inconclusive: all 1 measured cells loaded; worst peak ratio ")


def test_loaded_cells_left_out_of_a_judged_run_are_counted_on_the_board(tmp_path: Path) -> None:
    loaded = _cell("b", GOOD)
    loaded.load = "measured"
    judged = section(_record({"a": _cell("a", GOOD), "b": loaded}), tmp_path)
    assert judged.verdict == "passed" and judged.key_figure.endswith("; 1 loaded cell(s) left out of the timing")
    assert judged.key_figure.startswith("ordering ")
    idle = section(_record({"a": _cell("a", GOOD)}), tmp_path)  # the control: nothing loaded, nothing said of it
    assert idle.verdict == "passed" and "loaded" not in idle.key_figure


def test_a_loaded_run_that_failed_a_check_without_a_clock_reads_failed(tmp_path: Path) -> None:
    """Loaded timings make only the timing checks inconclusive: an under-estimated peak still fails the row."""
    under = _cell("a", GOOD, peak=101)
    under.load = "measured"
    view = section(_record({"a": under}), tmp_path)
    assert (view.verdict, view.passed) == ("failed", False) and view.key_figure.startswith("ordering ")
