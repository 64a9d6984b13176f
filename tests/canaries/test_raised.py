"""A canary that raises in ``rtv run`` is recorded as failed: the record, the report's board and section, the PR comment.

The canaries here are registered throwaway modules whose ``judge`` raises (an
ordinary error, or ``validation.hangs.HangDetected`` with a small diagnosis
made here), run through ``canaries.suite.run_canaries`` or ``rtv run`` with
a smoke stand-in; what is expected is what the test raised, never what the
writer computed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from canaries import registry, smoke, suite
from canaries.cli import main
from canaries.registry import Canary, Judged
from canaries.request import CanaryRun, canary_run, silent
from reports.summary import write_summary
from validation.errors import SetupError
from validation.evidence import Checks, injected, verify
from validation.hangs import HangDetected, next_watch

TEXT = "seq 3 all_reduce: rank 1 never reached it"  # the hang diagnosis's sentence, as diagnose() words one


def _register(monkeypatch: pytest.MonkeyPatch, name: str, judge) -> Canary:
    """A canary whose module is made here (``judge`` its entry point), registered in the run's canaries (each test
    starts them empty)."""
    module = ModuleType(f"throwaway_{name}")
    module.judge = judge  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    entry = Canary(name=name, module=module.__name__, summary="a canary this test adds")
    monkeypatch.setitem(registry.CANARIES, name, entry)
    return entry


def _breaks(run: CanaryRun) -> Judged:
    raise ValueError("the toy broke | badly\nsecond line")


def _hangs(run: CanaryRun) -> Judged:
    watch = next_watch()  # the dump folder a watched multi-process call of this canary gets (rtv run's watching)
    diagnosis = {
        "text": TEXT,
        "folder": watch.folder,
        "odd_ranks": [1],
        "dead_ranks": [2],
        "dumped_ranks": [0, 1],
        "collective": "all_reduce seq 3",
    }
    raise HangDetected([], diagnosis)


def _passes(run: CanaryRun) -> Judged:
    return Judged("toy-passes", {"preset": run.preset.name}, Checks.of({"holds": True}), {})


def test_a_canary_that_raises_writes_one_failed_record_with_its_error_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry, "CANARIES", {})
    monkeypatch.setattr(registry, "TRACEBACK_FRAMES", 2)  # of run_canaries -> Canary.run -> _breaks, the last two
    _register(monkeypatch, "toy", _breaks)
    _register(monkeypatch, "after", _passes)
    with injected("mutation toy_bug"):
        broke, after = suite.run_canaries(canary_run("cpu", "quick", echo=silent), tmp_path / "run")
    assert not broke.passed and broke.enforced and not broke.hung and after.passed, "the canary after it still ran"
    (path,) = (tmp_path / "run").glob("toy-cpu-*.json")
    assert str(path) in broke.where and "raised ValueError: the toy broke" in broke.where
    record = verify(path)
    assert record["kind"] == "canary-raised" and record["passed"] is False
    assert record["config"] == {"canary": "toy", "preset": "cpu", "profile": "quick", "injected": ["mutation toy_bug"]}
    assert record["checks"] == {"toy ran to completion": False}
    assert record["details"] == {"toy ran to completion": "raised ValueError: the toy broke | badly"}
    m = record["measurements"]
    assert m["error"] == "ValueError" and m["message"] == "the toy broke | badly\nsecond line"
    first, last = m["traceback"]
    assert first.startswith(f"{registry.__file__}:") and " in run: " in first
    assert last.startswith(f"{__file__}:") and "in _breaks: raise ValueError(" in last
    assert "diagnosis" not in m and "dumps" not in m


def _run(tmp_path: Path, *argv: str) -> tuple[int, Path]:
    code = main(["run", *argv, "--out", str(tmp_path)])
    (run_dir,) = tmp_path.glob("run-cpu-*")
    return code, run_dir


def _board_row(page: str, name: str) -> list[str]:
    """The cells after the name of the board row of canary ``name``: verdict, key figure, details."""
    board = page[page.index("## Verdict board") : page.index("## Environment")]
    (row,) = [line for line in board.splitlines() if line.startswith(f"| {name} |")]
    return row.strip("| ").split(" | ")[1:]


@pytest.fixture
def quick_smoke(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(smoke, "judge", lambda run, **_: Judged("smoke", {}, Checks.of({"smoke ok": True}), {}))


def test_a_hung_canary_is_a_failed_record_with_its_diagnosis_on_the_board_and_in_the_pr_comment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quick_smoke: None
) -> None:
    """``rtv run`` still exits 7; the page it renders and ``rtv report --summary``'s files afterwards show the hang."""
    monkeypatch.setattr(registry, "CANARIES", {})
    _register(monkeypatch, "toy", _hangs)
    _register(monkeypatch, "after", _passes)
    code, run_dir = _run(tmp_path)
    assert code == 7
    (path,) = run_dir.glob("toy-cpu-*.json")
    record = verify(path)
    m = record["measurements"]
    assert not record["passed"] and m["error"] == "HangDetected" and m["diagnosis"]["text"] == TEXT
    assert m["diagnosis"]["odd_ranks"] == [1] and m["diagnosis"]["dead_ranks"] == [2]
    (dumps,) = (run_dir / "hangs").glob("ranks-*")
    assert m["dumps"] == f"hangs/{dumps.name}" and m["diagnosis"]["folder"] == str(dumps)
    assert (
        record["details"]["toy ran to completion"]
        == f"raised HangDetected: watchdog: {TEXT}; dumps and diagnosis in {dumps}"
    )
    page = (run_dir / "report" / "index.md").read_text()
    assert _board_row(page, "toy")[:2] == ["hung (failed)", f"hung: {TEXT}"]
    assert f"Hang diagnosis: {TEXT}" in page and f"`hangs/{dumps.name}`" in page
    assert re.search(r"\| odd ranks \| 1 \|\n\| dead ranks \(left no dump\) \| 2 \|", page), page
    html = (run_dir / "report" / "index.html").read_text()
    assert '<tr><td>toy</td><td class="failed">hung (failed)</td>' in html, "red by the record's status"
    summary = write_summary(run_dir, tmp_path / "ci")  # what rtv report --summary writes, without a second page
    assert (summary.failed, summary.raised, summary.regressions) == (1, 1, 0) and summary.comment is not None
    comment = summary.comment.read_text()
    assert "FAILED: 1 record(s)" in comment and f"| toy | **raised HangDetected: watchdog: {TEXT}" in comment
    assert f"| - | {TEXT} | [record](../run" in comment and "regression" not in comment
    assert "| toy | **raised HangDetected" in (tmp_path / "ci" / "summary.md").read_text()


