"""Reports from evidence files the test writes itself: the context, its sections, plots and the Markdown/HTML page."""

from __future__ import annotations

import ast
import base64
import json
from pathlib import Path

import pytest

from reports import build_context, load_records, render_report
from reports.kinds import KINDS
from validation.errors import SetupError
from validation.evidence import Checks, content_digest, make_record, write_once

PNG = b"\x89PNG\r\n\x1a\n"


def _memory_like(passed: bool, why: str = "offload 4096 B on the device; allowed up to 1024 B") -> dict:
    checks = Checks()
    checks.check("offload: device bytes fall", passed, why)
    checks.check("retain: nothing outlives backward", True, "0 B left")
    checks.skip("cuda: allocator back to baseline", "no CUDA device")
    return make_record(
        "memory-canary",
        config={"name": "cpu", "placements": ["retain", "offload"], "points": ["after_forward", "after_backward"]},
        checks=checks,
        measurements={
            "lifecycle_bytes": {
                "retain": {"after_forward": {"device": 4096, "host": 0}, "after_backward": {"device": 0, "host": 0}},
                "offload": {
                    "after_forward": {"device": 512 if passed else 4096, "host": 4096},
                    "after_backward": {"device": 0, "host": 0},
                },
            },
            "admission": {"limit_bytes": 600_000, "census_peak_device": 348_318},
            "offload": {"retain_keeps": 4096},
            "undeclared_key": "never shown: the memory kind does not declare it",
        },
    )


def _derivative_like() -> dict:
    cells = [
        {"staleness": s, "placement": p, "corrected": c, "checkpoint": "lora", "records": 1 + s}
        for s in (0, 1, 2)
        for p in ("retain", "offload", "replay")
        for c in (False, True)
    ]
    measurements = {key: 0 for key in KINDS["derivative-canary"].measurements}
    measurements.update(
        examples=10,
        examples_backpropagated=9,
        records_checked=sum(c["records"] for c in cells),
        stale_share_of_checked=0.8,
        worst_gradient_error_over_threshold=0.02,
        cells=cells,
        worst_gradient_relative_l2=2e-6,
    )
    return make_record(
        "derivative-canary",
        config={"tolerances": {"gradient": 1e-4}},
        checks={"coverage": True},
        measurements=measurements,
    )


def _mutations_like(caught: bool) -> dict:
    one = {
        "description": "the staleness check admits bound + 1",
        "caught_by": "derivative",
        "applicable": True,
        "caught": caught,
        "failed_checks": ["scenario:bounds"] if caught else [],
        "first_failure": "",
        "seconds": 1,
    }
    return make_record(
        "mutation-suite",
        config={},
        checks={"caught:off_by_one": caught},
        measurements={
            "mutations": {"off_by_one": one},
            "run": ["off_by_one"],
            "caught": ["off_by_one"] if caught else [],
            "inapplicable": [],
        },
    )


