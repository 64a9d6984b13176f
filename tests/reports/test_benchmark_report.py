"""The benchmark's part of the report renders from saved evidence alone: every arm in the tables, every plot on the page."""

from __future__ import annotations

import base64
import csv
import json
import re
from pathlib import Path

import pytest

from canaries.benchmark import canary as benchmark
from canaries.benchmark import profiling
from reports import render_report
from reports.benchmark import comparison_line, section
from tests.benchmark_fakes import run_fake, tiny_plan
from validation.evidence import make_record, write_once


@pytest.fixture(scope="module")
def evidence(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(benchmark, "plan", tiny_plan)
        folder = tmp_path_factory.mktemp("bench")
        run_fake(folder, {"plain": 1.0, "retain@s0": 1.01, "replay@s0": 1.3, "offload@s2": 1.2})
    (path,) = folder.glob("benchmark-*.json")
    return path


@pytest.mark.slow  # renders a whole page with every plot (about 1.3 s); the section's CSV and profile table are checked in the default run
def test_the_page_shows_every_arm_every_comparison_and_every_plot(evidence: Path, tmp_path: Path) -> None:
    report = render_report(evidence.parent, tmp_path / "report" / "index.md")  # nothing but the saved record
    page, markdown = report.html.read_text(), report.markdown.read_text()
    for arm in ("plain", "retain@s0", "replay@s0", "offload@s2"):
        assert f">{arm}</td>" in page and f"| {arm} |" in markdown
    stem = f"benchmark-{json.loads(evidence.read_text())['digest'][:12]}"
    linked = re.findall(r"\]\(plots/(benchmark-[0-9a-f]+-[a-z]+\.png)\)", markdown)
    assert sorted(set(linked)) == [f"{stem}-blocks.png", f"{stem}-memory.png", f"{stem}-ratios.png"]
    embedded = re.findall(r'<img src="data:image/png;base64,([^"]+)"', page)
    for name in set(linked):
        png = (tmp_path / "report" / "plots" / name).read_bytes()
        assert png.startswith(b"\x89PNG") and base64.b64encode(png).decode() in embedded
    assert page.count("→ ") == 4  # three comparisons with plain, replay against its floor


def test_the_csv_holds_every_raw_sample(evidence: Path, tmp_path: Path) -> None:
    record = json.loads(evidence.read_text())
    section(record, tmp_path)
    with open(tmp_path / f"benchmark-{record['digest'][:12]}-samples.csv") as handle:
        rows = list(csv.DictReader(handle))
    (group,) = record["measurements"]["groups"]
    blocks = len(group["comparisons"][0]["ratios"])
    assert len(rows) == 4 * blocks
    retain = next(c for c in group["comparisons"] if c["arm"] == "retain@s0")
    assert [float(r["seconds"]) for r in rows if r["arm"] == "retain@s0"] == pytest.approx(retain["arm_seconds"])


def test_a_comparison_line_reads_as_throughput_change_with_its_interval() -> None:
    # tokens/s 12.1% lower means a step-time ratio of 1 / 0.879; the interval inverts the same way.
    comparison = {
        "arm": "B",
        "baseline": "A",
        "blocks": 8,
        "ratio": 1 / 0.879,
        "ci95": [1 / 0.897, 1 / 0.860],
        "drift": {"rho": 0.08, "p_value": 0.8, "significant": False},
        "loaded": [],
        "verdict": "regression",
    }
    assert comparison_line(comparison, "4x1K", 0.05) == (
        "tok/s −12.1% [−14.0..−10.3] (B vs A, 8 ABBA blocks, 4×1K, drift ρ=0.08) → regression vs ±5% gate"
    )


def test_the_profile_table_shows_a_cost_noise_and_a_saving_never_a_negative_cost(
    evidence: Path, tmp_path: Path
) -> None:
    """A profile of known paired blocks in a record: each component reads as its interval says."""
    record = json.loads(evidence.read_text())
    (group,) = record["measurements"]["groups"]
    plain = [0.010, 0.011, 0.0095]
    shifts = {
        "saved_tensor_hooks": [0.002, 0.0021, 0.0019],
        "model_forward": [0.001, -0.001, 0.0002],
        "other": [-0.0005, -0.0006, -0.0004],
    }
    components = [
        {
            "name": name,
            "buys": profiling.COMPONENTS[name],
            **profiling.differences(plain, [p + s for p, s in zip(plain, shift)]),
        }
        for name, shift in shifts.items()
    ]
    median = {"block_seconds": plain, "median_block": 0, "median_seconds": plain[0]}
    group["profile"] = {
        "blocks": 3,
        "confidence": 0.95,
        "note": "profiled blocks",
        "plain_step_seconds": 0.01,
        "arms": {"plain": median, "retain@s0": median},
        "extra": components[0],
        "components": components,
        "saved_by_reuse_seconds": 0.001,
    }
    written = tmp_path / "run" / evidence.name
    write_once(
        written,
        make_record(
            record["kind"], config=record["config"], checks=record["checks"], measurements=record["measurements"]
        ),
    )
    markdown = render_report(written.parent, tmp_path / "report" / "index.md").markdown.read_text()
    rows = {
        line.split("|")[2].strip(): [cell.strip() for cell in line.split("|")[3:-1]]
        for line in markdown.splitlines()
        if any(f"| {name} |" in line for name in shifts)
    }
    assert rows["saved_tensor_hooks"][:3] == ["+2.00 ms [+1.75..+2.25]", "cost", "20.0"]  # t(2) interval by hand
    assert rows["model_forward"][1:3] == ["within noise", ""] and rows["model_forward"][0].startswith("within noise [")
    assert rows["other"][:3] == ["0.50 ms faster [0.25..0.75]", "saving", ""], "a saving, not a negative cost"
    assert not any(row[0].startswith(("−", "-")) for row in rows.values())


@pytest.mark.slow  # a second page of two records (about 1.5 s); one record's page and plots are checked in the default run
def test_two_benchmark_records_in_one_report_keep_their_own_plots(evidence: Path, tmp_path: Path) -> None:
    """Each record's plots are named after its digest: a second run's section cannot overwrite the first's."""
    runs = tmp_path / "runs"
    for index in (1, 2):
        record = json.loads(evidence.read_text())
        record["measurements"]["seconds"] += index  # a different record, so a different digest
        write_once(
            runs / f"run{index}" / evidence.name,
            make_record(
                record["kind"], config=record["config"], checks=record["checks"], measurements=record["measurements"]
            ),
        )
    report = render_report(runs, tmp_path / "report" / "index.md")
    pngs = sorted(p.name for p in (tmp_path / "report" / "plots").glob("benchmark-*.png"))
    assert len(pngs) == 6 and len({name.rsplit("-", 1)[0] for name in pngs}) == 2
    assert report.html.read_text().count("<img ") >= 6
