"""Transactional gradient commit: all or nothing.

NOTE [Gradient commit]
  1. Stage: each record's model backward returns gradients for its capture's
     leaves; they are summed per target parameter in record order, in the
     parameter's dtype. Nothing visible changes while staging.
  2. Validate all: every origin's age and generation (NOTE [Staleness] in
     ``staleness.py``), target identity (the parameter is still the
     checkpoint's), shape, dtype, device; then every new gradient is built
     (existing + staged, out of place) and proven finite, staged values and
     sums alike, by one fused norm per checkpoint read in one host read
     (NOTE [Gradient norm] in ``grad_norms.py``). One failure fails all.
  3. Publish: assign the new gradients in a fixed order. If an assignment
     fails, the ones already made are put back to the previous tensor objects.
  4. On any failure, staging is freed and the error is raised as a
     ``GradientCommitError``; existing gradients keep their values and objects.
  5. Where gradients go is a *sink* (``sinks.py``): the live ``.grad`` fields
     by default, or a logical rank's own buffer (NOTE [Logical ranks] Rule 5), so staging is
     written once. A sink that ``takes_ownership`` (a logical rank's, which folds
     what it gets) keeps the only reference: once published, the transaction
     drops its own before it agrees, so a gradient is never held twice.
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

from . import seams
from .checkpoints import Checkpoint, CheckpointVersion, WeightCapture
from .errors import GradientCommitError
from .grad_norms import KnownNorm, total_norm
from .host_reads import read_on_host
from .records import ForwardRecord
from .sinks import GradientSink
from .staleness import check_each

__all__ = ["Coordinator", "GradientTransaction", "first_non_finite", "staged_norms"]


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
    value: torch.Tensor | None  # None once a sink took ownership (Rule 5)
    old: torch.Tensor | None = None  # set by validate: the sink's gradient the value adds to
    new: torch.Tensor | None = None  # set by validate: what publish assigns (old + value, or value)

    def staged_value(self) -> torch.Tensor:
        """The staged gradient, while this transaction still owns it (Rule 5)."""
        assert self.value is not None, f"{self.name}: the staged gradient was handed to a sink"
        return self.value

    def new_value(self) -> torch.Tensor:
        """What publish assigns, once validate computed it."""
        assert self.new is not None, f"{self.name}: validate has not computed the new gradient"
        return self.new


@dataclass(frozen=True)
class _Norms:
    """Each checkpoint's norm of its new gradients, read on the host, with the norm tensor's dtype and device."""

    values: dict[str, float]
    kinds: dict[str, tuple[torch.dtype, torch.device]]


def staged_norms(staged: Mapping[tuple[str, str], _Staged]) -> _Norms:
    """One fused norm per checkpoint over its new gradients, in staging order, read on the host at once.

    That read is the backward's one host read (NOTE [Host syncs]; NOTE [Gradient norm] Rule 1).
    """
    news: dict[str, list[torch.Tensor]] = {}
    for (checkpoint_name, _), s in staged.items():
        news.setdefault(checkpoint_name, []).append(s.new_value())
    tensors = {name: total_norm(grads) for name, grads in news.items()}
    if not tensors:
        return _Norms({}, {})
    first = next(iter(tensors.values()))
    # FP64 holds every norm's value exactly, whatever its dtype (KnownNorm.tensor restores it).
    read = read_on_host(torch.stack([t.to(first.device, torch.float64) for t in tensors.values()]), "finite gradients")
    return _Norms(dict(zip(tensors, read)), {name: (t.dtype, t.device) for name, t in tensors.items()})


def first_non_finite(staged: Mapping[tuple[str, str], _Staged], norms: _Norms) -> tuple[tuple[str, str], str] | None:
    """The first staged key whose gradient is not finite, with what is wrong; or None.

    Finite ``norms`` prove every new gradient finite. Only when one is not
    (a non-finite element, or squares that overflow while every element is
    finite) is each checked exactly, in staging order: a non-finite staged
    gradient first, then a sum that overflowed.
    """
    if all(math.isfinite(v) for v in norms.values.values()):
        return None
    for key, s in staged.items():
        if not bool(torch.isfinite(s.staged_value()).all()):
            return key, (
                "expected a finite gradient, found non-finite values; check the loss and its "
                "cotangents (nothing was committed)"
            )
    for key, s in staged.items():
        if s.old is not None and not bool(torch.isfinite(s.new_value()).all()):
            return key, (
                "the accumulated gradient overflows to non-finite values; expected a finite sum. "
                "Step or zero_grad before accumulating more (nothing was committed)"
            )
    return None


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
                staged.value = staged.staged_value() + grad
        self._origins.setdefault(checkpoint.name, set()).add((capture.version, bound))

    def validate(self) -> None:
        """Check everything before anything is written (Rule 2)."""
        seams.maybe_fail("validate")
        for name, origins in self._origins.items():
            check_each(self._checkpoints(name), origins)
        for (ckpt_name, name), staged in self._staged.items():
            live = staged.checkpoint.parameter(name)
            where = f"checkpoint {ckpt_name!r} parameter {name!r}"
            if live is not staged.target or self._checkpoints(ckpt_name) is not staged.checkpoint:
                raise GradientCommitError(
                    f"{where}: gradient target was replaced after the forward; expected the "
                    "same parameter object, found a different one. Forward again."
                )
            value = staged.staged_value()
            for what, found, expected in (
                ("shape", tuple(value.shape), tuple(live.shape)),
                ("dtype", value.dtype, live.dtype),
                ("device", value.device, live.device),
            ):
                if found != expected:
                    raise GradientCommitError(f"{where}: gradient {what} expected {expected}, found {found}")
        for staged in self._staged.values():
            staged.old = self._sink.current(staged.checkpoint, staged.name)
            value = staged.staged_value()
            staged.new = value if staged.old is None else staged.old + value
        self._norms = staged_norms(self._staged)
        bad = first_non_finite(self._staged, self._norms)
        if bad is not None:
            (ckpt_name, name), problem = bad
            raise GradientCommitError(f"checkpoint {ckpt_name!r} parameter {name!r}: {problem}")

    def commit(self) -> None:
        """Validate everything, then publish everything (Rules 2-3, 6)."""
        self.validate()
        self.publish()

    def publish(self) -> None:
        """Assign every new gradient or none (Rule 3), then agree with the peers (Rule 6).

        If the agreement raises (a peer failed), every assignment is rolled back.
        """
        done: list[tuple[_Staged, torch.Tensor | None]] = []
        try:
            for index, staged in enumerate(self._staged.values()):
                seams.maybe_fail("publish", index)
                self._sink.assign(staged.checkpoint, staged.name, staged.new)
                done.append((staged, staged.old))
            if self._sink.takes_ownership:  # Rule 5: a folding sink holds the only reference while peers agree
                self._norms = None
                for staged in self._staged.values():
                    staged.value = staged.new = None
            self.agree(None)
        except BaseException:
            self._rollback(done)
            raise
        for name, origins in self._origins.items():
            self._sink.record_origins(self._checkpoints(name), origins)
        self._record_norms()
        self.discard()

    def _rollback(self, done: list[tuple[_Staged, torch.Tensor | None]]) -> None:
        """Put back what each assignment in ``done`` replaced, latest first (Rule 3)."""
        for staged, old in reversed(done):
            self._sink.assign(staged.checkpoint, staged.name, old)

    def _record_norms(self) -> None:
        """Tell the sink each checkpoint's norm: its new gradients are the tensors measured (NOTE [Gradient norm])."""
        if self._norms is None:
            return
        published: dict[str, list[torch.Tensor]] = {}
        for staged in self._staged.values():
            published.setdefault(staged.checkpoint.name, []).append(staged.new_value())
        for name, grads in published.items():
            known = KnownNorm(grads, self._norms.values[name], *self._norms.kinds[name])
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
