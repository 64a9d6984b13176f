"""ci/guard.py, as the workflow runs it: GitHub's event payload in, ``launch=`` and one line of reason out.

Run with ``python3 -I`` (no site-packages, no PYTHONPATH): the guard is the
one step a fork's pull request runs, before anything is installed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EVENTS = Path(__file__).resolve().parents[1] / "fixtures" / "github_events"


def guard(repo_root: Path, tmp_path: Path, check: str, **env: str) -> tuple[int, str, str, str]:
    """(exit code, stdout, GITHUB_OUTPUT, GITHUB_STEP_SUMMARY) of ``python3 -I ci/guard.py CHECK``."""
    output, summary = tmp_path / "output", tmp_path / "summary"
    done = subprocess.run(
        [sys.executable, "-I", str(repo_root / "ci" / "guard.py"), check],
        capture_output=True,
        text=True,
        timeout=30,
        env={
            "GITHUB_OUTPUT": str(output),
            "GITHUB_STEP_SUMMARY": str(summary),
            "GITHUB_REPOSITORY": "team/trainer",
            **env,
        },
        check=False,
    )
    return done.returncode, done.stdout + done.stderr, output.read_text(), summary.read_text()


@pytest.mark.parametrize(
    ("event", "payload", "launch", "why"),
    [
        ("pull_request", "pull_request_fork.json", False, "comes from someone/trainer, not team/trainer"),
        ("pull_request", "pull_request_unlabelled.json", False, "has no gpu-ci label"),
        ("pull_request", "pull_request_labelled.json", True, "launching: pull_request"),
        ("push", "push_main.json", True, "launching: push"),
    ],
)
def test_an_event_launches_or_is_skipped_with_one_line(
    repo_root: Path, tmp_path: Path, event: str, payload: str, launch: bool, why: str
):
    code, printed, output, summary = guard(
        repo_root, tmp_path, "event", GITHUB_EVENT_NAME=event, GITHUB_EVENT_PATH=str(EVENTS / payload)
    )
    assert code == 0, printed  # a skip passes: the workflow is green, its GPU jobs are skipped
    assert output == f"launch={'true' if launch else 'false'}\n"
    (line,) = printed.splitlines()
    assert why in line and line in f"gpu guard: {summary.removeprefix('**GPU CI** ').strip()}"


def test_a_fork_is_skipped_even_with_the_label(repo_root: Path, tmp_path: Path):
    payload = (EVENTS / "pull_request_fork.json").read_text()
    assert '"gpu-ci"' in payload  # the control: the label alone would launch a pull request of this repository
    code, _, output, _ = guard(
        repo_root,
        tmp_path,
        "event",
        GITHUB_EVENT_NAME="pull_request_target",
        GITHUB_EVENT_PATH=str(EVENTS / "pull_request_fork.json"),
    )
    assert (code, output) == (0, "launch=false\n")


@pytest.mark.parametrize(("endpoint_set", "code", "launch"), [("true", 0, "true"), ("false", 1, "false")])
def test_an_empty_endpoint_fails_at_once_with_the_fix(
    repo_root: Path, tmp_path: Path, endpoint_set: str, code: int, launch: str
):
    found, printed, output, _ = guard(repo_root, tmp_path, "endpoint", RTV_ENDPOINT_SET=endpoint_set)
    assert (found, output) == (code, f"launch={launch}\n"), printed
    if code:
        assert "SKYPILOT_API_SERVER_ENDPOINT" in printed and "trainer-rank-gpu-validation" in printed


def test_an_unknown_check_is_a_usage_error(repo_root: Path):
    done = subprocess.run(
        [sys.executable, "-I", str(repo_root / "ci" / "guard.py"), "launch"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2 and "event|endpoint" in done.stderr
