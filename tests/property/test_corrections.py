"""Importance weights and corrected cotangents (NOTE [Importance correction], docs/semantics.md#importance-correction).

Pure functions, no model: ``correction_weights`` and ``correct_cotangent`` over
random log-probs in FP16 / BF16 / FP32 / FP64 and random bounds
``0 <= clip_low <= clip_high``, extremes included. Every expected value is
recomputed here with numpy in FP64.

Precision (Rule 3): weights are FP32 for FP16 / BF16 / FP32 inputs and FP64 for
FP64 inputs, and FP64 whatever the inputs when a bound is not representable as
a normal FP32 number (above FP32's max, or positive below its smallest normal,
e.g. 1e300 or 1e-300). FP32 weights are bounded by the bounds *rounded to FP32*
(``0.3`` is kept as ``fp32(0.3)``, half an ulp away), so containment is checked
in the weights' own dtype; FP64 weights keep the bounds exactly.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference_trainer as rt
from reference_trainer.importance import correct_cotangent, correction_weights

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
F32_MAX, F32_TINY = float(np.finfo(np.float32).max), float(np.finfo(np.float32).tiny)
# Relative agreement with the FP64 numpy reference, by weight dtype.
WEIGHT_RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}
# Relative agreement of a corrected cotangent, by cotangent dtype (its own rounding).
COTANGENT_RTOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5, torch.float64: 1e-12}

_SPECIAL_BOUNDS = [0.0, 1e-300, 1e-40, 1e-30, 0.3, 1.0, 5.0, 1e30, 1e39, 1e300]
_bound = st.sampled_from(_SPECIAL_BOUNDS) | st.floats(0.0, 20.0, allow_nan=False, allow_infinity=False)
_logprob = st.floats(-30.0, 0.0, allow_nan=False, allow_infinity=False)


# 700: the largest bound on the log-ratio, so that the clip bounds alone decide (tests of the bound draw it).
_NO_LOG_BOUND = st.just(700.0)


@st.composite
def _corrections(draw, bound=_bound, log_bound=_NO_LOG_BOUND) -> rt.ImportanceCorrection:
    low, high = sorted((draw(bound), draw(bound)))
    return rt.ImportanceCorrection(clip_low=low, clip_high=high, max_log_ratio=draw(log_bound))


def _extreme(correction: rt.ImportanceCorrection) -> bool:
    return any(b > F32_MAX or 0.0 < b < F32_TINY for b in (correction.clip_low, correction.clip_high))


def _expected_dtype(dtype: torch.dtype, correction: rt.ImportanceCorrection) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 or _extreme(correction) else torch.float32


def _tensor(values, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).to(dtype)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


def _reference_weights(current: np.ndarray, forward: np.ndarray, correction) -> np.ndarray:
    """``clip(exp(min(current - forward, max_log_ratio)), low, high)`` in FP64 numpy (inputs have no +inf / NaN)."""
    log_ratio = np.minimum(current - forward, correction.max_log_ratio)
    return np.clip(np.exp(log_ratio), correction.clip_low, correction.clip_high)


def _reference_clipped(current: torch.Tensor, forward: torch.Tensor, correction, dtype) -> np.ndarray:
    """Log-ratio outside ``[log low, log high]``, in the weights' dtype (ties decided as the trainer does)."""
    np_dtype = np.float64 if dtype == torch.float64 else np.float32
    log_ratio = _np(current).astype(np_dtype) - _np(forward).astype(np_dtype)
    low, high = correction.clip_low, correction.clip_high
    log_low = np_dtype(math.log(low)) if low > 0 else -np.inf
    log_high = np_dtype(math.log(high)) if high > 0 else -np.inf
    return (log_ratio < log_low) | (log_ratio > min(log_high, correction.max_log_ratio))


# --- weights ----------------------------------------------------------------------


