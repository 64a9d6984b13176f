"""Transactional gradient commit: all or nothing.

NOTE [Gradient commit]
  1. Stage: each record's model backward returns gradients for its capture's
     leaves; they are summed per target parameter in record order, in the
     parameter's dtype. Nothing visible changes while staging.
  2. Validate all: every origin's age and generation (NOTE [Staleness] in
     ``staleness.py``), target identity (the parameter is still the
     checkpoint's), shape, dtype, device, finiteness (one fused norm per
     checkpoint, NOTE [Gradient norm] in ``grad_norms.py``). One failure fails all.
  3. Publish: build every new gradient (existing + staged, out of place) first
     and check the sums are still finite, then assign them in a fixed order. If an assignment fails, the ones
     already made are put back to the previous tensor objects.
  4. On any failure, staging is freed and the error is raised as a
     ``GradientCommitError``; existing gradients keep their values and objects.
  5. Where gradients go is a *sink* (``sinks.py``): the live ``.grad`` fields
     by default, or a logical rank's own buffer (contract §8), so staging is
     written once.
  6. With peers (logical ranks on several processes), a coordinator agrees
     once per backward: after local publication on success, or with the error
     on failure. A peer's failure rolls the local publication back, so every
     rank commits or none does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from . import testing
from .checkpoints import Checkpoint, CheckpointVersion, WeightCapture
from .errors import GradientCommitError
from .grad_norms import KnownNorm, total_norm
from .graphs import ForwardRecord
from .host_reads import read_on_host
from .sinks import GradientSink
from .staleness import check_age

__all__ = ["Coordinator", "GradientTransaction", "all_finite", "first_non_finite", "staged_norms"]


class Coordinator(Protocol):
    """Agreement across ranks: every rank commits a backward or none does."""

    def agree(self, error: BaseException | None) -> None:
        """Share this rank's outcome; raise the common error if any rank failed."""
        ...


@dataclass
class _Staged:
    checkpoint: Checkpoint
    name: str
    target: nn.Parameter
    value: torch.Tensor


def all_finite(value: torch.Tensor) -> bool:
    """True iff every element is finite.

    A finite sum proves it (NaN and infinities propagate through a sum) at a
    fraction of the cost of an elementwise check, which runs only when the
    sum is not finite (it may overflow while every element is finite).
    """
    return bool(torch.isfinite(value.sum())) or bool(torch.isfinite(value).all())


@dataclass(frozen=True)
class _Norms:
    """Each checkpoint's staged-gradient norm: the device tensor, and its value read on the host."""

    tensors: dict[str, torch.Tensor]
    values: dict[str, float]


def staged_norms(staged: Mapping[tuple[str, str], _Staged]) -> _Norms:
    """One fused norm per checkpoint over its staged gradients, in staging order, read on the host at once.

    That read is the backward's one host read (NOTE [Host syncs]; NOTE [Gradient norm] Rule 1).
    """
    values: dict[str, list[torch.Tensor]] = {}
    for (checkpoint_name, _), s in staged.items():
        values.setdefault(checkpoint_name, []).append(s.value)
    tensors = {name: total_norm(grads) for name, grads in values.items()}
    if not tensors:
        return _Norms({}, {})
    first = next(iter(tensors.values()))
    # FP64 holds every norm's value exactly, whatever its dtype (KnownNorm.tensor restores it).
    together = torch.stack([t.to(device=first.device, dtype=torch.float64) for t in tensors.values()])
    read = read_on_host(together, "finite gradients")
    return _Norms(tensors, dict(zip(tensors, read)))


def first_non_finite(staged: Mapping[tuple[str, str], _Staged], norms: _Norms) -> tuple[str, str] | None:
    """The first staged key holding a non-finite element, or None.

    Finite ``norms`` prove every gradient finite; only when one is not
    finite (a non-finite element, or squares that overflow while every
    element is finite) is each gradient checked exactly, in staging order.
    """
    if all(math.isfinite(v) for v in norms.values.values()):
        return None
    return next((key for key, s in staged.items() if not bool(torch.isfinite(s.value).all())), None)


