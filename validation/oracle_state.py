"""What the FP64 oracle keeps and predicts: its records and checkpoints, its reports, the staleness rule.

The data half of ``validation.oracle`` (NOTE [Oracle trainer] there): the
predictions it returns (:class:`OracleBackward`, :class:`OracleStep`,
:class:`OracleRecordReport`, :class:`OracleState`), its bookkeeping per
checkpoint and per forward, and :func:`check_oracle_age`, the documented
staleness rule (docs/semantics.md#staleness) stated independently of the
trainer's code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from reference_trainer import CheckpointReplacedError, ImportanceCorrection, LoRAConfig, StaleGradientError

__all__ = [
    "OracleState",
    "OracleRecordReport",
    "OracleBackward",
    "OracleStep",
    "OracleCheckpoint",
    "OracleRecord",
    "check_oracle_age",
]


@dataclass(frozen=True)
class OracleState:
    """What :meth:`OracleTrainer.save` returns: weights, masters, AdamW state, revision (FP64)."""

    weights: dict[str, torch.Tensor]
    masters: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    revision: int


@dataclass(frozen=True)
class OracleRecordReport:
    """The oracle's prediction for one record consumed by a successful backward."""

    record: int
    staleness: int
    corrected: bool
    weight_mean: float | None
    tokens: int | None


@dataclass(frozen=True)
class OracleBackward:
    """A successful backward: the FP64 gradient it adds (by checkpoint, then parameter) and its records."""

    increments: dict[str, dict[str, torch.Tensor]]
    records: list[OracleRecordReport]
    baselines: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # plain, in baseline_dtype


@dataclass(frozen=True)
class OracleStep:
    """One checkpoint's optimizer step: stepped or not, the norm of the gradients it started from,
    clipping, the new master weights."""

    stepped: bool
    reason: str | None
    grad_norm: float | None
    clipped: bool
    masters: dict[str, torch.Tensor]


@dataclass
class OracleCheckpoint:
    """One checkpoint as the oracle keeps it: FP64 weights of every version seen, gradients, origins."""

    name: str
    lora: LoRAConfig | None
    dtype: torch.dtype  # of the live parameters
    weights: dict[str, torch.Tensor]  # FP64 values of the live parameters now
    masters: dict[str, torch.Tensor]  # FP64 leaves that AdamW steps
    optimizer: torch.optim.AdamW
    generation: int = 0
    revision: int = 0
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # accumulated; absent = no gradient
    baseline_grads: dict[str, torch.Tensor] = field(default_factory=dict)  # the same, plain in baseline_dtype
    origins: set[tuple[int, int, int]] = field(default_factory=set)  # (generation, revision, bound)
    snapshots: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)

    def snapshot(self) -> None:
        self.snapshots[(self.generation, self.revision)] = {n: w.clone() for n, w in self.weights.items()}


@dataclass
class OracleRecord:
    """One forward as the oracle keeps it: its inputs, version, bound, correction and RNG state."""

    id: int
    checkpoint: str
    generation: int
    revision: int
    bound: int
    correction: ImportanceCorrection | None
    ids: torch.Tensor  # (B, T) right-padded
    mask: torch.Tensor | None
    targets: torch.Tensor  # (B, T), -1 on pads
    lengths: list[int]
    rng_state: torch.Tensor
    cuda_rng_state: torch.Tensor | None
    live_outputs: int
    released: bool = False


def check_oracle_age(ckpt: OracleCheckpoint, generation: int, revision: int, bound: int) -> None:
    """The documented staleness rule (docs/semantics.md#staleness), stated independently of the trainer's code."""
    if generation != ckpt.generation:
        raise CheckpointReplacedError(ckpt.name, generation, ckpt.generation)
    age = ckpt.revision - revision
    if not 0 <= age <= bound:
        raise StaleGradientError(ckpt.name, age, bound, revision, ckpt.revision)
