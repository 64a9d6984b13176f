"""The gradient checks: *sync*, *stale* and *splits* (docs/conform.md#the-checks states each).

Each takes a factory and the spec, starts a fresh adapter (``jobs.started``),
and returns a :class:`Verdict`: ``passed`` or ``failed`` with the reason and,
for a failure, the worst element against the oracle (NOTE [Conformance
oracle] Rule 3). The oracle's weights are snapshots the check takes itself,
right before the forward they stand for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .jobs import ConformBatch, Driven, make_batch, started
from .oracle import FP64Oracle, WorstElement, compare, snapshot, tolerance
from .protocol import ConformSpec

__all__ = ["Verdict", "PASSED", "FAILED", "NOT_APPLICABLE", "UPDATED_WEIGHTS", "sync", "stale", "splits", "SYNC_STEPS"]

PASSED, FAILED, NOT_APPLICABLE = "passed", "failed", "not applicable"
UPDATED_WEIGHTS = "updated_weights"  # a stale failure's diagnosis: nearer the live weights' oracle than revision v's
SYNC_STEPS = 3


@dataclass(frozen=True)
class Verdict:
    """One check's outcome for one adapter: ``status`` (:data:`PASSED` | :data:`FAILED` | :data:`NOT_APPLICABLE`)."""

    check: str
    status: str
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)


def _failed(check: str, reason: str, comparison: WorstElement, **evidence: Any) -> Verdict:
    return Verdict(check, FAILED, f"{reason}: {comparison.worst()}", {"worst": comparison.evidence(), **evidence})


