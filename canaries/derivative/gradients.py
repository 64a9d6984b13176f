"""The derivative canary's intersection checks of committed gradients (bugs an earlier suite let through).

Three places where a gradient the trainer already holds meets a later call;
each check is cheap, deterministic and judged against an independent twin
(NOTE [Gradient intersections]). :data:`GRADIENT_INTERSECTIONS` maps a check
name to a function of the preset; ``canaries.derivative.canary`` runs them with the
other intersection checks (NOTE [Derivative canary] Rule 10).

NOTE [Gradient intersections]
  1. Flush onto a live ``.grad``: a committed ``.grad`` and two logical
     ranks' buffers, then ``optim_step(lr=0)``: every ``.grad`` is the sum of
     the three backwards, as a twin trainer that backpropagates the same
     three losses with ``trainer.backward`` holds it (relative L2 1e-5: only
     the order of the sums differs).
  2. A ``.grad`` dropped after its backward (``p.grad = None`` on the last
     parameter): the step's reported norm is the norm of the gradients that
     are left, computed here with ``torch.linalg.vector_norm`` (relative
     1e-5), not the norm the backward remembered.
  3. The busy check is per checkpoint: while ``policy`` has a pending record,
     ``load_checkpoint("ref", ...)`` of another checkpoint succeeds and the
     pending record stays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import reference_trainer as rt
from reference_trainer.ranks import run_logical
from validation.trainers import trainer_with_policy

from ..presets import Preset
from .oracle_pair import CanaryFailure, sequences

__all__ = ["check_flush_adds", "check_dropped_grad_norm", "check_busy_per_checkpoint", "GRADIENT_INTERSECTIONS"]

_VOCAB = rt.ModelConfig.tiny().vocab_size


def _trainer() -> rt.Trainer:
    """A tiny FP32 full checkpoint without dropout: the twins' forwards are the same function."""
    return trainer_with_policy(rt.ModelConfig.tiny(dropout=0.0), optimizer=rt.AdamWConfig(lr=1e-2))


def _loss(trainer: Any, seed: int, length: int) -> torch.Tensor:
    ((ids, targets, _),) = sequences(seed, [length], _VOCAB)
    return -trainer.forward(rt.ForwardInput(ids, targets)).target_logprobs.sum()


def _grads(trainer: rt.Trainer) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.detach().clone() for n, p in trainer.checkpoint("policy").named_parameters() if p.grad is not None
    }


def _relative(found: torch.Tensor, expected: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(found - expected) / torch.linalg.vector_norm(expected))


def check_flush_adds(config: Preset) -> float:
    """Rule 1; the relative L2 of the flushed ``.grad`` against the twin's."""
    trainer, twin = _trainer(), _trainer()
    trainer.backward(_loss(trainer, 800, 6))
    run_logical(lambda view: view.backward(_loss(view, 801 + view.logical_rank, 5)), trainer, logical_dp=2)
    trainer.optim_step(lr=0.0)
    for seed, length in ((800, 6), (801, 5), (802, 5)):
        twin.backward(_loss(twin, seed, length))
    found, expected = _grads(trainer), _grads(twin)
    if found.keys() != expected.keys():
        raise CanaryFailure(
            f"flush onto a live .grad: expected .grad on {len(expected)} parameters, found {len(found)}"
        )
    error = _relative(
        torch.cat([g.flatten() for g in found.values()]), torch.cat([g.flatten() for g in expected.values()])
    )
    if error > 1e-5:
        raise CanaryFailure(
            f"flush onto a live .grad: expected the committed .grad plus both logical ranks' buffers "
            f"(the twin's sum), found relative L2 {error:.3e} from it (threshold 1e-5)"
        )
    return error


def check_dropped_grad_norm(config: Preset) -> float:
    """Rule 2; the norm's relative error."""
    trainer = _trainer()
    trainer.backward(_loss(trainer, 810, 7))
    params = list(trainer.checkpoint("policy").parameters())
    params[-1].grad = None
    expected = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params[:-1]])))
    reported = trainer.optim_step(lr=0.0)["policy"].grad_norm
    error = abs(reported - expected) / expected
    if error > 1e-5:
        raise CanaryFailure(
            f"optim_step after .grad = None on the last parameter: grad norm: expected the norm of "
            f"the {len(params) - 1} gradients left, {expected!r}, found {reported!r}"
        )
    return error


def check_busy_per_checkpoint(config: Preset) -> int:
    """Rule 3; the pending records after the load."""
    trainer = _trainer()
    trainer.add_checkpoint("ref", full=True, seed=2)
    ((ids, targets, _),) = sequences(820, [5], _VOCAB)
    pending = trainer.forward(rt.ForwardInput(ids, targets), checkpoint="policy")
    try:
        trainer.load_checkpoint("ref", trainer.checkpoint("ref").state_dict())
    except rt.CheckpointBusyError as error:
        raise CanaryFailure(
            f"load_checkpoint('ref') while only 'policy' has a pending record: expected success, "
            f"found CheckpointBusyError: {error}"
        ) from None
    if trainer.live_records("policy") != 1:
        raise CanaryFailure(
            f"load_checkpoint('ref'): expected policy's pending record kept, found "
            f"{trainer.live_records('policy')} pending"
        )
    del pending
    return 1


GRADIENT_INTERSECTIONS: dict[str, Callable[[Preset], Any]] = {
    "intersection: logical-rank buffers flushed onto a live .grad add to it": check_flush_adds,
    "intersection: a .grad dropped after its backward is left out of the step's norm": check_dropped_grad_norm,
    "intersection: load_checkpoint of one checkpoint while another has a pending record succeeds": check_busy_per_checkpoint,
}
