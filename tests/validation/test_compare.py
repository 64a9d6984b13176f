"""Gradient comparators: values, the non-zero reference guard, structural failures (NOTE [Comparing gradients])."""

from __future__ import annotations

import math

import pytest
import torch

from validation.compare import ComparisonError, compare_gradients, relative_l2


def test_relative_l2_is_the_fp64_norm_ratio() -> None:
    reference = torch.tensor([3.0, 4.0])  # norm 5
    found = torch.tensor([3.0, 4.5])
    assert relative_l2(found, reference) == pytest.approx(0.5 / 5.0, rel=1e-12)
    assert relative_l2(reference.clone(), reference) == 0.0
    # FP32 inputs are compared in FP64: 1e-8 survives, it would not in FP32 arithmetic.
    assert relative_l2(torch.tensor([1.0 + 1e-7]), torch.tensor([1.0], dtype=torch.float64)) > 0


def test_zero_reference_is_refused_unless_allowed_and_found_is_exactly_zero() -> None:
    zero = torch.zeros(3)
    with pytest.raises(ComparisonError, match="reference is exactly zero"):
        relative_l2(zero.clone(), zero)  # both zero: vacuous, refused by default
    assert relative_l2(zero.clone(), zero, allow_zero=True) == 0.0
    with pytest.raises(ComparisonError, match=r"found norm 1\.000e-06"):
        relative_l2(torch.tensor([1e-6, 0.0, 0.0]), zero, allow_zero=True)


@pytest.mark.parametrize(
    ("found", "reference", "message"),
    [
        (torch.zeros(2, 3), torch.ones(3, 2), r"expected shape \(3, 2\), found \(2, 3\)"),
        (torch.ones(3, dtype=torch.int64), torch.ones(3), "floating-point tensor on the found side"),
        (torch.ones(3), [1.0, 1.0, 1.0], "floating-point tensor on the reference side, found list"),
    ],
)
def test_structural_mismatch_is_a_hard_failure(found: object, reference: object, message: str) -> None:
    with pytest.raises(ComparisonError, match=message):
        relative_l2(found, reference)  # type: ignore[arg-type]


def _pair() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    reference = {
        "a": torch.tensor([3.0, 4.0], dtype=torch.float64),
        "b": torch.tensor([0.0, 12.0], dtype=torch.float64),
    }
    found = {
        "a": torch.tensor([3.0, 4.0 + 1e-3], dtype=torch.float64),
        "b": torch.tensor([0.0, 12.0], dtype=torch.float64),
    }
    return found, reference


def test_compare_gradients_reports_per_parameter_global_and_worst() -> None:
    found, reference = _pair()
    result = compare_gradients(found, reference, tolerance=1e-3)
    assert result.per_parameter["a"] == pytest.approx(1e-3 / 5.0)
    assert result.per_parameter["b"] == 0.0
    assert result.reference_norm == pytest.approx(13.0)  # sqrt(25 + 144)
    assert result.global_error == pytest.approx(1e-3 / 13.0)
    assert result.worst == ("a", result.per_parameter["a"])
    assert result.passed and "within tolerance" in result.describe()


def test_per_parameter_and_global_tolerances_are_both_enforced() -> None:
    found, reference = _pair()
    per_param = 1e-3 / 5.0
    assert not compare_gradients(found, reference, tolerance=per_param / 2, global_tolerance=1.0).passed
    assert not compare_gradients(found, reference, tolerance=1.0, global_tolerance=1e-3 / 13.0 / 2).passed
    failed = compare_gradients(found, reference, tolerance=per_param / 2)
    assert "OUTSIDE tolerance" in failed.describe() and "'a'" in failed.describe()


def test_floor_bounds_the_denominator_of_tiny_references_only() -> None:
    reference = {"big": torch.tensor([100.0], dtype=torch.float64), "tiny": torch.tensor([1e-6], dtype=torch.float64)}
    found = {"big": torch.tensor([100.0], dtype=torch.float64), "tiny": torch.tensor([2e-6], dtype=torch.float64)}
    assert compare_gradients(found, reference, tolerance=1e-3).per_parameter["tiny"] == pytest.approx(1.0)
    floored = compare_gradients(found, reference, tolerance=1e-3, floor=1e-2)
    assert floored.per_parameter["tiny"] == pytest.approx(1e-6 / 1.0)  # against 1% of the pooled norm 100
    assert floored.global_error == pytest.approx(1e-6 / 100.0)
    wrong = {"big": torch.tensor([101.0], dtype=torch.float64), "tiny": reference["tiny"].clone()}
    assert compare_gradients(wrong, reference, tolerance=1e-3, floor=1e-2).per_parameter["big"] == pytest.approx(0.01)