@pytest.fixture
def evidence(tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    write_once(folder / "memory-ok.json", _memory_like(True))
    write_once(folder / "memory-bad.json", _memory_like(False))
    write_once(folder / "sub" / "derivative.json", _derivative_like())
    write_once(folder / "mutations.json", _mutations_like(False))
    write_once(
        folder / "other.json", make_record("something-new", config={}, checks={"ok": True}, measurements={"x": 1})
    )
    (folder / "not-a-record.json").write_text(json.dumps({"median_ratio": 1.3}))
    tampered = _memory_like(True)
    tampered["measurements"]["admission"]["census_peak_device"] = 1  # edited after the digest was made
    (folder / "memory-tampered.json").write_text(json.dumps(tampered))
    return folder


def test_each_record_gets_the_status_its_evidence_supports(evidence: Path) -> None:
    status = {r.name: r.status for r in load_records(evidence)}
    assert status == {
        "memory-ok": "passed",
        "memory-bad": "failed",
        "sub/derivative": "passed",
        "mutations": "failed",
        "other": "passed",
        "not-a-record": "invalid",
        "memory-tampered": "invalid",
    }
    with pytest.raises(SetupError, match="not a folder of evidence"):
        load_records(evidence / "nowhere")


def test_sections_show_checks_and_only_the_declared_measurements(evidence: Path, tmp_path: Path) -> None:
    page = build_context(evidence, tmp_path / "page", title="t")
    views = {v.name: v for v in page.records}
    bad = views["memory-bad"].section
    checks = bad.tables["checks"].set_index("check")
    assert checks.loc["offload: device bytes fall", "result"] == "FAIL"
    assert checks.loc["offload: device bytes fall", "detail"] == "offload 4096 B on the device; allowed up to 1024 B"
    assert checks.loc["cuda: allocator back to baseline", "result"] == "skipped"
    shown = bad.tables["measurements"]["measurement"].tolist()
    assert shown == list(KINDS["memory-canary"].measurements) and "undeclared_key" not in shown
    lifecycle = bad.tables["bytes held at each lifecycle point"].set_index("placement")
    assert lifecycle.loc["offload", "after_forward (device)"] == 4096
    grid = views["sub/derivative"].section.tables["judged records per cell"].set_index(["checkpoint", "staleness"])
    assert grid.loc[("lora", 2), "replay corrected"] == 3 and grid.loc[("lora", 0), "retain plain"] == 1
    assert views["sub/derivative"].section.key_figure == "worst gradient error 2e-06 vs threshold 0.0001 (2% of it)"
    assert views["memory-bad"].section.key_figure == (
        "bytes left after backward (most over offload, retain): device 0 B, host 0 B"
    )
    assert views["mutations"].section.key_figure == "0 of 1 injected bugs caught"
    injected = views["mutations"].section.tables["injected bugs"].set_index("mutation")
    assert injected.loc["off_by_one", "verdict"] == "NOT CAUGHT"
    assert views["other"].section.lines == ["kind 'something-new' is not registered in reports.kinds"]
    assert views["memory-tampered"].section is None and "digest mismatch" in views["memory-tampered"].integrity


def test_page_lists_every_record_with_its_verdict_checks_and_plots(evidence: Path) -> None:
    report = render_report(evidence)
    assert report.markdown == evidence / "report" / "index.md" and report.records == 7
    assert report.passed is False, "failed and invalid records fail the run"
    page = report.markdown.read_text()
    assert "**FAILED**: 7 records, 3 passed, 2 failed, 2 invalid." in page
    for name, verdict in [
        ("memory-ok", "PASSED"),
        ("memory-bad", "FAILED"),
        ("memory-tampered", "INVALID"),
        ("sub/derivative", "PASSED"),
        ("not-a-record", "INVALID"),
    ]:
        assert f"### {name}: {verdict}" in page
    bad = page.split("### memory-bad: FAILED")[1].split("\n### ")[0]
    assert "| offload: device bytes fall | FAIL | offload 4096 B on the device; allowed up to 1024 B |" in bad
    assert "| cuda: allocator back to baseline | skipped | no CUDA device |" in bad
    assert "[../memory-bad.json](../memory-bad.json)" in bad and "torch" in bad and "sha256" in bad
    assert "undeclared_key" not in page
    # Plots exist, are PNGs, are linked from the Markdown and embedded in the HTML (a self-contained file).
    assert len(report.plots) == 2 and all(p.read_bytes().startswith(PNG) for p in report.plots)
    bad_plot = next(f for f in report.plots if f"](plots/{f.name})" in bad)
    html = report.html.read_text()
    assert f'src="data:image/png;base64,{base64.b64encode(bad_plot.read_bytes()).decode()}"' in html
    assert 'src="plots/' not in html and '<td class="failed">failed</td>' in html
    for name in ("memory-tampered", "sub/derivative", "NOT CAUGHT"):
        assert name in html and name in page


def test_a_run_passes_only_when_every_record_verified_and_passed(tmp_path: Path) -> None:
    write_once(tmp_path / "memory-ok.json", _memory_like(True))
    write_once(tmp_path / "mutations.json", _mutations_like(True))
    out = tmp_path / "elsewhere" / "page.md"
    report = render_report(tmp_path, out)
    assert report.passed is True and report.markdown == out and out.with_suffix(".html").exists()
    assert "**PASSED**: 2 records, 2 passed." in out.read_text()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert render_report(empty).passed is False, "no evidence is no pass"
    with pytest.raises(SetupError, match="not a Markdown file name"):
        render_report(tmp_path, tmp_path / "page.txt")


def test_every_kind_builder_is_a_module_with_a_section_builder() -> None:
    import importlib

    for declared in KINDS.values():
        if declared.builder:
            assert callable(importlib.import_module(declared.builder).section), declared.name


def _imports(nodes) -> list[str]:
    names = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module or "")
    return names


def test_reports_never_import_the_trainer_or_the_canaries() -> None:
    """Layering (style.md): reports read evidence files; of the harness they use only validation's evidence and errors."""
    for source in [*Path("reports").glob("*.py"), Path("validation/evidence.py")]:
        tree = ast.parse(source.read_text())
        for name in _imports(ast.walk(tree)):
            assert name.split(".")[0] not in ("reference_trainer", "canaries"), f"{source} imports {name}"
            assert not name.startswith("validation") or name in ("validation.evidence", "validation.errors"), name
        assert "torch" not in {n.split(".")[0] for n in _imports(tree.body)}, f"{source} imports torch on import"


