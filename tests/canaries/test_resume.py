"""The resume canary: jobs killed by SIGKILL resume bitwise (docs/semantics.md#saves-and-resume).

One quick run (a few seconds: spawned gloo jobs) is shared by the tests that read
it. Its negative control (a resume whose save left the RNG out) is part of the
run and must be seen to differ; the kill points are hypothesis's, derandomized.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from canaries.registry import canary
from canaries.request import canary_run
from canaries.resume.canary import KILLS, SAVE_FSYNCS, kill_points
from canaries.resume.job import STEP_OPS
from reports.render import render_report
from validation.evidence import checks_of, verify


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, Path]:
    out = tmp_path_factory.mktemp("resume")
    lines: list[str] = []
    path = canary("resume").run(canary_run("cpu", "quick", echo=lines.append), out)
    return verify(path), "\n".join(lines), out


@pytest.mark.slow  # the canary's real quick run (child processes killed and resumed); rtv run runs it too
def test_the_quick_run_passes_with_its_kill_points_and_negative_control_in_the_record(quick):
    record, printed, _ = quick
    assert record["passed"], [c for c in checks_of(record) if not c.ok]
    m = record["measurements"]
    assert m["kills"] == len(m["kill_points"]) == KILLS["quick"]
    assert m["kills_inside_a_save"] >= 1 and m["negative_control_differs"] is True
    assert all(p["killed"] and p["bitwise_equal"] for p in m["kill_points"])
    assert "PASS  negative control" in printed and printed.count("  kill point ") == KILLS["quick"]
    assert printed.count("PASS  ") == len(record["checks"]), "each check shown once, as it is made"


@pytest.mark.slow  # renders the quick run above
def test_the_report_shows_every_kill_point_and_its_outcome(quick, tmp_path):
    record, _, out = quick
    page = render_report(out, tmp_path / "index.md").markdown.read_text()
    for point in record["measurements"]["kill_points"]:
        assert point["where"] in page


@pytest.mark.parametrize("profile", ["quick", "default"])
def test_kill_points_are_distinct_half_inside_a_save_and_reproducible(profile):
    points = kill_points(profile)
    assert len(set(points)) == len(points) == KILLS[profile]
    inside = [p for p in points if p.fsync is not None]
    assert len(inside) == KILLS[profile] // 2
    assert all(STEP_OPS[p.call % len(STEP_OPS)] == "save" and 0 <= p.fsync < SAVE_FSYNCS for p in inside)
    assert kill_points(profile) == points  # derandomized: a failure reproduces
    if profile == "default":
        assert {p.killed for p in points} == {p.resumed for p in points} == {1, 2}
