"""Importance weights at token, sequence, geometric and average level (NOTE [Importance correction] Rules 2, 9, 10).

Pure functions, no model: ``correct_cotangent`` over generated ``(rows, T)``
log-probs, masks and cotangents, against a numpy FP64 recomputation written
from the documented formulas (the ratio itself, not its logarithm: the
product, the geometric and the arithmetic mean of a row's token ratios);
extreme log-ratios (1000 in one token) must give finite weights and
statistics at every level, and a masked neighbour exactly 0; the raw and
clipped statistics are checked against values worked out by hand.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference_trainer as rt
from reference_trainer.importance import correct_cotangent

LEVELS = ("token", "sequence", "geometric", "average")
RTOL = {torch.float32: 2e-5, torch.float64: 1e-12}


def _row_ratio(ratios: np.ndarray, level: str) -> float:
    """The documented ratio of one row, from its token ratios (Rule 9)."""
    if level == "sequence":
        return float(np.prod(ratios))
    if level == "geometric":
        return float(np.prod(ratios) ** (1.0 / ratios.size))
    return float(np.mean(ratios))


def _reference(cotangent, current, forward, mask, correction) -> np.ndarray:
    """The corrected cotangent in FP64 numpy: each active token times its unit's clipped ratio."""
    cot, cur, fwd, mask = (
        np.asarray(t.double() if t.is_floating_point() else t) for t in (cotangent, current, forward, mask)
    )
    active = (cot != 0) & mask
    out = np.where(mask, cot, 0.0)
    bound = math.exp(correction.max_log_ratio)
    for row in range(cot.shape[0]):
        if not active[row].any():
            continue
        ratios = np.exp(cur[row] - fwd[row])
        for t in np.flatnonzero(active[row]):
            ratio = ratios[t] if correction.level == "token" else _row_ratio(ratios[mask[row]], correction.level)
            out[row, t] = cot[row, t] * min(max(min(ratio, bound), correction.clip_low), correction.clip_high)
    return out


@st.composite
def _cases(draw):
    dtype = draw(st.sampled_from((torch.float32, torch.float64)))
    rows, width = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    n = rows * width
    logprob = st.floats(-4.0, 0.0, allow_nan=False)
    current = torch.tensor(draw(st.lists(logprob, min_size=n, max_size=n)), dtype=torch.float64).reshape(rows, width)
    forward = torch.tensor(draw(st.lists(logprob, min_size=n, max_size=n)), dtype=torch.float64).reshape(rows, width)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n))).reshape(rows, width)
    cotangent = torch.tensor(
        draw(st.lists(st.sampled_from([0.0, 1.0, -0.5, 2.0]), min_size=n, max_size=n)), dtype=torch.float64
    ).reshape(rows, width)
    low = draw(st.sampled_from([0.0, 0.1, 0.5]))
    high = draw(st.sampled_from([1.5, 5.0, 1e30]))
    correction = rt.ImportanceCorrection(
        clip_low=low,
        clip_high=high,
        level=draw(st.sampled_from(LEVELS)),
        max_log_ratio=draw(st.sampled_from([0.5, 3.0, 20.0])),
    )
    return cotangent.to(dtype), current.to(dtype), forward.to(dtype), mask, correction


@given(_cases())
def test_each_level_weighs_every_active_token_by_its_units_clipped_ratio(case):
    cotangent, current, forward, mask, correction = case
    corrected, stats = correct_cotangent(cotangent, current, forward, correction, staleness=2, mask=mask)
    expected = _reference(cotangent, current, forward, mask, correction)
    np.testing.assert_allclose(corrected.double().numpy(), expected, rtol=RTOL[cotangent.dtype], atol=1e-300)
    active = (cotangent != 0) & mask
    assert stats.tokens == int(active.sum()) and stats.staleness == 2
    assert (stats.level, stats.max_log_ratio) == (correction.level, correction.max_log_ratio)
    units = int(active.sum()) if correction.level == "token" else int(active.any(-1).sum())
    assert stats.units == units