def test_failures_come_first_with_their_reason_then_the_board_with_failed_rows_on_top(evidence: Path) -> None:
    report = render_report(evidence)
    page, html = report.markdown.read_text(), report.html.read_text()
    failures, board, details = (
        page.index("## What failed, and why"),
        page.index("## Verdict board"),
        page.index("## Details"),
    )
    assert failures < board < details
    why = page[failures:board]
    assert "**offload: device bytes fall**: offload 4096 B on the device; allowed up to 1024 B" in why
    assert "memory-tampered" in why and "memory-ok" not in why
    rows = [line for line in page[board:details].splitlines() if line.startswith("| ") and "](#section-" in line]
    assert len(rows) == 7
    statuses = ["(passed)" not in row and "| passed |" not in row for row in rows]
    assert statuses == sorted(statuses, reverse=True), "failed and invalid rows first"
    for element in (
        'id="failures"',
        'id="verdict-board"',
        'id="verdict-board-table"',
        'id="section-memory-bad"',
        'id="section-memory-bad-table-1"',
        'href="#section-memory-bad"',
    ):
        assert element in html
    assert html.index('id="failures"') < html.index('id="verdict-board"') < html.index('id="headline-plots"')


def test_a_passing_run_has_no_failure_box(tmp_path: Path) -> None:
    write_once(tmp_path / "memory-ok.json", _memory_like(True))
    page = render_report(tmp_path).markdown.read_text()
    assert "What failed" not in page and "## Verdict board" in page and "## Headline plots" in page


def test_a_pipe_in_a_cell_stays_in_its_cell(tmp_path: Path) -> None:
    """Markdown tables escape ``|`` with one backslash (two would end the cell and shift the row)."""
    record = _memory_like(passed=False, why="found a | b")
    write_once(tmp_path / "in" / "memory.json", record)
    markdown = render_report(tmp_path / "in", tmp_path / "out" / "index.md").markdown.read_text()
    assert "found a \\| b" in markdown and "found a \\\\| b" not in markdown


def test_the_failure_box_reads_a_schema_2_reason_from_the_records_own_field(tmp_path: Path) -> None:
    """The reason shown is ``details``, never a ``measurements`` key that happens to be called failures/details."""
    record = _memory_like(passed=False, why="the field's reason")
    record["measurements"]["failures"] = {"offload: device bytes fall": "a measurement, not the reason"}
    record["digest"] = content_digest(record)
    write_once(tmp_path / "in" / "memory.json", record)
    page = render_report(tmp_path / "in", tmp_path / "out" / "index.md").markdown.read_text()
    why = page[page.index("## What failed, and why") : page.index("## Verdict board")]
    assert "**offload: device bytes fall**: the field's reason" in why and "a measurement" not in why
    assert "cuda: allocator back to baseline" not in why  # a skip is not a failure


FIXTURES = Path(__file__).parents[1] / "fixtures" / "evidence"


def test_the_committed_schema_1_records_still_render(fixture_report) -> None:
    report = fixture_report
    page = report.markdown.read_text()
    assert report.passed and report.records == len(list(FIXTURES.glob("*.json"))) == 6
    assert "What failed" not in page and "invalid" not in page.lower().split("## details")[0]
    # benchmark.json's profile is hand-timed (no intervals; its remainder could read as a negative cost): said, not shown
    assert "hand-timed by an older rtv" in page and "Where retain@s0's extra time goes" not in page
    (row,) = [line for line in page.splitlines() if line.startswith("| AdamW step changed the adapter ")]
    assert row.rstrip(" |").endswith("tensors changed"), row  # v1 measurements.details, in the smoke's checks table


def test_a_failed_schema_1_check_shows_the_reason_its_measurements_kept(tmp_path: Path) -> None:
    record = json.loads((FIXTURES / "derivative.json").read_text())
    first = sorted(record["checks"])[0]
    record["checks"][first] = False
    record["passed"] = False
    record["measurements"]["failures"] = {first: "AssertionError: the v1 reason"}
    record["digest"] = content_digest(record)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "derivative.json").write_text(json.dumps(record))
    page = render_report(tmp_path / "in", tmp_path / "out" / "index.md").markdown.read_text()
    assert f"**{first}**: AssertionError: the v1 reason" in page[: page.index("## Verdict board")]