class _AdamW64:
    """``torch.optim.AdamW`` in FP64 at the spec's settings, stepped from the adapter's own weights and gradients."""

    def __init__(self, spec: ConformSpec, names: list[str]) -> None:
        self._params = {name: torch.zeros(1, dtype=torch.float64, requires_grad=True) for name in names}
        self._optimizer = torch.optim.AdamW(
            list(self._params.values()), lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay
        )

    def step(self, weights: dict[str, torch.Tensor], grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        for name, param in self._params.items():
            param.data = weights[name].clone()
            grad = grads.get(name)
            param.grad = None if grad is None else grad.to(torch.float64)
        self._optimizer.step()
        return {name: param.detach().clone() for name, param in self._params.items()}


def _update(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a step changed, per parameter: ``after - before`` (the comparison's scale is then the update's, not the weights')."""
    return {name: after[name] - before[name] for name in before}


def sync(factory: Callable[[], Any], spec: ConformSpec) -> Verdict:
    """Staleness 0: each step's gradient is the oracle's at the live weights, and the step is AdamW's from them.

    A step is judged by its update (new weights - old) against FP64 AdamW's
    update from the same weights and gradient, so an update some 1e-2 of the
    weights is not judged at the weights' scale.
    """
    driven = started(factory, spec)
    oracle, tol = FP64Oracle(driven.adapter), tolerance(spec.torch_dtype)
    adamw = _AdamW64(spec, list(snapshot(driven.module())))
    worst_grad = worst_step = None
    for step in range(SYNC_STEPS):
        weights, batch = snapshot(driven.module()), make_batch(spec, step)
        driven.adapter.backward(driven.step_loss(batch, batch.active))
        found = driven.gradients()
        grad = compare(found, oracle.gradients(weights, [batch.oracle_batch()], batch.active), tol)
        if not grad.ok:
            return _failed("sync", f"step {step}: the gradient is not the oracle's at the live weights", grad)
        driven.adapter.optim_step()
        moved = compare(_update(snapshot(driven.module()), weights), _update(adamw.step(weights, found), weights), tol)
        if not moved.ok:
            return _failed(
                "sync",
                f"step {step}: optim_step did not move the weights as AdamW(lr={spec.lr}, "
                f"betas={spec.betas}, eps={spec.eps}, weight_decay={spec.weight_decay}) does",
                moved,
            )
        driven.adapter.zero_grad()
        worst_grad = grad if worst_grad is None or grad.error > worst_grad.error else worst_grad
        worst_step = moved if worst_step is None or moved.error > worst_step.error else worst_step
    assert worst_grad is not None and worst_step is not None  # SYNC_STEPS >= 1
    return Verdict(
        "sync",
        PASSED,
        f"{SYNC_STEPS} steps: worst gradient error {worst_grad.error:.3g}, worst step "
        f"error {worst_step.error:.3g} (tolerance {tol:.3g})",
        {"worst": worst_grad.evidence(), "worst_step": worst_step.evidence()},
    )


def stale(factory: Callable[[], Any], spec: ConformSpec) -> Verdict:
    """For k in 1..max_staleness: forward at revision v, k other steps, backward: the oracle's gradient at v.

    Not vacuous: the oracle at the live weights must differ from revision v's
    by more than twice the tolerance (so a gradient within tolerance of one
    cannot be within tolerance of the other), or the check fails saying the
    weights did not move enough to tell them apart. A failure is diagnosed
    :data:`UPDATED_WEIGHTS` (evidence ``diagnosis``) only when the gradient
    is nearer the live weights' oracle than revision v's.
    """
    driven = started(factory, spec)
    oracle, tol = FP64Oracle(driven.adapter), tolerance(spec.torch_dtype)
    step, revision, per_k = 0, 0, {}
    for k in range(1, spec.max_staleness + 1):
        weights, batch = snapshot(driven.module()), make_batch(spec, 1000 + k)
        pending = driven.step_loss(batch, batch.active)
        for _ in range(k):
            driven.train_step(make_batch(spec, step))
            step, revision = step + 1, revision + 1
        live = snapshot(driven.module())
        driven.adapter.backward(pending)
        found = driven.gradients()
        at_v = oracle.gradients(weights, [batch.oracle_batch()], batch.active)
        at_live = oracle.gradients(live, [batch.oracle_batch()], batch.active)
        separation = compare(at_live, at_v, tol)
        if separation.error <= 2 * tol:
            return _failed(
                "stale",
                f"staleness {k}: vacuous, the oracle at the live weights is within twice the "
                f"tolerance of revision {revision - k}'s; raise spec.lr",
                separation,
            )
        against_v = compare(found, at_v, tol)
        if not against_v.ok:
            return _stale_failed(k, revision, against_v, compare(found, at_live, tol))
        per_k[k] = {"error": against_v.error, "live_oracle_separation": separation.error}
        driven.adapter.optim_step()
        driven.adapter.zero_grad()
        revision += 1
    worst = max(per_k.values(), key=lambda entry: entry["error"])
    extra = _extra(driven)
    measured = "".join(f"; {key} {value}" for key, value in extra.get("adapter_measurements", {}).items())
    return Verdict(
        "stale",
        PASSED,
        f"k = 1..{spec.max_staleness}: worst error {worst['error']:.3g} at the forward's "
        f"weights; the live weights' oracle differs by >= "
        f"{min(v['live_oracle_separation'] for v in per_k.values()):.3g} (tolerance {tol:.3g}){measured}",
        {"per_staleness": per_k, **extra},
    )


def _stale_failed(k: int, revision: int, against_v: WorstElement, against_live: WorstElement) -> Verdict:
    """The failure of staleness ``k``, diagnosed :data:`UPDATED_WEIGHTS` only when the live weights' oracle is nearer."""
    if against_live.error < against_v.error:
        diagnosis, why = (
            UPDATED_WEIGHTS,
            ("the backward ran through weights updated after the forward (live or in-place-updated weights)"),
        )
    else:
        diagnosis, why = (
            "not_staleness",
            (
                "the live weights' oracle is no nearer, so not staleness: a gradient "
                "wrong at any revision (precision, or the computation)"
            ),
        )
    return _failed(
        "stale",
        f"staleness {k}: the gradient is not the oracle's at the forward's weights (revision "
        f"{revision - k}); against the live weights (revision {revision}) its error is "
        f"{against_live.error:.3g}: {why}",
        against_v,
        against_live=against_live.evidence(),
        diagnosis=diagnosis,
    )


def _arms(batch: ConformBatch) -> dict[str, Callable[[Driven, ConformBatch], None]]:
    """The splits of one batch: micro-batches accumulated (one backward each), and separate forwards, one backward."""
    size = batch.ids.shape[0]

    def micro(count: int) -> Callable[[Driven, ConformBatch], None]:
        def run(driven: Driven, whole: ConformBatch) -> None:
            for chunk in torch.arange(size).tensor_split(count):
                driven.adapter.backward(driven.step_loss(whole.rows(chunk.tolist()), whole.active))

        return run

    def separate(driven: Driven, whole: ConformBatch) -> None:
        losses = [driven.step_loss(whole.rows([row]), whole.active) for row in range(size)]
        driven.adapter.backward(sum(losses))

    counts = sorted({1, 2, size})
    return {
        **{f"{c} micro-batch{'es' if c > 1 else ''}": micro(c) for c in counts},
        f"{size} separate forward calls, one backward": separate,
    }


def splits(factory: Callable[[], Any], spec: ConformSpec) -> Verdict:
    """One batch, its micro-batches (1, 2, B) accumulated, and separate forward calls: one gradient, the oracle's."""
    driven = started(factory, spec)
    oracle, tol = FP64Oracle(driven.adapter), tolerance(spec.torch_dtype)
    weights, batch = snapshot(driven.module()), make_batch(spec, 0)
    expected = oracle.gradients(weights, [batch.oracle_batch()], batch.active)
    errors = {}
    for arm, run in _arms(batch).items():
        driven.adapter.zero_grad()
        run(driven, batch)
        found = driven.gradients()
        comparison = compare(found, expected, tol)
        if not comparison.ok:
            ratio = _ratio(found.get(comparison.parameter), expected[comparison.parameter])
            return _failed(
                "splits",
                f"as {arm} the gradient of {comparison.parameter} is {ratio:.4g} x the oracle's "
                "(the one-batch gradient)",
                comparison,
                arm=arm,
                ratio=ratio,
            )
        errors[arm] = comparison.error
    driven.adapter.zero_grad()
    return Verdict(
        "splits",
        PASSED,
        f"{len(errors)} splits: worst error {max(errors.values()):.3g} (tolerance {tol:.3g})",
        {"errors": errors},
    )


def _ratio(found: torch.Tensor | None, expected: torch.Tensor) -> float:
    """The least-squares factor ``<found, expected> / <expected, expected>`` of one parameter (the worst element's)."""
    if found is None:
        return 0.0
    return float((found.double() * expected).sum()) / (float((expected * expected).sum()) or 1.0)


def _extra(driven: Driven) -> dict[str, Any]:
    """The adapter's own ``measurements()`` (optional: e.g. snapshot-async's memory cost), for the record."""
    measure = getattr(driven.adapter, "measurements", None)
    return {"adapter_measurements": measure()} if callable(measure) else {}
