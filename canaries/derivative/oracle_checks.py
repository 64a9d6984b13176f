"""How the oracle harness compares the trainer with the FP64 oracle: one comparison per kind of outcome.

:class:`OracleChecks` is the part of ``canaries.derivative.oracle_harness``'s
:class:`~canaries.derivative.oracle_harness.DerivativeHarness` that judges
what an op produced: an outcome (success, or the same error with the same
facts), gradients (within the tolerances of
``canaries.derivative.oracle_pair``), weights (bitwise), an AdamW change
(Rule 3), and ``.grad`` left as it was by a refused call. Each raises
:class:`CanaryFailure` naming what was expected, what was found and the ops
that led there; :func:`caught` collects an op's exception to compare. The
rules cited are NOTE [Derivative canary]'s (``canaries.derivative.canary``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

import reference_trainer as rt
from validation.compare import ComparisonError, relative_l2

from .oracle_pair import CanaryFailure, Measurements, Tolerances, judge_gradients

__all__ = ["OracleChecks", "caught"]


def _error_facts(error: BaseException) -> dict[str, Any]:
    names = (
        "checkpoint",
        "staleness",
        "bound",
        "forward_revision",
        "current_revision",
        "live_graphs",
        "pending_gradients",
        "record_retryable",
    )
    return {n: getattr(error, n) for n in names if hasattr(error, n)}


def _describe_error(error: BaseException | None) -> str:
    return (
        "success"
        if error is None
        else f"{type(error).__name__}({', '.join(f'{k}={v!r}' for k, v in _error_facts(error).items())})"
    )


@contextmanager
def caught() -> Iterator[list[BaseException]]:
    """Collect a trainer or oracle exception instead of raising it (tracebacks dropped: they pin tensors)."""
    box: list[BaseException] = []
    try:
        yield box
    except CanaryFailure:
        raise
    except Exception as error:  # noqa: BLE001 - any exception is an outcome to compare
        error.__traceback__ = None
        box.append(error)


class OracleChecks:
    """The comparisons of a trainer's outcome with the oracle's; a subclass drives the ops and fills the fields."""

    checkpoint: rt.Checkpoint  # the trainer's checkpoint under test
    tol: Tolerances
    measured: Measurements
    generations: dict[int, int]  # oracle generation -> trainer generation
    log: list[str]  # the ops so far, named in every failure
    failed: bool

    def _expect(self, ok: bool, what: str, expected: object, found: object) -> None:
        if not ok:
            self.failed = True
            ops = "\n  ".join(self.log[-20:])
            raise CanaryFailure(f"{what}: expected {expected}, found {found}\n  after ops:\n  {ops}")

    def _check_update(self, before: dict, after: dict, predicted: dict) -> None:
        """The master-weight change matches the oracle's (Rule 3), per parameter and pooled.

        Per parameter the bound is ``step * ||predicted change|| + 8 eps ||weights||``:
        a parameter without gradient only decays (a change ~1e-4 of the weights),
        which its own storage dtype rounds at ``eps``; a wrong update rule moves
        far more. Pooled over parameters, the relative L2 must be within ``step``.
        """
        diff_sq = ref_sq = 0.0
        for n, value in after.items():
            start = before[n].double()
            found, reference = value.double() - start, predicted[n] - start
            diff = float(torch.linalg.vector_norm(found - reference))
            scale = float(torch.linalg.vector_norm(reference))
            slack = 8 * torch.finfo(value.dtype).eps * float(torch.linalg.vector_norm(value.double()))
            self._expect(
                diff <= self.tol.step * scale + slack,
                f"AdamW change of {n!r} from the same starting point",
                f"within {self.tol.step:.0e} x {scale:.3e} + {slack:.3e}",
                f"a difference of {diff:.3e}",
            )
            diff_sq, ref_sq = diff_sq + diff * diff, ref_sq + scale * scale
        self._expect(ref_sq > 0, "AdamW change", "a non-zero predicted change", "none")
        error = math.sqrt(diff_sq / ref_sq)
        self.measured.worst_step_error = max(self.measured.worst_step_error, error)
        self._expect(
            error <= self.tol.step,
            "AdamW change from the same starting point (relative L2)",
            f"<= {self.tol.step}",
            error,
        )

    def _relative(self, what: str, found: torch.Tensor, reference: torch.Tensor) -> float:
        try:
            return relative_l2(found, reference)
        except ComparisonError as error:
            raise CanaryFailure(f"{what}: {error}") from None

    def _compare(self, what: str, found: dict, reference: dict, baseline: dict, dtypes: dict | None = None) -> None:
        try:
            comparison = judge_gradients(found, reference, baseline, self.tol, dtypes)
        except ComparisonError as error:
            self._expect(False, what, "comparable gradients", error)
        name, error = comparison.worst
        self.measured.worst_gradient_error = max(self.measured.worst_gradient_error, error)
        self.measured.worst_gradient_margin = max(
            self.measured.worst_gradient_margin, error / comparison.thresholds[name]
        )
        self.measured.min_reference_norm = min(self.measured.min_reference_norm, comparison.reference_norm)
        self._expect(comparison.passed, what, "agreement with the FP64 oracle", comparison.describe())

    def _same_outcome(self, op: str, predicted: list[BaseException], raised: list[BaseException]) -> None:
        expected = predicted[0] if predicted else None
        found = raised[0] if raised else None
        if expected is None and found is None:
            return
        if expected is None or found is None or type(found) is not type(expected):
            detail = "" if found is None else f": {found}"
            self._expect(False, op, _describe_error(expected), _describe_error(found) + detail)
        self._expect(
            _error_facts(found) == _error_facts(expected),
            f"{op} error facts",
            _describe_error(expected),
            _describe_error(found),
        )
        if isinstance(expected, rt.CheckpointReplacedError):
            mapped = self.generations.get(expected.forward_generation)
            self._expect(
                found.forward_generation == mapped, "replaced forward generation", mapped, found.forward_generation
            )

    def _unchanged(self, before: dict, values: dict, what: str) -> None:
        for n, p in self.checkpoint.named_parameters():
            self._expect(p.grad is before[n], f"{what}: .grad object of {n!r}", "unchanged", "replaced")
            if values[n] is not None:
                self._expect(torch.equal(p.grad, values[n]), f"{what}: .grad value of {n!r}", "unchanged", "changed")

    def _weights_equal(self, expected: dict[str, torch.Tensor], what: str) -> None:
        for n, p in self.checkpoint.named_parameters():
            self._expect(
                torch.equal(p.detach().double().to(expected[n].device), expected[n]),
                f"{what} {n!r}",
                "exactly the oracle's",
                "different values",
            )
