"""The GPU cross-check (``ci.outputs.judge_outputs``): only records that verify and say passed count as passing."""

from __future__ import annotations

import json
from pathlib import Path

from ci.outputs import Expectation, judge_outputs
from reports.kinds import RAISED_KIND
from tests.support import checkless_passed_record
from validation.evidence import make_record, write_once


def test_a_record_without_checks_that_says_passed_fails_the_cross_check(tmp_path: Path) -> None:
    write_once(tmp_path / "good.json", make_record("k", config={}, checks={"ran": True}, measurements={}))
    assert judge_outputs(tmp_path).passed
    (tmp_path / "checkless.json").write_text(json.dumps(checkless_passed_record()))
    verdict = judge_outputs(tmp_path)
    assert not verdict.passed
    assert (verdict.records, verdict.verified) == (2, 1)
    assert (
        verdict.problems and "checkless" in verdict.problems[0] and "disagrees with its checks" in verdict.problems[0]
    )


def test_a_canary_that_raised_fails_the_cross_check_even_where_its_failed_verdict_would_be_shown(
    tmp_path: Path,
) -> None:
    """``rtv run`` exited 0 (the benchmark is not enforced): its failed verdict is shown, its crash is not."""
    write_once(
        tmp_path / "benchmark-gpu-1.json", make_record("benchmark", config={}, checks={"tie": False}, measurements={})
    )
    raised = make_record(RAISED_KIND, config={"canary": "benchmark"}, checks={"ran": False}, measurements={})
    write_once(tmp_path / "benchmark-gpu-2.json", raised)
    want = Expectation(run_id="r", commit="c", source_digest="d", submitted_at=0.0, expect=("benchmark", "benchmark"))
    verdict = judge_outputs(tmp_path, {"status": 0}, want)
    assert verdict.shown == ["benchmark-gpu-1 (failed)"] and verdict.failed == ["benchmark-gpu-2 (raised)"]
    assert not verdict.passed