@given(
    dtype=st.sampled_from(DTYPES),
    correction=_corrections(),
    pairs=st.lists(st.tuples(_logprob | st.just(-math.inf), _logprob), min_size=1, max_size=16),
)
def test_weights_are_bounded_finite_detached_and_at_least_fp32(dtype, correction, pairs):
    current = _tensor([c for c, _ in pairs], dtype).requires_grad_(True)
    forward = _tensor([f for _, f in pairs], dtype).requires_grad_(True)
    weights, clipped = correction_weights(current, forward, correction)

    assert weights.dtype == _expected_dtype(dtype, correction)
    assert not weights.requires_grad and weights.grad_fn is None
    assert weights.shape == clipped.shape == current.shape and clipped.dtype == torch.bool
    assert bool(torch.isfinite(weights).all()), weights
    low = torch.tensor(correction.clip_low, dtype=weights.dtype)
    high = torch.tensor(correction.clip_high, dtype=weights.dtype)
    assert bool(((weights >= low) & (weights <= high)).all()), (weights, low, high)
    if weights.dtype == torch.float64:  # FP64 keeps the bounds themselves
        assert float(weights.min()) >= correction.clip_low and float(weights.max()) <= correction.clip_high
    expected = _reference_weights(_np(current), _np(forward), correction)
    np.testing.assert_allclose(_np(weights), expected, rtol=WEIGHT_RTOL[weights.dtype], atol=0)
    assert clipped.numpy().tolist() == _reference_clipped(current, forward, correction, weights.dtype).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
def test_bounds_of_1e_minus_300_and_1e300_are_kept_exactly_without_overflow(dtype):
    correction = rt.ImportanceCorrection(clip_low=1e-300, clip_high=1e300, max_log_ratio=700.0)
    log_ratios = [-1e4, -800.0, -50.0, 0.0, 50.0, 800.0, 1e4]
    current = _tensor(log_ratios + [-math.inf], dtype)
    forward = torch.zeros_like(current)
    weights, clipped = correction_weights(current, forward, correction)

    assert weights.dtype == torch.float64  # FP32 cannot hold either bound
    assert bool(torch.isfinite(weights).all()), weights
    by_ratio = dict(zip(log_ratios + [-math.inf], weights.tolist()))
    assert by_ratio[-1e4] == by_ratio[-800.0] == by_ratio[-math.inf] == 1e-300
    assert by_ratio[1e4] == by_ratio[800.0] == 1e300
    assert by_ratio[0.0] == 1.0
    assert clipped.tolist() == [True, True, False, False, False, True, True, True]
    # A ratio of e^50 is inside the bounds: the weight is the ratio itself.
    assert math.isclose(by_ratio[50.0], math.exp(float(current[4])), rel_tol=1e-12)
    assert math.isclose(by_ratio[-50.0], math.exp(float(current[2])), rel_tol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("low", "high"), [(0.0, 1e-300), (1e-40, 1e-40), (0.0, 1e39), (1e-45, 1.0)])
def test_any_bound_outside_fp32s_normal_range_gives_fp64_weights(dtype, low, high):
    # Either bound counts: clip_high = 1e-300 in FP32 would be 0 and clip_high = 1e39 inf.
    correction = rt.ImportanceCorrection(clip_low=low, clip_high=high)
    weights, _ = correction_weights(_tensor([5.0, -5.0, 0.0], dtype), _tensor([0.0, 0.0, 0.0], dtype), correction)
    assert weights.dtype == torch.float64
    expected = [min(max(math.exp(r), low), high) for r in (5.0, -5.0, 0.0)]
    for got, want in zip(weights.tolist(), expected):
        assert math.isclose(got, want, rel_tol=1e-12, abs_tol=0.0), (weights, expected)


