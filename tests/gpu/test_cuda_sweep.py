"""The cost-growth sweep on CUDA: a GPU preset sweeps 4 x {1K, 2K, 4K} like the seed (skipped without a GPU).

The grid it plans is checked on CPU too (tests/canaries/test_benchmark_sweep.py); this runs it, timed on the
device clock, on the ``gpu`` preset's ``small`` LoRA BF16 model at its quick profile.
"""

from __future__ import annotations

import numpy as np
import pytest

from canaries.benchmark import sweep

pytestmark = pytest.mark.gpu


def test_the_gpu_preset_sweeps_4x_1k_2k_4k_on_cuda_and_fits_every_arm() -> None:
    judged = sweep.measure("gpu", "quick")
    points = judged.measurements["points"]
    assert [(p["batch"], p["seq_len"]) for p in points] == [(4, 1024), (4, 2048), (4, 4096)]
    assert {p["workload"]["device"] for p in points} == {"cuda"} and not judged.config["swapped_for_cpu"]
    assert judged.checks.passed, judged.checks
    for point in points:
        (comparison,) = point["comparisons"]
        assert comparison["arm"] == "retain@s0" and np.isfinite(comparison["ratio"])
    model = judged.measurements["model"]
    assert model["note"] == "model, not a measurement"
    assert all(np.isfinite(s["ratios"]["retain@s0"]) for s in model["shapes"])