def test_the_sequence_weight_is_the_product_not_each_tokens_own_ratio():
    # Negative control of the reference above: two tokens, ratios 2 and 3, one row.
    forward = torch.zeros(1, 2, dtype=torch.float64)
    current = torch.tensor([[math.log(2.0), math.log(3.0)]], dtype=torch.float64)
    ones = torch.ones(1, 2, dtype=torch.float64)
    found = {
        level: correct_cotangent(ones, current, forward, rt.ImportanceCorrection(clip_high=100.0, level=level), 1)[0]
        for level in LEVELS
    }
    assert found["token"][0].tolist() == pytest.approx([2.0, 3.0], rel=1e-15)
    assert found["sequence"][0].tolist() == pytest.approx([6.0, 6.0], rel=1e-15)
    assert found["geometric"][0].tolist() == pytest.approx([math.sqrt(6.0)] * 2, rel=1e-15)
    assert found["average"][0].tolist() == pytest.approx([2.5, 2.5], rel=1e-15)


# --- ratios that cannot overflow -------------------------------------------------------------


# Not FP16: it cannot hold e**20 (its max is 65504); target log-probs are FP32 or FP64 anyway.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("high", [5.0, 1e30], ids=["default-clip", "clip-off"])
def test_a_log_ratio_of_1000_gives_finite_weights_and_a_masked_neighbour_exactly_zero(dtype, level, high):
    # Row 0: token 0 has log-ratio 1000 (exp overflows even FP64); token 1 is masked, with a cotangent that
    # would be NaN (0 * inf) were its weight formed; token 2 is ordinary. Row 1: ordinary.
    forward = torch.tensor([[-1000.0, -1.0, -2.0], [-1.0, -1.5, -0.5]], dtype=torch.float64).to(dtype)
    current = torch.tensor([[0.0, -1.0, -1.5], [-1.2, -1.0, -0.5]], dtype=torch.float64).to(dtype)
    mask = torch.tensor([[True, False, True], [True, True, True]])
    cotangent = torch.tensor([[1.0, 3.0, -2.0], [0.5, 1.0, 1.0]], dtype=dtype)
    correction = rt.ImportanceCorrection(clip_high=high, level=level)

    corrected, stats = correct_cotangent(cotangent, current, forward, correction, staleness=1, mask=mask)

    assert bool(torch.isfinite(corrected).all()), corrected
    assert corrected[0, 1].item() == 0.0
    bound = min(high, math.exp(correction.max_log_ratio))
    assert abs(corrected[0, 0].item()) <= bound * (1 + 1e-2) and corrected[0, 0].item() > 0
    for value in (
        stats.mean,
        stats.max,
        stats.effective_sample_size,
        stats.raw.min,
        stats.raw.max,
        stats.raw.mean,
        stats.clipped.max,
        *stats.raw.quantiles.values(),
        *stats.clipped.quantiles.values(),
    ):
        assert math.isfinite(value), stats
    assert stats.raw.max == pytest.approx(math.exp(20.0), rel=1e-6)  # capped by the bound, not inf
    assert stats.fraction_clipped > 0


def test_the_log_ratio_bound_caps_weights_below_a_higher_clip():
    current, forward = torch.tensor([30.0, 2.0, -40.0], dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    correction = rt.ImportanceCorrection(clip_high=1e30, max_log_ratio=5.0)
    corrected, stats = correct_cotangent(torch.ones(3, dtype=torch.float64), current, forward, correction, 1)
    assert corrected.tolist() == pytest.approx([math.exp(5.0), math.exp(2.0), math.exp(-40.0)], rel=1e-15)
    assert stats.fraction_clipped == pytest.approx(1 / 3)


@pytest.mark.parametrize("level", ["sequence", "geometric", "average"])
@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "+inf"])
def test_a_bad_current_logprob_anywhere_in_a_used_row_raises_at_the_sequence_levels(level, bad):
    # Token 1 has a zero cotangent but is a real target: it takes part in its row's ratio, so it is read.
    current, forward = torch.tensor([[-1.0, bad, -2.0]]), torch.tensor([[-1.0, -1.0, -1.0]])
    cotangent = torch.tensor([[0.5, 0.0, 0.5]])
    with pytest.raises(rt.GradientCommitError, match="NaN or \\+inf"):
        correct_cotangent(cotangent, current, forward, rt.ImportanceCorrection(level=level), 1)
    # Masked, it takes part in nothing and is never read; nor is a row without an active token.
    mask = torch.tensor([[True, False, True]])
    corrected, _ = correct_cotangent(cotangent, current, forward, rt.ImportanceCorrection(level=level), 1, mask=mask)
    assert bool(torch.isfinite(corrected).all())
    unused = torch.zeros(1, 3)
    assert correct_cotangent(unused, current, forward, rt.ImportanceCorrection(level=level), 1)[0].tolist() == [
        [0.0] * 3
    ]


