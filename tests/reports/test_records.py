"""Which files the report collects: the folder named, and below it only the folders the harness wrote records into."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from canaries.benchmark import canary as benchmark
from canaries.cli import main
from reports import load_records
from tests.benchmark_fakes import run_fake, tiny_plan
from validation import evidence
from validation.evidence import make_record, write_once

FIXTURES = Path(__file__).parents[1] / "fixtures" / "evidence"


@pytest.fixture(autouse=True)
def tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(benchmark, "plan", tiny_plan)


def _failed(kind: str = "smoke") -> dict:
    return make_record(kind, config={}, checks={"committed on purpose: fails": False}, measurements={})


def _baseline_worktree(out: Path) -> Path:
    """What ``rtv bench --baseline`` leaves under ``<out>/sources/<commit>``: a worktree with committed fixtures."""
    tree = out / "sources" / ("ab" * 20)
    (tree / "tests" / "fixtures" / "evidence").mkdir(parents=True)
    (tree / ".git").write_text("gitdir: /somewhere/.git/worktrees/x\n")  # a worktree's .git is a file
    for path in FIXTURES.glob("*.json"):  # committed records: never marked
        shutil.copy(path, tree / "tests" / "fixtures" / "evidence" / path.name)
    write_once(tree / "rtv-out" / "old" / "smoke-failed.json", _failed())  # marked, but inside a checkout
    return tree


def test_a_baselines_worktree_under_in_is_never_read_as_records(tmp_path: Path) -> None:
    """The repro: records of ``<out>/sources/`` read as this run's ("12 records, FAILED", a false PR comment)."""
    out = tmp_path / "bench"
    run_fake(out, {"retain@s0": 1.0, "replay@s0": 1.0, "offload@s2": 1.0}, real_steps=3)
    ours = [r.path for r in load_records(out)]
    tree = _baseline_worktree(out)
    record = json.loads(ours[0].read_text())
    for group in record["measurements"]["groups"]:
        for comparison in group["comparisons"]:
            comparison["verdict"] = "regression"
    regression = make_record(
        record["kind"], config=record["config"], checks={"a regression": False}, measurements=record["measurements"]
    )
    (tree / "tests" / "fixtures" / "evidence" / "benchmark-regression.json").write_text(json.dumps(regression))
    assert [r.path for r in load_records(out)] == ours and all(tree not in p.parents for p in ours)
    code = main(["report", "--in", str(out), "--out", str(tmp_path / "report" / "index.md"), "--summary"])
    assert code == 0 and not (tmp_path / "report" / "pr-comment.md").exists()
    assert "no regression" in (tmp_path / "report" / "summary.md").read_text()


def test_tests_fixtures_below_in_are_skipped_and_the_folder_named_is_read(tmp_path: Path) -> None:
    write_once(tmp_path / "run" / "smoke.json", make_record("smoke", config={}, checks={"ok": True}, measurements={}))
    write_once(tmp_path / "checkout" / "tests" / "fixtures" / "smoke.json", _failed())  # marked, still a fixture
    (tmp_path / "top.json").write_text(json.dumps(_failed()))  # the folder named: read
    assert [r.name for r in load_records(tmp_path)] == ["run/smoke", "top"]
    assert (tmp_path / "run" / evidence.EVIDENCE_MARKER).is_file(), "write_once marks the folder it writes into"
    # Named explicitly, a fixtures folder is read: `make board-png` renders the committed records.
    assert len(load_records(FIXTURES)) == len(list(FIXTURES.glob("*.json"))) == 6


def test_a_failing_record_whose_marker_was_stripped_fails_the_report_and_other_json_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The repro: an artifact upload drops hidden files, so the marker is gone ("1 records, PASSED")."""
    write_once(tmp_path / "gpu-receipt.json", make_record("smoke", config={}, checks={"ok": True}, measurements={}))
    failing = write_once(tmp_path / "rtv-gate-1" / "evidence" / "run-x" / "smoke.json", _failed())
    (failing.parent / evidence.EVIDENCE_MARKER).unlink()  # what upload-artifact@v4 leaves
    other = tmp_path / "site" / "package.json"
    other.parent.mkdir()
    other.write_text(json.dumps({"name": "not a record"}))
    assert [r.name for r in load_records(tmp_path)] == ["gpu-receipt", "rtv-gate-1/evidence/run-x/smoke"]
    out = tmp_path / "report" / "index.md"
    assert main(["report", "--in", str(tmp_path), "--out", str(out)]) == 1
    terminal = capsys.readouterr().out
    assert "2 records, FAILED" in terminal and "skipped 1 *.json" in terminal and str(other) in terminal
    assert "site/package.json" in out.read_text() and "site/package.json" in out.with_suffix(".html").read_text()


def test_a_marked_folders_only_record_tampered_with_is_read_as_invalid_and_fails_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A marked folder is collected on its marker alone: a record there that no longer verifies (one byte changed
    after writing) is a record gone invalid, never a stray ``*.json`` to skip."""
    write_once(tmp_path / "gpu-receipt.json", make_record("smoke", config={}, checks={"ok": True}, measurements={}))
    tampered = write_once(
        tmp_path / "run-x" / "smoke.json", make_record("smoke", config={}, checks={"ok": True}, measurements={})
    )
    assert (tampered.parent / evidence.EVIDENCE_MARKER).is_file()
    data = tampered.read_bytes()
    at = data.index(b'"smoke"') + 5
    tampered.write_bytes(data[:at] + b"f" + data[at + 1 :])  # "smoke" -> "smokf": still JSON, no longer its digest
    with pytest.raises(evidence.EvidenceError):
        evidence.verify(tampered)
    loaded = [(r.name, r.status) for r in load_records(tmp_path)]
    assert loaded == [("gpu-receipt", "passed"), ("run-x/smoke", "invalid")], loaded
    assert main(["report", "--in", str(tmp_path), "--out", str(tmp_path / "report" / "index.md")]) == 1
    terminal = capsys.readouterr().out
    assert "2 records, FAILED" in terminal and "skipped" not in terminal, terminal
