"""The FP64 oracle's optimizer step: every origin checked, then each checkpoint clipped and stepped by AdamW.

:func:`oracle_optim_step` is ``OracleTrainer.optim_step``'s prediction of
``trainer.optim_step(lr=, max_grad_norm=)`` (NOTE [Oracle trainer] Rule 6 in
``validation/oracle.py``). Every origin of every checkpoint is checked
first (:func:`check_oracle_age`, the documented staleness rule), so a stale
one raises the trainer's ``StaleGradientError`` and nothing changes. Then
each checkpoint steps on its own: without gradients it does not step; with
a non-finite norm it does not step and its gradients and origins are
dropped; otherwise the gradients are clipped by torch's rule (coefficient
``min(1, max_norm / (norm + 1e-6))``, the accumulated gradients left
clipped) and ``torch.optim.AdamW`` steps the FP64 masters, at ``lr`` for
this step only when given; the live weights become the masters rounded to
the checkpoint's dtype, revision + 1, and that version is snapshotted.
The step may start from gradients the caller passes (the trainer's own),
so that a step is judged from the same starting point; the norm and
clipping it reports are then theirs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from .oracle_state import OracleCheckpoint, OracleStep, check_oracle_age

__all__ = ["oracle_optim_step"]


def oracle_optim_step(
    checkpoints: Mapping[str, OracleCheckpoint],
    device: torch.device,
    lr: float | None,
    max_grad_norm: float | None,
    grads: Mapping[str, Mapping[str, torch.Tensor | None]] | None,
) -> dict[str, OracleStep]:
    """Every origin of every checkpoint checked, then each stepped (from ``grads[name]`` on ``device`` when given)."""
    for ckpt in checkpoints.values():
        for generation, revision, bound in sorted(ckpt.origins, key=lambda o: o[1]):
            check_oracle_age(ckpt, generation, revision, bound)
    return {
        name: _step_one(ckpt, device, lr, max_grad_norm, None if grads is None else grads[name])
        for name, ckpt in checkpoints.items()
    }


def _step_one(
    ckpt: OracleCheckpoint,
    device: torch.device,
    lr: float | None,
    max_grad_norm: float | None,
    given: Mapping[str, torch.Tensor | None] | None,
) -> OracleStep:
    """One checkpoint's step (above), from ``given`` (the caller's gradients; ``None``: the oracle's own)."""
    masters = {n: m.detach().clone() for n, m in ckpt.masters.items()}
    if not ckpt.grads:
        return OracleStep(False, "no gradients", None, False, masters)
    start = ckpt.grads
    if given is not None:
        start = {n: g.detach().to(device, torch.float64) for n, g in given.items() if g is not None}
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in start.values()))
    own_norm = math.sqrt(sum(float(g.pow(2).sum()) for g in ckpt.grads.values()))
    if not math.isfinite(norm):
        ckpt.grads, ckpt.baseline_grads, ckpt.origins = {}, {}, set()
        return OracleStep(False, "non-finite gradient norm", norm, False, masters)
    scale = own_scale = 1.0
    if max_grad_norm is not None:
        scale = min(1.0, max_grad_norm / (norm + 1e-6))
        own_scale = min(1.0, max_grad_norm / (own_norm + 1e-6))
    for n, master in ckpt.masters.items():
        master.grad = start[n] * scale if n in start else None
    group = ckpt.optimizer.param_groups[0]
    saved_lr = group["lr"]
    group["lr"] = saved_lr if lr is None else lr
    ckpt.optimizer.step()
    group["lr"] = saved_lr
    ckpt.grads = {n: g * own_scale for n, g in ckpt.grads.items()}
    ckpt.baseline_grads = {n: g * own_scale for n, g in ckpt.baseline_grads.items()}
    ckpt.revision += 1
    for n, master in ckpt.masters.items():
        master.grad = None
        ckpt.weights[n] = master.detach().to(ckpt.dtype).to(torch.float64)  # the live copy is rounded
    ckpt.snapshot()
    after = {n: m.detach().clone() for n, m in ckpt.masters.items()}
    return OracleStep(True, None, norm, bool(norm > max_grad_norm) if max_grad_norm is not None else False, after)