# --- statistics, by hand --------------------------------------------------------------------


def test_raw_and_clipped_statistics_match_a_hand_computation():
    # Two rows at sequence level: ratios (2, 3) -> product 6; (0.5, masked) -> 0.5. clip_high = 5.
    forward = torch.zeros(2, 2, dtype=torch.float64)
    current = torch.tensor([[math.log(2.0), math.log(3.0)], [math.log(0.5), 7.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False]])
    correction = rt.ImportanceCorrection(clip_high=5.0, level="sequence")
    _, stats = correct_cotangent(torch.ones(2, 2, dtype=torch.float64), current, forward, correction, 3, mask=mask)

    assert (stats.units, stats.tokens, stats.staleness) == (2, 3, 3)
    # Raw ratios (6, 0.5): linear quantiles 0.5 + q * 5.5.
    assert (stats.raw.min, stats.raw.max, stats.raw.mean) == pytest.approx((0.5, 6.0, 3.25), rel=1e-14)
    assert stats.raw.quantiles == pytest.approx(
        {0.05: 0.775, 0.25: 1.875, 0.5: 3.25, 0.75: 4.625, 0.95: 5.725}, rel=1e-14
    )
    # Clipped (5, 0.5): 0.5 + q * 4.5.
    assert (stats.clipped.min, stats.clipped.max, stats.clipped.mean) == pytest.approx((0.5, 5.0, 2.75), rel=1e-14)
    assert stats.clipped.quantiles == pytest.approx(
        {0.05: 0.725, 0.25: 1.625, 0.5: 2.75, 0.75: 3.875, 0.95: 4.775}, rel=1e-14
    )
    # Per token: weights (5, 5, 0.5); the first row's two tokens are clipped.
    assert (stats.mean, stats.max) == pytest.approx((3.5, 5.0), rel=1e-14)
    assert stats.fraction_clipped == pytest.approx(2 / 3)
    assert stats.effective_sample_size == pytest.approx(10.5**2 / 50.25, rel=1e-14)


def test_token_level_statistics_are_over_tokens_and_empty_ones_are_zero():
    forward = torch.zeros(4, dtype=torch.float64)
    current = torch.tensor([math.log(v) for v in (0.25, 1.0, 2.0, 8.0)], dtype=torch.float64)
    _, stats = correct_cotangent(
        torch.ones(4, dtype=torch.float64), current, forward, rt.ImportanceCorrection(clip_low=0.5, clip_high=4.0), 1
    )
    assert stats.units == 4
    assert (stats.raw.min, stats.raw.max, stats.raw.mean) == pytest.approx((0.25, 8.0, 11.25 / 4), rel=1e-14)
    assert stats.raw.quantiles[0.5] == pytest.approx(1.5, rel=1e-14)
    assert (stats.clipped.min, stats.clipped.max, stats.clipped.mean) == pytest.approx((0.5, 4.0, 7.5 / 4), rel=1e-14)
    _, empty = correct_cotangent(
        torch.zeros(4), current.float(), forward.float(), rt.ImportanceCorrection(level="average"), 1
    )
    assert empty.units == 0 and empty.raw == empty.clipped == rt.RatioStats(
        min=0.0, max=0.0, mean=0.0, quantiles={q: 0.0 for q in (0.05, 0.25, 0.5, 0.75, 0.95)}
    )
