"""The planner canary on the ``gpu`` preset's declared subset, on CUDA, within its declared budget (skipped without a GPU)."""

from __future__ import annotations

import pytest

from canaries.planner import canary
from canaries.request import canary_run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("profile", ["quick", "default"])
def test_the_planner_certificate_on_the_gpu_presets_subset_passes_within_its_budget(profile: str) -> None:
    asked = canary_run("gpu", profile)
    plan = canary.plan(asked.preset, profile)
    assert plan.device == "cuda" and plan.cells == canary.GPU_PLANS["gpu"][profile].cells
    judged = canary.judge(asked)
    failed = [(c.name, c.detail) for c in judged.checks if c.failed]
    assert not failed, failed
    assert judged.config["device"] == "cuda" and len(judged.measurements["cells"]) == len(plan.cells)
    assert judged.measurements["seconds"] <= plan.budget_s, (judged.measurements["seconds"], plan.budget_s)
