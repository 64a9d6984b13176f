"""The liveness canary and the watchdog on real spawned ranks: each injected hang named right, no process left.

Every test here spawns gloo processes and waits out a 2 s deadline at least
once: all are ``slow`` (the fast siblings are ``tests/unit/test_watchdog.py``
on hand-built traces and ``tests/validation/test_hangs.py`` on hand-written
dumps). The expectations are what each injection does by construction
(``canaries.liveness.job``): which rank, and which trainer call rank 0 was
making when it happened.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from canaries.liveness.job import job
from canaries.registry import canary
from canaries.request import canary_run, silent
from validation.evidence import checks_of, verify
from validation.hangs import HangDetected, watching
from validation.world import run_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("liveness")
    path = canary("liveness").run(canary_run("cpu", "quick", echo=silent), out)
    return verify(path)


def test_the_quick_run_passes_every_check(quick: dict) -> None:
    assert quick["passed"], [c for c in checks_of(quick) if not c.ok]
    assert {c.name.split(":")[0] for c in checks_of(quick)} == {"lag", "kill", "skip", "skip-0", "none"}


def test_a_rank_sleeping_past_the_deadline_is_named_as_never_reaching_rank_0s_run_logical(quick: dict) -> None:
    found = quick["measurements"]["cases"]["lag"]
    diagnosis = found["diagnosis"]
    assert diagnosis["odd_ranks"] == [1] and diagnosis["by_rank"]["1"] is None and diagnosis["dead_ranks"] == []
    assert diagnosis["call"].startswith("run_logical(mode='rank')") and found["exitcodes"] == [0, 0]
    assert "rank-1-asked.json" in found["dumps"], "the sleeping rank dumped while it slept"


def test_a_killed_rank_is_named_dead_at_the_collective_rank_0_was_in(quick: dict) -> None:
    found = quick["measurements"]["cases"]["kill"]
    assert found["exitcodes"] == [0, -9] and found["diagnosis"]["dead_ranks"] == [1]
    assert found["diagnosis"]["call"].startswith("run_logical(mode='rank')")


def test_a_skipped_optim_step_is_named_as_rank_1_issuing_run_logical_where_rank_0_steps(quick: dict) -> None:
    diagnosis = quick["measurements"]["cases"]["skip"]["diagnosis"]
    assert diagnosis["odd_ranks"] == [1] and diagnosis["call"].startswith("optim_step")
    assert "run_logical(mode='rank')" in diagnosis["by_rank"]["1"]


def test_a_skipped_optim_step_on_rank_0_of_three_names_rank_0_by_the_majority(quick: dict) -> None:
    """The injected rank is the lowest and the control hub: a diagnosis that always blamed a rank other than 0,
    or took rank 0 as the reference, fails here."""
    found = quick["measurements"]["cases"]["skip-0"]
    diagnosis = found["diagnosis"]
    assert diagnosis["odd_ranks"] == [0] and diagnosis["call"].startswith("optim_step"), diagnosis
    assert "run_logical(mode='rank')" in diagnosis["by_rank"]["0"] and len(found["exitcodes"]) == 3


@pytest.mark.parametrize("case", ["lag", "kill", "skip", "skip-0"])
def test_the_run_ends_after_rank_0_reported_and_both_are_measured(quick: dict, case: str) -> None:
    found = quick["measurements"]["cases"][case]
    assert 0 < found["latency_s"] <= found["run_ended_s"], found


def test_a_hang_in_a_watched_run_ranks_call_raises_hang_detected_and_leaves_no_process(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    with watching(2.0, tmp_path), pytest.raises(HangDetected) as info:
        run_ranks(job, 2, "skip", 2.0, str(pids))
    assert info.value.exit_code == 7 and info.value.diagnosis["odd_ranks"] == [1]
    assert Path(info.value.diagnosis["folder"]).parent == tmp_path / "hangs"
    for pid in (int(p.read_text()) for p in pids.iterdir()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_clean_watched_call_returns_its_values_and_leaves_no_hangs_folder(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    with watching(5.0, tmp_path):
        values = run_ranks(job, 2, "none", 5.0, str(pids))
    assert values == [{"rank": 0, "error": None}, {"rank": 1, "error": None}]
    assert not (tmp_path / "hangs").exists()
