"""Importance correction of stale token cotangents.

NOTE [Importance correction]
  1. Eligible: only ``target_logprobs`` cotangents of a *stale* record
     (staleness > 0) whose options carry an ``ImportanceCorrection``. Fresh
     records are never touched.
  2. Each active (non-zero cotangent) token is multiplied by
     ``w = clip(exp(lp_current - lp_forward), clip_low, clip_high)``, computed
     detached, in log space (the log-ratio is clipped to
     ``[log clip_low, log clip_high]`` before ``exp``), so no ratio overflows.
     A clipped token's weight is the bound itself (``exp(log b)`` need not be
     ``b``). Inactive tokens are never read.
  3. Weights are FP32, or FP64 for FP64 inputs and when either bound is not a
     normal FP32 number (above FP32's max or positive below its smallest
     normal, e.g. 1e300 or 1e-300).
  4. ``lp_forward`` must be finite on active tokens; ``lp_current`` may be
     ``-inf`` (weight ``clip_low``) but not NaN or ``+inf``: those raise.
  5. The backward still differentiates the forward's weights; only the
     cotangents change. The estimator is unbiased only without clipping and
     only for score-function objectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import GradientCommitError
from .options import ImportanceCorrection

__all__ = ["CorrectionStats", "correction_weights", "correct_cotangent"]

_F32 = torch.finfo(torch.float32)


@dataclass(frozen=True)
class CorrectionStats:
    """Per-record weight statistics over active tokens."""

    mean: float
    max: float
    fraction_clipped: float
    effective_sample_size: float
    tokens: int
    staleness: int


def _weight_dtype(reference: torch.Tensor, correction: ImportanceCorrection) -> torch.dtype:
    bounds = (correction.clip_low, correction.clip_high)
    extreme = any(b > _F32.max or 0.0 < b < _F32.tiny for b in bounds)
    return torch.float64 if reference.dtype == torch.float64 or extreme else torch.float32


def correction_weights(
    current: torch.Tensor, forward: torch.Tensor, correction: ImportanceCorrection
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, clipped)`` for the active tokens given as 1-D tensors (Rules 2-4)."""
    dtype = _weight_dtype(forward, correction)
    current, forward = current.detach().to(dtype), forward.detach().to(dtype)
    if not bool(torch.isfinite(forward).all()):
        raise GradientCommitError("importance correction: expected finite forward log-probs on active tokens, found non-finite")
    if bool((torch.isnan(current) | (current == math.inf)).any()):
        raise GradientCommitError(
            "importance correction: expected current log-probs that are finite or -inf on active "
            "tokens, found NaN or +inf; check the current-weight forward"
        )
    low, high = correction.clip_low, correction.clip_high
    log_low = math.log(low) if low > 0 else -math.inf
    log_high = math.log(high) if high > 0 else -math.inf
    log_ratio = current - forward
    clipped = (log_ratio < log_low) | (log_ratio > log_high)
    weights = torch.exp(log_ratio.clamp(min=log_low, max=log_high)).clamp(min=low, max=high)
    weights = weights.masked_fill(log_ratio >= log_high, high).masked_fill(log_ratio <= log_low, low)
    return weights, clipped


def correct_cotangent(
    cotangent: torch.Tensor,
    current: torch.Tensor,
    forward: torch.Tensor,
    correction: ImportanceCorrection,
    staleness: int,
) -> tuple[torch.Tensor, CorrectionStats]:
    """Reweight ``cotangent`` (any shape) token by token; returns it and the statistics."""
    active = cotangent != 0
    weights, clipped = correction_weights(current[active], forward[active], correction)
    corrected = cotangent.clone()
    corrected[active] = (cotangent[active].to(weights.dtype) * weights).to(cotangent.dtype)
    count = int(weights.numel())
    peak = float(weights.max()) if count else 0.0
    # Scaled by the largest weight, so bounds like 1e300 or 1e-300 neither overflow nor underflow.
    scaled = weights.double() / peak if peak > 0 else torch.zeros_like(weights, dtype=torch.float64)
    total, squares = float(scaled.sum()), float((scaled * scaled).sum())
    stats = CorrectionStats(
        mean=peak * (total / count) if count else 0.0,
        max=peak,
        fraction_clipped=float(clipped.double().mean()) if count else 0.0,
        effective_sample_size=total * total / squares if squares > 0 else 0.0,
        tokens=count,
        staleness=staleness,
    )
    return corrected, stats
