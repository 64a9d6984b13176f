"""The rollout canary: its detector, one mismatch cell each way (fast), the whole quick canary and its report (slow)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import reference_trainer as rt
from canaries.request import canary_run
from canaries.rollout import scenarios
from canaries.rollout.canary import _lags, _ratio_moves, _ratios, judge
from canaries.rollout.scenarios import Setting
from reference_trainer.importance import RatioStats
from reference_trainer.rollout.engine import FP32_LOGPROB_TOLERANCE
from reference_trainer.sampling import Sample
from reports.rollout import section
from validation.evidence import Checks, make_record

CPU = torch.device("cpu")


class _Stats:
    def __init__(self, low: float, high: float) -> None:
        self.ratio = RatioStats(min=low, max=high, mean=(low + high) / 2, quantiles={})


def test_the_detector_fires_on_ratios_off_one_and_not_on_ratios_of_one() -> None:
    assert not _ratio_moves(_Stats(1.0, 1.0))
    assert not _ratio_moves(_Stats(1 - FP32_LOGPROB_TOLERANCE / 2, 1 + FP32_LOGPROB_TOLERANCE / 2))
    assert _ratio_moves(_Stats(1.0, 1.001)) and _ratio_moves(_Stats(0.999, 1.0))


def test_an_fp32_cell_is_within_the_tolerance_and_a_bf16_cell_is_not() -> None:
    fp32 = scenarios.mismatch(Setting("fp32", True, 2, "left+right"), 3, CPU)
    bf16 = scenarios.mismatch(Setting("bf16", True, 2, "left+right"), 3, CPU)
    assert len(fp32) == len(bf16) == 6
    assert max(map(abs, fp32)) <= FP32_LOGPROB_TOLERANCE < max(map(abs, bf16))


def test_the_samples_and_ratios_are_the_same_whatever_the_global_rng(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh process's initial seed differs per process: every sample the ratio and lag scenarios draw comes
    from a seeded generator, so the samples and the measurements are the same in every run."""
    drawn: list[list[int]] = []
    generate = rt.RolloutEngine.generate

    def recording(engine: rt.RolloutEngine, prompts: list[torch.Tensor], **options: Any) -> list[Sample]:
        samples = generate(engine, prompts, **options)
        drawn.extend(s.completion.tolist() for s in samples)
        return samples

    monkeypatch.setattr(rt.RolloutEngine, "generate", recording)
    runs = []
    with torch.random.fork_rng():
        for seed in (1, 2):
            torch.manual_seed(seed)
            runs.append((_ratios(Checks(), 3, CPU), _lags(Checks(), 3, CPU), drawn[:]))
            drawn.clear()
    assert len(runs[0][2]) == 5 * 4  # five generations of four prompts
    assert runs[0] == runs[1]


@pytest.mark.slow
def test_the_quick_canary_passes_catches_its_negative_controls_and_renders(tmp_path: Path) -> None:
    judged = judge(canary_run("cpu", "quick"))
    checks = {c.name: c for c in judged.checks}
    assert all(c.ok for c in checks.values()), [c for c in checks.values() if not c.ok]
    assert {
        "negative_control_filled_logprobs_caught",
        "negative_control_skipped_publication_caught",
        "publication_faults_leave_engine_bitwise",
        "inflight_versions_exact",
    } <= set(checks)
    assert len(judged.measurements["mismatch"]) == 24
    record = make_record(judged.kind, config=judged.config, checks=judged.checks, measurements=judged.measurements)
    view = section(record, tmp_path)
    assert view.passed and view.key_figure.startswith("worst FP32 gap")
    assert len(view.tables["engine against trainer per setting"]) == 24
    assert [f.path.stat().st_size > 0 for f in view.figures] == [True]
