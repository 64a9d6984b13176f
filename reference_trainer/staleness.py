"""The staleness rule, written once.

NOTE [Staleness]
  1. staleness = current revision - forward revision, where the forward
     revision is the one whose weights the forward used (replay never resets it).
  2. A gradient is valid iff 0 <= staleness <= max_gradient_staleness (the
     bound resolved when the forward was submitted). 0 is strict: any
     optimizer step between forward and backward rejects it.
  3. A different generation means the checkpoint was loaded over since the
     forward: ``CheckpointReplacedError``, whatever the revisions.
  4. The rule is checked when gradients are staged, again for the whole batch
     before publication, and again by ``optim_step`` for every accumulated
     origin before anything changes. A violation changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from .checkpoints import Checkpoint, CheckpointVersion
from .errors import CheckpointReplacedError, StaleGradientError

__all__ = ["check_age", "check_each", "check_origins", "staleness"]


def staleness(checkpoint: Checkpoint, version: CheckpointVersion) -> int:
    """Rule 1."""
    return checkpoint.revision - version.revision


def check_age(checkpoint: Checkpoint, version: CheckpointVersion, bound: int) -> None:
    """Raise unless a gradient of ``version`` may still be applied to ``checkpoint`` (Rules 2-3)."""
    if version.generation != checkpoint.generation:
        raise CheckpointReplacedError(checkpoint.name, version.generation, checkpoint.generation)
    age = staleness(checkpoint, version)
    if not 0 <= age <= bound:
        raise StaleGradientError(checkpoint.name, age, bound, version.revision, checkpoint.revision)


def check_each(checkpoint: Checkpoint, origins: Iterable[tuple[CheckpointVersion, int]]) -> None:
    """Rule 4: ``check_age`` for every ``(forward version, bound)`` origin, oldest first (the first violation raises)."""
    for version, bound in sorted(origins, key=lambda o: o[0].revision):
        check_age(checkpoint, version, bound)


def check_origins(checkpoint: Checkpoint) -> None:
    """Rule 4 for ``optim_step``: every committed gradient's origin."""
    check_each(checkpoint, checkpoint.origins)
