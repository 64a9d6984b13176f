"""Reports from evidence files the test writes itself: tables, plots and the Markdown/HTML page."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from reports import (
    checks_table,
    lifecycle_table,
    load_records,
    measurements_table,
    ratio_table,
    records_table,
    render_report,
)
from validation.evidence import make_record, write_once

PNG = b"\x89PNG\r\n\x1a\n"


def _memory_like(passed: bool, mutation: str | None = None) -> dict:
    return make_record(
        "memory-canary",
        config={"name": "cpu", "mutation": mutation, "placements": ["retain", "offload"],
                "points": ["after_forward", "after_backward"]},
        checks={"offload: device bytes fall": passed, "retain: nothing outlives backward": True},
        measurements={
            "lifecycle_bytes": {
                "retain": {"after_forward": {"device": 4096, "host": 0}, "after_backward": {"device": 0, "host": 0}},
                "offload": {"after_forward": {"device": 512 if passed else 4096, "host": 4096},
                            "after_backward": {"device": 0, "host": 0}},
            },
            "admission": {"limit_bytes": 600_000, "census_peak_device": 348_318},
            "details": {"offload: device bytes fall": "offload 4096 B on the device; allowed up to 1024 B"},
            "skipped_checks": {"cuda: allocator back to baseline": "no CUDA device"},
        },
    )


def _bench_like() -> dict:
    return make_record(
        "placements-benchmark",
        config={"presets": ["tiny"], "blocks": 3},
        checks={"tiny:ran": True},
        measurements={"tiny": {"ratios_to_retain": {
            "offload": {"median_ratio": 1.25, "ci95": [1.1, 1.4], "verdict": "slower"},
            "replay": {"median_ratio": 0.9, "ci95": [0.8, 1.05], "verdict": "not significant"},
        }}},
    )


@pytest.fixture
def evidence(tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    write_once(folder / "memory-ok.json", _memory_like(True))
    write_once(folder / "memory-bad.json", _memory_like(False))
    write_once(folder / "memory-mutated.json", _memory_like(False, mutation="offload_alias"))
    write_once(folder / "bench" / "placements.json", _bench_like())
    (folder / "bench" / "legacy.json").write_text(json.dumps(
        {"schema": "rtv.bench.versioned_step/1", "summary": {"median_ratio": 1.3, "ratio_ci95_low": 1.1,
                                                              "ratio_ci95_high": 1.5}}))
    tampered = _memory_like(True)
    tampered["measurements"]["admission"]["census_peak_device"] = 1  # edited after the digest was made
    (folder / "memory-tampered.json").write_text(json.dumps(tampered))
    return folder


def test_each_record_gets_the_status_its_evidence_supports(evidence: Path) -> None:
    table = records_table(load_records(evidence)).set_index("record")
    assert table.loc["memory-ok", "status"] == "passed"
    assert table.loc["memory-bad", "status"] == "failed" and table.loc["memory-bad", "failed"] == 1
    assert table.loc["memory-mutated", "status"] == "caught", "a mutated run that fails is what it should be"
    assert table.loc["memory-tampered", "status"] == "invalid" and "digest" in table.loc["memory-tampered", "integrity"]
    assert table.loc["bench/legacy", "status"] == "unverified" and table.loc["bench/legacy", "kind"].startswith("rtv.bench")
    assert table.loc["memory-ok", "skipped"] == 1 and len(table.loc["memory-ok", "source_sha256"]) == 12
    assert table.loc["memory-ok", "torch"]


def test_checks_table_has_one_row_per_check_with_details_and_skips(evidence: Path) -> None:
    checks = checks_table(load_records(evidence))
    bad = checks[checks["record"] == "memory-bad"].set_index("check")
    assert bad.loc["offload: device bytes fall", "result"] == "failed"
    assert "allowed up to 1024 B" in bad.loc["offload: device bytes fall", "detail"]
    assert bad.loc["retain: nothing outlives backward", "result"] == "passed"
    assert bad.loc["cuda: allocator back to baseline", "result"] == "skipped"


def test_measurement_lifecycle_and_ratio_tables_carry_the_values(evidence: Path) -> None:
    records = load_records(evidence)
    values = measurements_table(records)
    ok = values[values["record"] == "memory-ok"].set_index("key")["value"]
    assert ok["admission.census_peak_device"] == 348_318
    assert not any(key.startswith(("details", "skipped_checks")) for key in ok.index)
    life = lifecycle_table(records)
    bad = life[(life["record"] == "memory-bad") & (life["pool"] == "device")]
    assert list(bad["placement"] + ":" + bad["point"])[:2] == ["retain:after_forward", "retain:after_backward"]
    assert bad.set_index(["placement", "point"]).loc[("offload", "after_forward"), "bytes"] == 4096
    ratios = ratio_table(records).set_index("label")
    assert ratios.loc["tiny.ratios_to_retain.offload", ["median_ratio", "ci_low", "ci_high"]].tolist() == [1.25, 1.1, 1.4]
    assert ratios.loc["summary", "median_ratio"] == 1.3  # the legacy benchmark's own summary


def test_page_lists_every_record_with_its_verdict_checks_and_plots(evidence: Path) -> None:
    report = render_report(evidence)
    assert report.markdown == evidence / "report" / "index.md" and report.records == 6
    assert report.passed is False, "a failed and a tampered record fail the run"
    page = report.markdown.read_text()
    assert "**FAILED**: 6 records, 2 passed, 1 failed, 1 caught, 1 invalid, 1 unverified" in page
    for name, verdict in [("memory-ok", "PASSED"), ("memory-bad", "FAILED"), ("memory-tampered", "INVALID"),
                          ("memory-mutated", "CAUGHT"), ("bench/placements", "PASSED"), ("bench/legacy", "UNVERIFIED")]:
        assert f"## {name}: {verdict}" in page
    bad = page.split("## memory-bad: FAILED")[1].split("\n## ")[0]
    assert "| offload: device bytes fall | **FAIL** | offload 4096 B on the device; allowed up to 1024 B |" in bad
    assert "| retain: nothing outlives backward | pass |" in bad
    assert "| cuda: allocator back to baseline | skipped | no CUDA device |" in bad
    assert "| retain | 4096 / 0 | 0 / 0 |" in bad and "| offload | 4096 / 4096 | 0 / 0 |" in bad
    assert "[../memory-bad.json](../memory-bad.json)" in bad and "torch" in bad and "sha256" in bad
    assert "| admission.limit_bytes | 600000 |" in bad
    # Plots exist, are PNGs and are linked from the page and the HTML.
    names = {p.name for p in report.plots}
    assert {"memory-bad-lifecycle.png", "bench-placements-ratios.png", "bench-legacy-ratios.png"} <= names
    assert all(p.read_bytes().startswith(PNG) for p in report.plots)
    assert "![memory-bad-lifecycle](plots/memory-bad-lifecycle.png)" in bad
    html = report.html.read_text()
    assert 'src="plots/memory-bad-lifecycle.png"' in html and '<td class="failed">failed</td>' in html
    assert "memory-tampered" in html and "&lt;" not in page


def test_a_run_whose_records_all_passed_passes(tmp_path: Path) -> None:
    write_once(tmp_path / "memory-ok.json", _memory_like(True))
    write_once(tmp_path / "memory-mutated.json", _memory_like(False, mutation="offload_alias"))
    out = tmp_path / "elsewhere" / "page.md"
    report = render_report(tmp_path, out)
    assert report.passed is True and report.markdown == out and out.with_suffix(".html").exists()
    assert "**PASSED**: 2 records, 1 passed, 1 caught." in out.read_text()


def test_a_mutated_run_that_passes_is_a_failure(tmp_path: Path) -> None:
    write_once(tmp_path / "memory-mutated.json", _memory_like(True, mutation="offload_alias"))
    write_once(tmp_path / "memory-ok.json", _memory_like(True))
    report = render_report(tmp_path)
    assert report.passed is False and "## memory-mutated: NOT CAUGHT" in report.markdown.read_text()


def _imports(nodes) -> list[str]:
    names = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module or "")
    return names


def test_reports_never_import_the_trainer_or_the_canaries() -> None:
    """Layering (style.md): reports read evidence files; of the harness they use only validation.evidence."""
    for source in [*Path("reports").glob("*.py"), Path("validation/evidence.py")]:
        tree = ast.parse(source.read_text())
        for name in _imports(ast.walk(tree)):
            assert name.split(".")[0] not in ("reference_trainer", "canaries"), f"{source} imports {name}"
            assert not name.startswith("validation") or name == "validation.evidence", f"{source} imports {name}"
        assert "torch" not in {n.split(".")[0] for n in _imports(tree.body)}, f"{source} imports torch on import"
