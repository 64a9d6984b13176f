"""Paired TOST verdicts (validation.equivalence) against closed-form Student-t oracles."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from validation.equivalence import EquivalenceInputError, equivalence_margin, paired_equivalence


def t2_quantile(p: float) -> float:
    """Student t with 2 degrees of freedom has a closed-form quantile."""
    return (2 * p - 1) / math.sqrt(2 * p * (1 - p))


def t2_cdf(x: float) -> float:
    return 0.5 + x / (2 * math.sqrt(2 + x * x))


def test_interval_and_tost_p_match_the_closed_form_for_three_seeds() -> None:
    baseline = [1.0, 1.2, 0.9]
    arm = [1.05, 1.31, 0.92]
    diffs = [a - b for a, b in zip(arm, baseline)]
    mean = sum(diffs) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2)
    sem = sd / math.sqrt(3)
    margin = math.sqrt(sum((b - sum(baseline) / 3) ** 2 for b in baseline) / 2)  # SD of the baseline > floor
    result = paired_equivalence(arm, baseline, floor=0.01, higher_is_better=False)
    half = t2_quantile(0.95) * sem
    assert half > 0 and margin > 0.01
    assert result.ci_low == pytest.approx(mean - half, rel=1e-12)
    assert result.ci_high == pytest.approx(mean + half, rel=1e-12)
    assert result.margin == pytest.approx(margin, rel=1e-12) and result.baseline_sd == result.margin
    p_expected = max(1 - t2_cdf((mean + margin) / sem), t2_cdf((mean - margin) / sem))
    assert result.p_tost == pytest.approx(p_expected, rel=1e-9)
    assert result.differences == pytest.approx(tuple(diffs))
    inside = -margin < mean - half and mean + half < margin
    assert result.verdict == ("equivalent" if inside else "inconclusive")
    assert (result.p_tost < 0.05) == inside


def test_two_seeds_use_the_cauchy_quantile() -> None:
    result = paired_equivalence([1.0, 2.0], [0.0, 0.0], floor=0.5, higher_is_better=True)
    # 1 degree of freedom: the t distribution is Cauchy, quantile tan(pi (p - 1/2)).
    sem = math.sqrt(0.5) / math.sqrt(2)  # sample SD of (1, 2) over sqrt(n)
    half = math.tan(math.pi * 0.45) * sem
    assert result.ci_low == pytest.approx(1.5 - half) and result.ci_high == pytest.approx(1.5 + half)


@pytest.mark.parametrize(
    ("arm", "higher_is_better", "verdict"),
    [
        ([1.01, 0.99, 1.0, 1.005, 0.995], False, "equivalent"),
        ([2.0, 2.1, 1.9, 2.05, 1.95], False, "worse"),  # a loss that went up
        ([2.0, 2.1, 1.9, 2.05, 1.95], True, "better"),  # a reward that went up
        ([0.0, 0.1, -0.1, 0.05, -0.05], True, "worse"),
        ([1.0, 3.0, -1.0, 2.5, -0.5], False, "inconclusive"),
    ],
)
def test_verdicts(arm: list[float], higher_is_better: bool, verdict: str) -> None:
    baseline = [1.0] * 5
    assert paired_equivalence(arm, baseline, floor=0.1, higher_is_better=higher_is_better).verdict == verdict


@pytest.mark.parametrize("higher_is_better", [False, True])
def test_a_tight_interval_inside_the_margin_is_equivalent_even_when_wholly_on_one_side_of_zero(
    higher_is_better,
) -> None:
    """Rule 4: "equivalent" wins over "worse"/"better" (a significant difference we do not care about)."""
    baseline = [1.0, 1.0, 1.0]
    arm = [1.049, 1.05, 1.051]  # d = (0.049, 0.05, 0.051): mean 0.05, sample SD 0.001
    # Closed form, 2 degrees of freedom: the 90% interval is 0.05 +- t_0.95 * 0.001 / sqrt(3), inside (-0.1, 0.1)
    # and entirely above 0 (so a one-sided test also says the arm moved, in the worse direction for a loss).
    half = t2_quantile(0.95) * 0.001 / math.sqrt(3)
    assert 0 < 0.05 - half and 0.05 + half < 0.1
    result = paired_equivalence(arm, baseline, floor=0.1, higher_is_better=higher_is_better)
    assert (result.ci_low, result.ci_high) == (pytest.approx(0.05 - half), pytest.approx(0.05 + half))
    assert result.verdict == "equivalent"


def test_identical_arms_are_equivalent_with_a_point_interval() -> None:
    values = [0.3, 0.5, 0.4]
    result = paired_equivalence(values, values, floor=0.01, higher_is_better=False)
    assert (result.ci_low, result.ci_high, result.verdict, result.p_tost) == (0.0, 0.0, "equivalent", 0.0)
    shifted = paired_equivalence([v + 1.0 for v in values], values, floor=0.01, higher_is_better=False)
    assert (shifted.ci_low, shifted.verdict, shifted.p_tost) == (pytest.approx(1.0), "worse", 1.0)


def test_margin_is_the_floor_or_the_baseline_spread() -> None:
    assert equivalence_margin([1.0, 1.0, 1.0], 0.2) == (0.2, 0.0)
    margin, sd = equivalence_margin([0.0, 2.0], 0.2)
    assert margin == sd == pytest.approx(math.sqrt(2))


@pytest.mark.parametrize(
    ("arm", "baseline", "floor"),
    [([1.0, 2.0], [1.0], 0.1), ([1.0], [1.0], 0.1), ([1.0, math.nan], [1.0, 1.0], 0.1), ([1.0, 2.0], [1.0, 1.0], -1.0)],
)
def test_bad_input_is_refused_with_the_fix(arm: list[float], baseline: list[float], floor: float) -> None:
    with pytest.raises(EquivalenceInputError) as error:
        paired_equivalence(arm, baseline, floor=floor, higher_is_better=False)
    assert error.value.exit_code == 2 and "fix:" in str(error.value)


finite = st.floats(-10, 10, allow_nan=False)


@given(st.lists(st.tuples(finite, finite), min_size=2, max_size=8), st.floats(0, 5))
# A tight interval inside the margin and wholly on one side of 0: the `ci` profile rarely draws it, `nightly` does.
@example([(1.049, 1.0), (1.05, 1.0), (1.051, 1.0)], 0.1)
def test_equivalence_iff_the_interval_is_inside_the_margin_and_direction_flips_the_verdict(pairs, floor) -> None:
    arm, baseline = [a for a, _ in pairs], [b for _, b in pairs]
    low_is_good = paired_equivalence(arm, baseline, floor=floor, higher_is_better=False)
    high_is_good = paired_equivalence(arm, baseline, floor=floor, higher_is_better=True)
    inside = -low_is_good.margin < low_is_good.ci_low and low_is_good.ci_high < low_is_good.margin
    assert (low_is_good.verdict == "equivalent") == inside
    swap = {"worse": "better", "better": "worse"}
    assert high_is_good.verdict == swap.get(low_is_good.verdict, low_is_good.verdict)
    assert low_is_good.ci_low <= low_is_good.mean_difference <= low_is_good.ci_high