class GradientTransaction:
    """One backward's commit: stage → validate → publish, or abort (NOTE [Gradient commit]).

    It owns the records whose model backward it started (:meth:`start`):
    :meth:`abort` frees the staging, releases exactly those (the others stay
    retryable, NOTE [Forward records]) and, with peers, agrees on the failure.
    """

    def __init__(
        self,
        sink: GradientSink,
        checkpoints: Callable[[str], Checkpoint],
        release: Callable[[ForwardRecord], None],
        coordinator: Coordinator | None = None,
    ) -> None:
        self._sink = sink
        self._checkpoints = checkpoints
        self._release = release
        self._coordinator = coordinator
        self._started: list[ForwardRecord] = []
        self._agreed = False
        self._staged: dict[tuple[str, str], _Staged] = {}
        self._origins: dict[str, set[tuple[CheckpointVersion, int]]] = {}
        self._norms: _Norms | None = None  # set by validate

    @property
    def staged_nbytes(self) -> int:
        return sum(s.value.numel() * s.value.element_size() for s in self._staged.values())

    def start(self, record: ForwardRecord) -> None:
        """``record``'s model backward is about to run: a failure from now on releases it."""
        self._started.append(record)

    def stage(self, capture: WeightCapture, grads: dict[str, torch.Tensor], bound: int) -> None:
        """Add one record's gradients (Rule 1)."""
        checkpoint = self._checkpoints(capture.version.name)
        for name, grad in grads.items():
            key = (checkpoint.name, name)
            staged = self._staged.get(key)
            if staged is None:
                self._staged[key] = _Staged(checkpoint, name, capture.targets[name], grad)
            else:
                staged.value = staged.value + grad
        self._origins.setdefault(checkpoint.name, set()).add((capture.version, bound))

    def validate(self) -> None:
        """Check everything before anything is written (Rule 2)."""
        testing.maybe_fail("validate")
        for name, origins in self._origins.items():
            checkpoint = self._checkpoints(name)
            for version, bound in sorted(origins, key=lambda o: o[0].revision):
                check_age(checkpoint, version, bound)
        for (ckpt_name, name), staged in self._staged.items():
            live = staged.checkpoint.parameter(name)
            where = f"checkpoint {ckpt_name!r} parameter {name!r}"
            if live is not staged.target or self._checkpoints(ckpt_name) is not staged.checkpoint:
                raise GradientCommitError(
                    f"{where}: gradient target was replaced after the forward; expected the "
                    "same parameter object, found a different one. Forward again."
                )
            value = staged.value
            for what, found, expected in (
                ("shape", tuple(value.shape), tuple(live.shape)),
                ("dtype", value.dtype, live.dtype),
                ("device", value.device, live.device),
            ):
                if found != expected:
                    raise GradientCommitError(f"{where}: gradient {what} expected {expected}, found {found}")
        self._norms = staged_norms(self._staged)
        bad = first_non_finite(self._staged, self._norms)
        if bad is not None:
            raise GradientCommitError(
                f"checkpoint {bad[0]!r} parameter {bad[1]!r}: expected a finite gradient, found non-finite "
                "values; check the loss and its cotangents (nothing was committed)"
            )

    def commit(self) -> None:
        """Validate everything, then publish everything (Rules 2-3, 6)."""
        self.validate()
        self.publish()

    def publish(self) -> None:
        """Assign every new gradient or none (Rule 3), then agree with the peers (Rule 6).

        If the agreement raises (a peer failed), every assignment is rolled back.
        """
        plan = []
        for staged in self._staged.values():
            old = self._sink.current(staged.checkpoint, staged.name)
            new = staged.value if old is None else old + staged.value
            if old is not None and not all_finite(new):
                raise GradientCommitError(
                    f"checkpoint {staged.checkpoint.name!r} parameter {staged.name!r}: the accumulated "
                    "gradient overflows to non-finite values; expected a finite sum. Step or zero_grad "
                    "before accumulating more (nothing was committed)"
                )
            plan.append((staged, old, new))
        done: list[tuple[_Staged, torch.Tensor | None]] = []
        try:
            for index, (staged, old, new) in enumerate(plan):
                testing.maybe_fail("publish", index)
                self._sink.assign(staged.checkpoint, staged.name, new)
                done.append((staged, old))
            self.agree(None)
        except BaseException:
            for staged, old in reversed(done):
                self._sink.assign(staged.checkpoint, staged.name, old)
            raise
        for name, origins in self._origins.items():
            self._sink.record_origins(self._checkpoints(name), origins)
        self._record_norms(plan)
        self.discard()

    def _record_norms(self, plan: list[tuple[_Staged, torch.Tensor | None, torch.Tensor]]) -> None:
        """Tell the sink each checkpoint's norm where its new gradients are exactly the staged ones (NOTE [Gradient norm])."""
        published: dict[str, list[torch.Tensor]] = {}
        accumulated: set[str] = set()
        for staged, old, new in plan:
            published.setdefault(staged.checkpoint.name, []).append(new)
            if old is not None:
                accumulated.add(staged.checkpoint.name)
        norms = self._norms
        for name, grads in published.items():
            if norms is not None and name not in accumulated and name in norms.values:
                known = KnownNorm(grads, norms.values[name], like=norms.tensors[name])
                self._sink.record_norm(self._checkpoints(name), known)

    def agree(self, error: BaseException | None) -> None:
        """Tell the peers this rank's outcome, once (Rule 6); raises the common error if any failed."""
        if self._agreed or self._coordinator is None:
            return
        self._agreed = True
        self._coordinator.agree(error)

    def abort(self, error: BaseException) -> None:
        """Free staging, release the records started, agree on ``error`` if not yet agreed (Rule 4)."""
        self.discard()
        for record in self._started:
            self._release(record)
        self._started.clear()
        self.agree(error)

    def discard(self) -> None:
        """Free staging (Rule 4)."""
        self._staged.clear()
        self._origins.clear()
        self._norms = None
