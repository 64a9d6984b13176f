"""The trainer and its FP64 oracle, side by side: what they are built from and what judges them.

The building blocks of ``canaries.derivative.oracle_harness`` (NOTE [Derivative
canary] there): the checkpoint name, placements, faults and correction the
canary uses, the tolerances (Rule 5), the deterministic data, a trainer and
its oracle built from a preset, the gradient comparison, and
:class:`Measurements`, what a run checked.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import reference_trainer as rt
from validation.compare import compare_gradients
from validation.errors import CheckFailed
from validation.oracle import OracleTrainer
from validation.trainers import POLICY, trainer_with_policy

from ..presets import Preset

__all__ = [
    "NAME",
    "FAULTS",
    "CORRECTION",
    "LR",
    "CanaryFailure",
    "Tolerances",
    "TOLERANCES",
    "Cell",
    "Measurements",
    "sequences",
    "checkpoint_kinds",
    "build_trainer",
    "judge_gradients",
]

NAME = POLICY
FAULTS = ("user_autograd", "model_backward", "validate", "publish@0", "publish@1", "publish@last")
CORRECTION = rt.ImportanceCorrection(clip_low=0.2, clip_high=3.0, policy="always")
LR = 1e-2  # large steps: a gradient taken at the wrong weights is far outside tolerance


class CanaryFailure(CheckFailed):
    """The trainer disagreed with the oracle; the cause says expected and found, and the ops that led there."""

    def __init__(self, cause: str, *, fix: str = "replay the ops listed in the cause against the trainer") -> None:
        super().__init__(cause, fix=fix)


@dataclass(frozen=True)
class Tolerances:
    """Relative L2 bounds against FP64 (NOTE Rule 5, ``validation.compare`` Rules 4-6).

    Gradients: each threshold is ``max(gradient, baseline_factor x the error
    of plain autograd in the model's dtype)``, capped at ``max_gradient``;
    a parameter's error is relative to at least ``floor`` (1%) of the pooled
    gradient norm, so a gradient that is zero in exact arithmetic and noise
    in FP64 is not judged by its own noise (``validation.compare`` 5-6).
    FP32: plain FP32 is ~1e-7 to 1e-6 off FP64 on the tiny model, so 1e-4
    holds with a wide margin, while a gradient of the wrong weights (one
    step at lr 1e-2), dropout mask or token scale is off by 1e-2 or more.
    After many steps on the same data the predictions sharpen, the
    log-softmax gradient cancels and plain FP32 itself drifts to ~1e-4 (seen
    in nightly runs): the baseline lets the threshold follow, up to 1e-2.
    FP64: the oracle's own precision, so every bound is a few orders above
    FP64 rounding (NOTE [Intersection checks] Rule 3): an FP32 step, norm or
    clip inside an FP64 checkpoint is off by ~1e-7 and fails.
    BF16: the forward rounds at 2^-8; plain BF16 is ~1e-2 to 1e-1 off FP64,
    so BF16 runs catch gross errors only and the FP32 preset is the sharp
    instrument. The optimizer step is judged from identical inputs, so it
    keeps FP32 accuracy (master weights) either way.
    """

    gradient: float
    gradient_global: float
    floor: float
    baseline_factor: float
    max_gradient: float
    logprobs: float
    step: float
    weight_mean: float
    grad_norm: float = 1e-5  # the reported norm of the stepped gradients, relative


TOLERANCES = {
    torch.float32: Tolerances(
        gradient=1e-4,
        gradient_global=1e-4,
        floor=1e-2,
        baseline_factor=4.0,
        max_gradient=1e-2,
        logprobs=1e-5,
        step=1e-4,
        weight_mean=1e-4,
    ),
    torch.bfloat16: Tolerances(
        gradient=5e-2,
        gradient_global=5e-2,
        floor=1e-2,
        baseline_factor=4.0,
        max_gradient=0.5,
        logprobs=1e-2,
        step=1e-3,
        weight_mean=5e-2,
    ),
    torch.float64: Tolerances(
        gradient=1e-9,
        gradient_global=1e-9,
        floor=1e-2,
        baseline_factor=4.0,
        max_gradient=1e-8,
        logprobs=1e-11,
        step=1e-9,
        weight_mean=1e-10,
        grad_norm=1e-12,
    ),
}


def sequences(seed: int, lengths: Sequence[int], vocab: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Deterministic ``(input ids, targets, advantages)`` per length; about 1 in 5 targets masked, never all."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for length in lengths:
        ids = torch.randint(0, vocab, (length,), generator=g)
        targets = torch.randint(0, vocab, (length,), generator=g)
        masked = torch.rand(length, generator=g) < 0.2
        masked[int(torch.randint(0, length, (1,), generator=g))] = False
        targets[masked] = -1
        out.append((ids, targets, torch.randn(length, generator=g)))
    return out


def checkpoint_kinds(config: Preset) -> tuple[str, ...]:
    """The checkpoint kinds a preset exercises: LoRA always, full fine-tuning unless the model is the 8B one."""
    return ("lora",) if config.model.num_hidden_layers > 8 else ("lora", "full")


def build_trainer(config: Preset, kind: str = "lora") -> tuple[rt.Trainer, OracleTrainer]:
    """A trainer with one checkpoint of ``kind`` (``"lora"``: LoRA B moved off zero, so no gradient is
    vacuous; ``"full"``: every weight trainable) and its oracle, on ``config.oracle_model`` (the
    preset's model, or its declared first ``oracle_layers`` layers)."""
    lora = config.lora if kind == "lora" else None
    device = torch.device(config.device)
    optimizer = rt.AdamWConfig(lr=LR)
    # built where it runs: an 8B model is initialised once, on the GPU
    trainer = trainer_with_policy(
        config.oracle_model, lora=lora, optimizer=optimizer, device=device, memory_limit_bytes=config.memory_limit_bytes
    )
    model, checkpoint = trainer.model, trainer.checkpoint(NAME)
    if lora is not None:
        state = checkpoint.state_dict()
        g = torch.Generator().manual_seed(2)
        for name, value in state["parameters"].items():
            if "lora_B" in name:
                value.copy_(torch.randn(value.shape, generator=g) * 0.05)
                if name in state.get("master_parameters", {}):
                    state["master_parameters"][name].copy_(value)
        trainer.load_checkpoint(NAME, state)
    oracle = OracleTrainer(
        config.oracle_model,
        model.state_dict(),
        device=device,
        training=model.training,
        baseline_dtype=config.model.dtype,
    )
    oracle.add_checkpoint(NAME, checkpoint.state_dict(), lora=lora, optimizer=optimizer)
    return trainer, oracle


def judge_gradients(found: dict, reference: dict, baseline: dict, tol: Tolerances, dtypes: dict | None) -> Any:
    """``validation.compare.compare_gradients`` with the canary's tolerances (exact zeros allowed per parameter)."""
    return compare_gradients(
        found,
        reference,
        tolerance=tol.gradient,
        global_tolerance=tol.gradient_global,
        dtypes=dtypes,
        allow_zero=True,
        floor=tol.floor,
        baseline=baseline,
        baseline_factor=tol.baseline_factor,
        max_tolerance=tol.max_gradient,
    )


# (staleness, placement, corrected, checkpoint kind, correction level or None) of a checked record
Cell = tuple[int, str, bool, str, str | None]


@dataclass
class Measurements:
    """What a run checked. ``cells`` counts records whose gradient was judged, per :data:`Cell`."""

    ops: int = 0
    backwards: int = 0
    steps: int = 0
    errors_predicted: int = 0
    stale_records: int = 0
    corrected_records: int = 0
    worst_gradient_error: float = 0.0
    worst_gradient_margin: float = 0.0  # error / its threshold (1 = at the limit)
    worst_logprob_error: float = 0.0
    worst_step_error: float = 0.0
    min_reference_norm: float = math.inf
    cells: Counter[Cell] = field(default_factory=Counter)

    @property
    def records_checked(self) -> int:
        return sum(self.cells.values())

    def merge(self, other: Measurements) -> None:
        for name in ("ops", "backwards", "steps", "errors_predicted", "stale_records", "corrected_records"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("worst_gradient_error", "worst_gradient_margin", "worst_logprob_error", "worst_step_error"):
            setattr(self, name, max(getattr(self, name), getattr(other, name)))
        self.min_reference_norm = min(self.min_reference_norm, other.min_reference_norm)
        self.cells.update(other.cells)
