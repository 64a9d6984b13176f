"""Gradient comparators: per-parameter and global relative L2, fail-closed.

NOTE [Comparing gradients]
  1. Relative L2: ``||found - reference|| / ||reference||`` in FP64; the
     global error pools every parameter: ``sqrt(sum ||f - r||^2) / sqrt(sum
     ||r||^2)``.
  2. A zero reference proves nothing (all zeros on both sides would "agree"),
     so it is a :class:`ComparisonError`, unless the caller says a zero is
     legitimate (``allow_zero=True``: with one token, attention does not
     depend on queries and keys) *and* the found value is exactly zero too,
     which counts as error 0. The pooled reference must be non-zero even then.
  3. Structure is never a matter of tolerance: missing or extra keys, a
     gradient against ``None``, a shape mismatch, a non-floating dtype or an
     unexpected found dtype is a :class:`ComparisonError`, never a large
     number.
  4. ``passed`` needs every per-parameter error within its threshold and the
     global error within the global threshold.
  5. Negligible references: a gradient that is zero in exact arithmetic is
     rounding noise in FP64 too, so its relative error means nothing. With
     ``floor=f`` each parameter's error is measured against
     ``max(||reference||, f x pooled reference norm)``; no parameter escapes
     judgement and the pooled error is unaffected.
  6. Rounding error depends on conditioning: a cancelling gradient shows a
     large relative error in plain FP32 too. Given a ``baseline`` (the same
     gradients computed plainly in the found dtype), each threshold is
     ``max(tolerance, baseline_factor x the baseline's own error)``, capped at
     ``max_tolerance``: a few times plain arithmetic's noise, never worse than
     the cap.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .errors import CheckFailed

__all__ = ["ComparisonError", "GradientComparison", "relative_l2", "compare_gradients"]


class ComparisonError(CheckFailed):
    """Two gradient sets cannot be compared meaningfully (NOTE Rules 2-3); the check they serve fails (exit 1).

    Cause: different keys or shapes, a ``None`` on one side only, a wrong
    dtype, or a vacuous (all-zero) reference. Fix the producer of the
    mismatching side; a tolerance cannot excuse it.
    """

    def __init__(
        self, cause: str, *, fix: str = "fix the producer of the mismatching side; a tolerance cannot excuse it"
    ) -> None:
        super().__init__(cause, fix=fix)


def relative_l2(found: torch.Tensor, reference: torch.Tensor, *, allow_zero: bool = False) -> float:
    """``||found - reference|| / ||reference||`` in FP64 (Rule 1), with the zero guard (Rule 2).

    Shapes must match exactly (Rule 3).
    """
    diff, norm = _norms("relative_l2", found, reference)
    if norm == 0.0:
        if allow_zero and diff == 0.0:
            return 0.0
        raise ComparisonError(
            f"relative_l2: the reference is exactly zero (found norm "
            f"{float(torch.linalg.vector_norm(found.detach().double())):.3e}); expected a non-zero "
            "reference, or allow_zero=True with a found value that is exactly zero too"
        )
    return diff / norm


@dataclass(frozen=True)
class GradientComparison:
    """Outcome of :func:`compare_gradients` (NOTE Rules 4-6)."""

    per_parameter: dict[str, float]
    thresholds: dict[str, float]
    global_error: float
    global_threshold: float
    reference_norm: float

    @property
    def worst(self) -> tuple[str, float]:
        """The parameter closest to (or furthest past) its threshold, and its error."""
        # NaN (a non-finite found value) ranks worst of all.
        name = max(self.per_parameter, key=lambda n: _rank(self.per_parameter[n] / self.thresholds[n]))
        return name, self.per_parameter[name]

    @property
    def passed(self) -> bool:
        within = all(e <= self.thresholds[n] for n, e in self.per_parameter.items())
        return within and self.global_error <= self.global_threshold

    def describe(self) -> str:
        name, error = self.worst
        verdict = "within" if self.passed else "OUTSIDE"
        return (
            f"global relative L2 {self.global_error:.3e} (threshold {self.global_threshold:.1e}), worst "
            f"parameter {name!r} {error:.3e} (threshold {self.thresholds[name]:.1e}), reference norm "
            f"{self.reference_norm:.3e}: {verdict} tolerance"
        )


def compare_gradients(
    found: Mapping[str, torch.Tensor | None],
    reference: Mapping[str, torch.Tensor | None],
    *,
    tolerance: float,
    global_tolerance: float | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
    allow_zero: bool = False,
    floor: float = 0.0,
    baseline: Mapping[str, torch.Tensor | None] | None = None,
    baseline_factor: float = 4.0,
    max_tolerance: float | None = None,
) -> GradientComparison:
    """Compare two gradient sets keyed by parameter name (NOTE [Comparing gradients]).

    ``reference`` is usually the FP64 oracle. Each found tensor must have the
    dtype given in ``dtypes`` (e.g. its parameter's dtype), or the reference's
    dtype when ``dtypes`` is None. A ``None`` on both sides means "no
    gradient" on both, which agrees and is left out; at least one pair must
    remain. ``allow_zero`` admits exactly-zero pairs (Rule 2); ``floor``
    bounds the per-parameter denominators (Rule 5); ``baseline`` (same keys
    as ``reference``) scales the thresholds (Rule 6); without it they are
    ``tolerance`` and ``global_tolerance`` (default ``tolerance``).
    Raises :class:`ComparisonError` on any structural mismatch or a vacuous
    reference.
    """
    global_tolerance = tolerance if global_tolerance is None else global_tolerance
    cap = math.inf if max_tolerance is None else max_tolerance
    _check_keys("found", found, reference)
    if baseline is not None:
        _check_keys("baseline", baseline, reference)
    norms: dict[str, tuple[float, float, float]] = {}  # name -> (||f - r||, ||r||, ||baseline - r||)
    for name, r in reference.items():
        f = found[name]
        if f is None and r is None:
            continue
        if f is None or r is None:
            side = "found" if f is None else "reference"
            raise ComparisonError(f"compare_gradients: {name!r} has a gradient on one side only ({side} is None)")
        expected = dtypes[name] if dtypes is not None else r.dtype
        if isinstance(f, torch.Tensor) and f.dtype != expected:
            raise ComparisonError(f"compare_gradients: {name!r} expected dtype {expected}, found {f.dtype}")
        relative_l2(f, r, allow_zero=allow_zero)  # the zero guard (Rule 2)
        diff, norm = _norms(name, f, r)
        base_diff = 0.0 if baseline is None else _norms(f"baseline {name}", baseline[name], r)[0]
        norms[name] = (diff, norm, base_diff)
    if not norms:
        raise ComparisonError("compare_gradients: every gradient is None on both sides; nothing was compared")
    reference_norm = math.sqrt(sum(norm * norm for _, norm, _ in norms.values()))
    if reference_norm == 0.0:
        raise ComparisonError(
            f"compare_gradients: every reference is exactly zero ({len(norms)} parameters); expected "
            "at least one non-zero reference, or the comparison is vacuous"
        )

    def ratio(diff: float, norm: float) -> float:
        return 0.0 if diff == 0.0 else diff / max(norm, floor * reference_norm)

    def threshold(plain: float, minimum: float) -> float:
        return minimum if baseline is None else min(cap, max(minimum, baseline_factor * plain))

    pooled = [math.sqrt(sum(v[i] ** 2 for v in norms.values())) for i in (0, 2)]
    return GradientComparison(
        per_parameter={n: ratio(diff, norm) for n, (diff, norm, _) in norms.items()},
        thresholds={n: threshold(ratio(base, norm), tolerance) for n, (_, norm, base) in norms.items()},
        global_error=pooled[0] / reference_norm,
        global_threshold=threshold(pooled[1] / reference_norm, global_tolerance),
        reference_norm=reference_norm,
    )


def _rank(margin: float) -> float:
    return math.inf if math.isnan(margin) else margin


def _check_keys(side: str, values: Mapping[str, object], reference: Mapping[str, object]) -> None:
    if set(values) != set(reference):
        raise ComparisonError(
            f"compare_gradients: expected the reference's keys on the {side} side, found missing "
            f"{sorted(set(reference) - set(values))} and extra {sorted(set(values) - set(reference))}"
        )


def _floating(name: str, side: str, value: object) -> torch.Tensor:
    """``value`` if it is a floating-point tensor; else the ``ComparisonError`` that names the side."""
    if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
        what = f"a tensor of dtype {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ComparisonError(f"{name}: expected a floating-point tensor on the {side} side, found {what}")
    return value


def _norms(name: str, found: object, reference: object) -> tuple[float, float]:
    """``(||found - reference||, ||reference||)`` in FP64, after the structural checks (Rule 3)."""
    found, reference = _floating(name, "found", found), _floating(name, "reference", reference)
    if tuple(found.shape) != tuple(reference.shape):
        raise ComparisonError(f"{name}: expected shape {tuple(reference.shape)}, found {tuple(found.shape)}")
    ref = reference.detach().double()
    diff = float(torch.linalg.vector_norm(found.detach().double().to(ref.device) - ref))
    return diff, float(torch.linalg.vector_norm(ref))