@given(dtype=st.sampled_from(DTYPES), correction=_corrections())
def test_extreme_log_ratios_give_exactly_the_bounds(dtype, correction):
    # Log-space clipping: exp(log b) is not always b, but a clipped token's weight is b.
    current, forward = _tensor([1e4, -1e4], dtype), _tensor([0.0, 0.0], dtype)
    weights, clipped = correction_weights(current, forward, correction)
    high = torch.tensor(correction.clip_high, dtype=weights.dtype)
    low = torch.tensor(correction.clip_low, dtype=weights.dtype)
    assert weights[0].item() == high.item(), (weights, correction)
    assert weights[1].item() == low.item(), (weights, correction)
    # e^-1e4 lies below a positive clip_low, and above clip_high == 0; else it is not clipped.
    assert clipped.tolist() == [True, correction.clip_low > 0 or correction.clip_high == 0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_minus_inf_current_logprob_is_allowed_and_weighs_clip_low(dtype):
    correction = rt.ImportanceCorrection(clip_low=0.25, clip_high=4.0)
    weights, _ = correction_weights(_tensor([-math.inf, -1.0], dtype), _tensor([-2.0, -1.0], dtype), correction)
    assert weights.tolist() == [0.25, 1.0]


def test_clip_high_zero_gives_zero_weights():
    correction = rt.ImportanceCorrection(clip_low=0.0, clip_high=0.0)
    weights, _ = correction_weights(torch.tensor([-1.0, 0.0, -math.inf]), torch.tensor([-2.0, -1.0, -3.0]), correction)
    assert weights.tolist() == [0.0, 0.0, 0.0]


# --- undefined ratios --------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "+inf"])
def test_nan_or_plus_inf_current_logprob_on_an_active_token_raises(dtype, bad):
    correction = rt.ImportanceCorrection()
    current, forward = _tensor([-1.0, bad, -2.0], dtype), _tensor([-1.0, -1.0, -1.0], dtype)
    cotangent = _tensor([0.0, 0.5, 0.0], dtype)  # only the bad token is active
    before = cotangent.clone()
    with pytest.raises(rt.GradientCommitError, match="NaN or \\+inf"):
        correct_cotangent(cotangent, current, forward, correction, staleness=1)
    with pytest.raises(rt.GradientCommitError):
        correction_weights(current, forward, correction)
    assert torch.equal(cotangent, before)  # no partial edit


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "+inf", "-inf"])
def test_non_finite_forward_logprob_on_an_active_token_raises(dtype, bad):
    current, forward = _tensor([-1.0, -1.0], dtype), _tensor([-1.0, bad], dtype)
    with pytest.raises(rt.GradientCommitError, match="finite forward"):
        correct_cotangent(_tensor([1.0, 1.0], dtype), current, forward, rt.ImportanceCorrection(), staleness=1)


