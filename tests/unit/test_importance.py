"""``RatioStats``: the statistics a correction reports of its ratios, against numpy's own and closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference_trainer import ImportanceCorrection
from reference_trainer.importance import QUANTILES, RatioStats, clipped_exp


@given(st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=1, max_size=200))
def test_ratio_statistics_equal_numpys_linear_quantiles(values):
    stats = RatioStats.of(torch.tensor(values, dtype=torch.float32))
    exact = np.asarray(torch.tensor(values, dtype=torch.float32).double().numpy())
    assert (stats.min, stats.max) == (exact.min(), exact.max())
    assert stats.mean == pytest.approx(exact.mean(), rel=1e-12, abs=1e-12)
    expected = np.quantile(exact, QUANTILES, method="linear")
    assert list(stats.quantiles) == list(QUANTILES)
    assert list(stats.quantiles.values()) == pytest.approx(list(expected), rel=1e-12, abs=1e-9)


@pytest.mark.slow
def test_ratio_statistics_of_more_values_than_torch_quantile_takes():
    n = (1 << 24) + 1  # torch.quantile refuses this many
    stats = RatioStats.of(torch.arange(n, dtype=torch.float64).flip(0))
    assert stats.quantiles == {q: q * (n - 1) for q in QUANTILES}  # closed form: the q-th point of 0..n-1
    assert (stats.min, stats.max, stats.mean) == (0.0, n - 1.0, (n - 1) / 2)


def test_the_mean_of_many_ratios_at_a_large_bound_is_finite():
    bound = np.exp(np.float64(700.0))  # max_log_ratio=700: each ratio finite in FP64, their sum is not
    stats = RatioStats.of(torch.full((20_000,), bound, dtype=torch.float64))
    assert stats.mean == bound and np.isfinite(stats.mean)


@pytest.mark.parametrize("bound", ["low", "high"])
def test_a_ratio_exactly_on_a_clip_bound_is_not_counted_as_clipped(bound: str) -> None:
    """``clipped`` means the weight is not the ratio: a ratio equal to its bound keeps its own value."""
    correction = ImportanceCorrection(clip_low=0.5, clip_high=2.0, policy="always")
    on_bound = math.log(0.5 if bound == "low" else 2.0)
    weights, clipped = clipped_exp(torch.tensor([on_bound, 0.0], dtype=torch.float64), correction)
    assert weights.tolist() == [0.5 if bound == "low" else 2.0, 1.0]
    assert clipped.tolist() == [False, False]
