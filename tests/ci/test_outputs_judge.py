"""The GPU cross-check (``ci.outputs.judge_outputs``): only records that verify and say passed count as passing."""

from __future__ import annotations

import json
from pathlib import Path

from ci.outputs import judge_outputs
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
