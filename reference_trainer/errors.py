"""The one exception hierarchy of the reference trainer.

Every public error subclasses :class:`TrainerError`. Messages say what was
expected, what was found and what to do; the facts a program needs are also
attributes, so callers never parse messages.
"""

from __future__ import annotations

from typing import TypeGuard

__all__ = [
    "int_at_least",
    "is_number",
    "TrainerError",
    "ConfigError",
    "CheckpointBusyError",
    "GradientCommitError",
    "StaleGradientError",
    "CheckpointReplacedError",
    "MemoryAdmissionError",
    "UnsupportedSavedStateError",
    "CorruptSaveError",
    "SaveInForceError",
    "PeerError",
    "PublicationError",
    "VersionConflictError",
    "EngineBusyError",
]


class TrainerError(Exception):
    """Base of every error the trainer raises on purpose."""


class ConfigError(TrainerError, ValueError):
    """A configuration or argument is invalid.

    Raised at construction (options, configs) or at the call that received the
    bad value; nothing has changed. Fix the named field and retry.
    """

    def __init__(self, field: str, value: object, allowed: str, hint: str = "") -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        message = f"{field}: expected {allowed}, found {value!r}"
        super().__init__(message + (f"; {hint}" if hint else ""))


class CheckpointBusyError(TrainerError):
    """A checkpoint cannot be loaded over while graphs or gradients are pending.

    Backpropagate or drop the pending outputs and call ``zero_grad()`` first, or
    pass ``discard_graphs=True`` to drop them.
    """

    def __init__(self, checkpoint: str, live_graphs: int, pending_gradients: int) -> None:
        self.checkpoint = checkpoint
        self.live_graphs = live_graphs
        self.pending_gradients = pending_gradients
        super().__init__(
            f"checkpoint {checkpoint!r}: expected no live graphs and no pending gradients "
            f"before load_checkpoint, found {live_graphs} live graph(s) and "
            f"{pending_gradients} parameter(s) with gradients; finish or drop them and "
            "call zero_grad(), or pass discard_graphs=True"
        )


class GradientCommitError(TrainerError):
    """A backward or optimizer step committed nothing.

    Every existing ``.grad`` value and object is untouched and staging is freed.
    A record that failed before its model backward ran may be backpropagated
    again (``record_retryable`` is True); otherwise it was released.
    """

    def __init__(self, message: str, *, record_retryable: bool = False) -> None:
        self.record_retryable = record_retryable
        super().__init__(message)


class StaleGradientError(GradientCommitError):
    """A forward is older than its ``max_gradient_staleness`` allows."""

    def __init__(
        self,
        checkpoint: str,
        staleness: int,
        bound: int,
        forward_revision: int,
        current_revision: int,
    ) -> None:
        self.checkpoint = checkpoint
        self.staleness = staleness
        self.bound = bound
        self.forward_revision = forward_revision
        self.current_revision = current_revision
        super().__init__(
            f"checkpoint {checkpoint!r}: gradient staleness {staleness} exceeds "
            f"max_gradient_staleness={bound} (forward revision {forward_revision}, "
            f"current revision {current_revision}); expected 0 <= staleness <= {bound}. "
            "Run backward sooner, raise max_gradient_staleness, or forward again"
        )


class CheckpointReplacedError(GradientCommitError):
    """The checkpoint was loaded over (new generation) after the forward.

    ``by``: what replaced it, when not ``load_checkpoint`` (``"Trainer.load"``:
    the forward belongs to a trainer whose state a loaded trainer resumed; the
    generations may then be equal).
    """

    def __init__(self, checkpoint: str, forward_generation: int, current_generation: int, *, by: str = "") -> None:
        self.checkpoint = checkpoint
        self.forward_generation = forward_generation
        self.current_generation = current_generation
        self.by = by
        super().__init__(
            f"checkpoint {checkpoint!r} was replaced {f'by {by} ' if by else ''}after the forward: expected "
            f"generation {forward_generation}, found {current_generation}; "
            "forward again on the loaded checkpoint"
        )