def test_a_smoke_that_raises_is_recorded_and_shown_failed_like_a_canary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(run: CanaryRun, **_: object) -> Judged:
        raise RuntimeError("no tiny model")

    monkeypatch.setattr(smoke, "judge", broken)
    monkeypatch.setattr(registry, "CANARIES", {})
    code, run_dir = _run(tmp_path)
    assert code == 1
    (path,) = run_dir.glob("smoke-cpu-*.json")
    record = verify(path)
    assert record["kind"] == "canary-raised" and record["config"]["canary"] == "smoke" and not record["passed"]
    assert record["details"] == {"smoke ran to completion": "raised RuntimeError: no tiny model"}
    page = (run_dir / "report" / "index.md").read_text()
    assert _board_row(page, "smoke")[:2] == ["raised (failed)", "raised RuntimeError: no tiny model"]
    assert "**FAILED**: 1 records, 1 failed" in page


def _cannot_run_here(run: CanaryRun) -> Judged:
    raise SetupError("this toy needs a GPU", fix="run it where CUDA is")


def test_rtv_canary_alone_records_a_hang_before_it_exits_7_and_a_setup_error_records_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _register(monkeypatch, "toy", _hangs)  # beside the real ones: the command line offers the registry's names
    _register(monkeypatch, "needs_gpu", _cannot_run_here)

    def rtv_canary(name: str, out: Path) -> int:
        return main(["canary", name, "--preset", "cpu", "--profile", "quick", "--out", str(out)])

    assert rtv_canary("toy", tmp_path / "hung") == 7
    (path,) = (tmp_path / "hung").glob("toy-cpu-*.json")
    record = verify(path)
    assert record["kind"] == "canary-raised" and not record["passed"]
    assert record["measurements"]["diagnosis"]["text"] == TEXT
    assert rtv_canary("needs_gpu", tmp_path / "refused") == 2
    assert not list((tmp_path / "refused").glob("*.json")), "a request this machine cannot run is no failed run"