@given(
    dtype=st.sampled_from(DTYPES),
    correction=_corrections(st.floats(0.0, 20.0, allow_nan=False, allow_infinity=False)),
    tokens=st.lists(
        st.one_of(
            st.tuples(st.just(True), _logprob, _logprob, st.floats(0.01, 10.0) | st.floats(-10.0, -0.01)),
            st.tuples(
                st.just(False),
                st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -5.0]),
                st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -5.0]),
                st.sampled_from([0.0, -0.0]),
            ),
        ),
        min_size=2,
        max_size=16,
    ),
)
def test_masked_tokens_are_never_read_and_stay_exactly_zero(dtype, correction, tokens):
    # Shape (2, n/2): the cotangent may have any shape.
    tokens = tokens[: len(tokens) // 2 * 2]
    active = torch.tensor([a for a, *_ in tokens]).reshape(2, -1)
    current = _tensor([c for _, c, _, _ in tokens], dtype).reshape(2, -1)
    forward = _tensor([f for _, _, f, _ in tokens], dtype).reshape(2, -1)
    cotangent = _tensor([g for *_, g in tokens], dtype).reshape(2, -1)
    before = cotangent.clone()

    corrected, stats = correct_cotangent(cotangent, current, forward, correction, staleness=3)

    assert torch.equal(cotangent, before), "the input cotangent was mutated"
    assert corrected.dtype == cotangent.dtype and corrected.shape == cotangent.shape
    assert corrected[~active].tolist() == [0.0] * int((~active).sum())  # exactly 0, never NaN
    weights = _reference_weights(_np(current[active]), _np(forward[active]), correction)
    expected = _np(cotangent[active]) * weights
    # Products below the cotangent dtype's smallest normal lose relative precision (or flush to 0).
    tiny = float(torch.finfo(dtype).tiny)
    np.testing.assert_allclose(_np(corrected[active]), expected, rtol=COTANGENT_RTOL[dtype], atol=tiny)
    assert stats.tokens == int(active.sum()) and stats.staleness == 3


# --- statistics --------------------------------------------------------------------


def _overflows(products: np.ndarray, dtype: torch.dtype) -> bool | None:
    """Whether corrected cotangents of these FP64 magnitudes overflow ``dtype``: None within 1% of its largest finite
    value (the weight's own rounding decides there)."""
    largest = float(torch.finfo(dtype).max)
    worst = float(np.max(np.abs(products))) if np.size(products) else 0.0
    if worst > largest * 1.01:
        return True
    return False if worst < largest * 0.99 else None


@given(
    dtype=st.sampled_from(DTYPES),
    correction=_corrections(),
    tokens=st.lists(st.tuples(_logprob | st.just(-math.inf), _logprob, st.booleans()), min_size=1, max_size=16),
    staleness=st.integers(1, 5),
)
def test_statistics_match_an_independent_numpy_computation(dtype, correction, tokens, staleness):
    current = _tensor([c for c, _, _ in tokens], dtype)
    forward = _tensor([f for _, f, _ in tokens], dtype)
    active = torch.tensor([a for *_, a in tokens])
    cotangent = active.to(dtype) * 0.5
    w_active = _reference_weights(_np(current[active]), _np(forward[active]), correction) if bool(active.any()) else []
    overflow = _overflows(0.5 * np.asarray(w_active, dtype=np.float64), dtype)
    if overflow:  # a weight x cotangent past the dtype's range is refused, naming the correction (Rule 3)
        with pytest.raises(rt.GradientCommitError, match=r"importance weight .* overflowed"):
            correct_cotangent(cotangent, current, forward, correction, staleness)
        return
    if overflow is None:  # within rounding of the dtype's largest finite value: either reading is right
        return

    _, stats = correct_cotangent(cotangent, current, forward, correction, staleness)

    assert stats.tokens == int(active.sum()) and stats.staleness == staleness
    if not bool(active.any()):
        assert (stats.mean, stats.max, stats.fraction_clipped, stats.effective_sample_size) == (0.0, 0.0, 0.0, 0.0)
        return
    dtype_w = _expected_dtype(dtype, correction)
    w = _reference_weights(_np(current[active]), _np(forward[active]), correction)
    clipped = _reference_clipped(current[active], forward[active], correction, dtype_w)
    rtol = WEIGHT_RTOL[dtype_w]
    assert math.isclose(stats.mean, float(np.mean(w)), rel_tol=rtol, abs_tol=0.0)
    assert math.isclose(stats.max, float(np.max(w)), rel_tol=rtol, abs_tol=0.0)
    assert stats.fraction_clipped == float(np.count_nonzero(clipped)) / w.size
    if np.max(w) == 0.0:  # every weight 0 (clip_high == 0 or all ratios 0): no effective sample
        assert stats.effective_sample_size == 0.0
    else:
        # Kish's ESS, (sum w)^2 / sum w^2; scale-free, so computed on w / max(w) to stay finite.
        r = w / np.max(w)
        ess = float(np.sum(r)) ** 2 / float(np.sum(r * r))
        assert math.isclose(stats.effective_sample_size, ess, rel_tol=rtol, abs_tol=0.0)
        assert 1.0 - 1e-9 <= stats.effective_sample_size <= w.size + 1e-9


@pytest.mark.parametrize(
    ("low", "high", "ratio", "mean"),
    [(0.0, 1e300, 1e4, 1e300), (1e-300, 1e-300, 0.0, 1e-300), (0.0, 3e38, 100.0, float(np.float32(3e38)))],
    ids=["1e300", "1e-300", "near-fp32-max"],
)
def test_statistics_of_extreme_weights_stay_finite(low, high, ratio, mean):
    # Squaring 1e300 overflows and squaring 1e-300 underflows; the ESS is scale-free.
    correction = rt.ImportanceCorrection(clip_low=low, clip_high=high, max_log_ratio=700.0)
    current = torch.full((3,), ratio)
    cotangent = torch.ones(3, dtype=torch.float64)  # an FP64 cotangent holds even a weight of 1e300
    _, stats = correct_cotangent(cotangent, current, torch.zeros(3), correction, staleness=1)
    assert stats.mean == mean and stats.max == mean
    assert stats.effective_sample_size == 3.0


def test_an_all_zero_cotangent_is_returned_as_is_with_zero_statistics():
    cotangent, logprobs = torch.zeros(2, 3), torch.full((2, 3), -1.0)
    corrected, stats = correct_cotangent(cotangent, logprobs + 0.5, logprobs, rt.ImportanceCorrection(), staleness=1)
    assert corrected.tolist() == cotangent.tolist()
    assert (stats.tokens, stats.mean, stats.max, stats.fraction_clipped, stats.effective_sample_size) == (
        0,
        0.0,
        0.0,
        0.0,
        0.0,
    )