class MemoryAdmissionError(TrainerError):
    """No placement of a forward fits the memory limit; nothing was allocated."""

    def __init__(self, predicted_peak_bytes: int, limit_bytes: int, suggestion: str) -> None:
        self.predicted_peak_bytes = predicted_peak_bytes
        self.limit_bytes = limit_bytes
        self.suggestion = suggestion
        super().__init__(
            f"predicted peak {predicted_peak_bytes} bytes exceeds the memory limit of {limit_bytes} bytes; {suggestion}"
        )


class UnsupportedSavedStateError(TrainerError):
    """Saved state cannot be kept or restored exactly (quantized / float8)."""


class CorruptSaveError(TrainerError):
    """A save folder's file is missing, truncated or changed since ``trainer.save`` wrote it.

    ``path``: the save folder; ``file``: the file, relative to it; ``problem``:
    ``"missing"``, ``"truncated"`` or ``"changed"`` (a file that is not a
    regular one, a symbolic link or a FIFO, and a manifest entry that is not a
    plain name inside the save, are ``"changed"``). Nothing was loaded:
    restore the folder from a copy, or load an earlier save.
    """

    def __init__(self, path: object, file: str, problem: str, expected: str, found: str) -> None:
        self.path = str(path)
        self.file = file
        self.problem = problem
        super().__init__(
            f"save {self.path}: file {file!r} is {problem}: expected {expected}, found {found}; "
            "nothing was loaded. Restore the folder from a copy or load another save"
        )


class SaveInForceError(TrainerError):
    """A save failed after its new save came into force: ``LATEST`` names it, and a load reads it.

    ``path``: the save path; ``save``: the save folder now in force (relative
    to ``path``); ``step``: what failed after ``LATEST`` moved (making the
    move durable, or removing older saves and leftovers); the original error
    is the ``__cause__``. The state is saved: nothing needs saving again.
    Older saves may remain until the next save removes them. Any other error
    a save raises means the new save is not in force and nothing it wrote
    remains.
    """

    def __init__(self, path: object, save: str, step: str, cause: str) -> None:
        self.path = str(path)
        self.save = save
        self.step = step
        super().__init__(
            f"save {self.path}: the new save {save!r} is in force (LATEST names it), but {step} failed: {cause}; "
            "the state is saved; fix the cause (the next save removes what was left)"
        )


class PeerError(TrainerError):
    """Another process or logical rank did not take part in a collective step.

    It died, hung past the timeout, made different calls (logical ranks must
    call ``reduce`` and ``backward`` the same number of times, in the same
    order), or failed while this one waited. ``command`` names the step and
    ``peer`` the physical rank (``None`` when unknown). After a dead or silent
    peer the process group is unusable: read that peer's log and restart.
    """

    def __init__(self, message: str, *, command: str, peer: int | None = None) -> None:
        self.command = command
        self.peer = peer
        super().__init__(message)


class PublicationError(TrainerError):
    """A weight publication failed; the engine serves the weights and version it served before, bitwise.

    ``version``: the publication's; ``tensor``: the name of the tensor that
    failed (``None`` when the whole publication was refused). Fix the cause
    and publish again (NOTE [Weight publication] in ``rollout/publication.py``).
    """

    def __init__(self, message: str, *, version: object, tensor: str | None = None) -> None:
        self.version = version
        self.tensor = tensor
        super().__init__(message)


class VersionConflictError(PublicationError):
    """A publication's compare-and-set failed: the live version is not the expected one, or not older.

    ``live``: the version the engine serves (or has pending). Publish a newer
    version, or read ``engine.version`` and pass it as ``expected``.
    """

    def __init__(self, message: str, *, version: object, live: object) -> None:
        self.live = live
        super().__init__(message, version=version)


class EngineBusyError(TrainerError):
    """The engine cannot start a generation now: nothing is published yet, or a drained publication waits.

    Publish a version first, or finish the running generations (the drained
    version is then served).
    """


def int_at_least(value: object, minimum: int) -> TypeGuard[int]:
    """True iff ``value`` is an int, not a bool (``True`` is an ``int`` in Python), and ``>= minimum``.

    The one check behind every integer argument; each caller raises its own
    :class:`ConfigError` naming the field and what it allows.
    """
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def is_number(value: object) -> TypeGuard[int | float]:
    """True iff ``value`` is an int or a float, not a bool (callers may then use it as a number)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
