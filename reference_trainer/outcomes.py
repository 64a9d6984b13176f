"""What the trainer's calls report: ``optim_step`` per checkpoint, ``backward`` per record it consumed."""

from __future__ import annotations

from dataclasses import dataclass, field

from .behaviour import BehaviourStats
from .checkpoints import CheckpointStep, CheckpointVersion
from .importance import CorrectionStats

__all__ = ["StepReport", "RecordReport", "BackwardReport"]


@dataclass(frozen=True, kw_only=True)
class StepReport:
    """Per-checkpoint outcome of ``optim_step``; index by checkpoint name."""

    checkpoints: dict[str, CheckpointStep]

    def __getitem__(self, name: str) -> CheckpointStep:
        return self.checkpoints[name]


@dataclass(frozen=True, kw_only=True)
class RecordReport:
    """One record a backward consumed: its version, age (the trainer lag), placement (now), any correction, and
    its behaviour tokens' lag, masking and ratio (``None`` when its inputs carry none, NOTE [Behaviour tokens])."""

    record_id: int
    version: CheckpointVersion
    staleness: int
    placement: str
    correction: CorrectionStats | None
    behaviour: BehaviourStats | None = None


@dataclass(frozen=True, kw_only=True)
class BackwardReport:
    """Which records a backward consumed, their ages and any correction applied."""

    records: list[RecordReport] = field(default_factory=list)

    @property
    def corrected(self) -> list[RecordReport]:
        return [r for r in self.records if r.correction is not None]