def test_missing_extra_and_one_sided_none_are_hard_failures() -> None:
    found, reference = _pair()
    with pytest.raises(ComparisonError, match=r"missing \['b'\] and extra \['c'\]"):
        compare_gradients({"a": found["a"], "c": found["b"]}, reference, tolerance=1.0)
    with pytest.raises(ComparisonError, match="'b' has a gradient on one side only \\(found is None\\)"):
        compare_gradients({**found, "b": None}, reference, tolerance=1.0)
    with pytest.raises(ComparisonError, match="reference is None"):
        compare_gradients(found, {**reference, "b": None}, tolerance=1.0)


def test_none_on_both_sides_agrees_but_something_must_be_compared() -> None:
    found, reference = _pair()
    result = compare_gradients({**found, "c": None}, {**reference, "c": None}, tolerance=1e-3)
    assert set(result.per_parameter) == {"a", "b"}
    with pytest.raises(ComparisonError, match="nothing was compared"):
        compare_gradients({"c": None}, {"c": None}, tolerance=1.0)


def test_dtype_is_checked_against_the_expected_dtypes() -> None:
    found, reference = _pair()
    with pytest.raises(ComparisonError, match=r"'a' expected dtype torch\.float64, found torch\.float32"):
        compare_gradients({**found, "a": found["a"].float()}, reference, tolerance=1.0)
    fp32 = {n: t.float() for n, t in found.items()}
    assert compare_gradients(fp32, reference, tolerance=1e-3, dtypes={"a": torch.float32, "b": torch.float32}).passed
    with pytest.raises(ComparisonError, match=r"'b' expected dtype torch\.bfloat16"):
        compare_gradients(fp32, reference, tolerance=1.0, dtypes={"a": torch.float32, "b": torch.bfloat16})


def test_zero_guard_per_parameter_and_pooled() -> None:
    zero = torch.zeros(2, dtype=torch.float64)
    found, reference = _pair()
    with pytest.raises(ComparisonError, match="reference is exactly zero"):
        compare_gradients({**found, "z": zero.clone()}, {**reference, "z": zero}, tolerance=1.0)
    allowed = compare_gradients({**found, "z": zero.clone()}, {**reference, "z": zero}, tolerance=1e-3, allow_zero=True)
    assert allowed.per_parameter["z"] == 0.0 and allowed.passed
    with pytest.raises(ComparisonError, match="every reference is exactly zero"):
        compare_gradients({"z": zero.clone()}, {"z": zero}, tolerance=1.0, allow_zero=True)


def test_non_finite_found_values_fail_and_rank_worst() -> None:
    found, reference = _pair()
    found["b"] = torch.tensor([math.nan, 12.0], dtype=torch.float64)
    result = compare_gradients(found, reference, tolerance=1.0)
    assert not result.passed
    assert result.worst[0] == "b" and math.isnan(result.worst[1])


def test_baseline_scales_thresholds_up_to_the_cap() -> None:
    reference = {"a": torch.tensor([1.0, 0.0], dtype=torch.float64)}
    found = {"a": torch.tensor([1.0, 1e-3], dtype=torch.float64)}  # error 1e-3
    plain = {"a": torch.tensor([1.0, 5e-4], dtype=torch.float64)}  # plain arithmetic is off by 5e-4 here
    assert not compare_gradients(found, reference, tolerance=1e-4).passed
    scaled = compare_gradients(found, reference, tolerance=1e-4, baseline=plain, baseline_factor=4.0)
    assert scaled.thresholds["a"] == pytest.approx(2e-3) and scaled.global_threshold == pytest.approx(2e-3)
    assert scaled.passed
    capped = compare_gradients(found, reference, tolerance=1e-4, baseline=plain, max_tolerance=5e-4)
    assert capped.thresholds["a"] == pytest.approx(5e-4) and not capped.passed
    exact = compare_gradients(found, reference, tolerance=1e-4, baseline=reference)  # plain is exact: no slack
    assert exact.thresholds["a"] == 1e-4 and not exact.passed
    with pytest.raises(ComparisonError, match="baseline side"):
        compare_gradients(found, reference, tolerance=1e-4, baseline={})
