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
  6. Current log-probs: ``"always"`` runs one no-grad forward of the record's
     inputs at the current weights, with the forward's RNG, train/eval mode
     and autocast restored. ``"when_available"`` corrects only the rows whose
     tokens a forward at the current revision already scored
     (:class:`KnownLogprobs`, kept only while an older record of the
     checkpoint is pending); it never adds a forward.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .checkpoints import CheckpointVersion
from .errors import GradientCommitError
from .graphs import ForwardRecord, PaddedBatch, run_model
from .host_reads import read_on_host
from .model import DecoderLM
from .options import ImportanceCorrection
from .rng import restored_forward_state
from .staleness import staleness

__all__ = ["CorrectionStats", "KnownLogprobs", "correct_cotangent", "correct_record", "correction_weights"]

_F32 = torch.finfo(torch.float32)


@dataclass(frozen=True, kw_only=True)
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


TokenKey = tuple[tuple[int, ...], tuple[int, ...]]  # (input ids, target ids) of one row


def _token_keys(batch: PaddedBatch) -> list[TokenKey]:
    """Every row's key, from one host read of the batch (NOTE [Host syncs])."""
    ids, targets = read_on_host(torch.stack((batch.input_ids, batch.targets)), "token keys")
    return [(tuple(ids[row][:n]), tuple(targets[row][:n])) for row, n in enumerate(batch.lengths)]


def _wants_current(record: ForwardRecord) -> bool:
    correction = record.options.correction
    return correction is not None and correction.policy == "when_available"


class KnownLogprobs:
    """Current-revision log-probs by checkpoint and token content, for ``"when_available"`` (Rule 6)."""

    def __init__(self) -> None:
        self._known: dict[str, dict[TokenKey, tuple[CheckpointVersion, torch.Tensor]]] = {}

    def remember(self, record: ForwardRecord, pending: Iterable[ForwardRecord]) -> None:
        """Keep ``record``'s log-probs if an older pending record of its checkpoint may use them.

        Only a ``"when_available"`` correction reads them, so without such a
        record pending nothing is kept and the token keys are not read.
        """
        name = record.checkpoint.name
        if not any(r.checkpoint.name == name and r.version != record.version and _wants_current(r) for r in pending):
            return
        known = self._known.setdefault(name, {})
        for row, key in enumerate(_token_keys(record.batch)):
            known[key] = (record.version, record.forward_logprobs[row, : record.batch.lengths[row]])

    def forget(self, name: str) -> None:
        self._known.pop(name, None)

    def current(self, record: ForwardRecord) -> tuple[torch.Tensor, list[int]]:
        """Padded current log-probs of ``record``'s rows (NaN where unknown) and the rows known."""
        known = self._known.get(record.checkpoint.name, {})
        current = torch.full_like(record.forward_logprobs, math.nan)
        rows: list[int] = []
        if not known:
            return current, rows
        for row, key in enumerate(_token_keys(record.batch)):
            entry = known.get(key)
            if entry is not None and entry[0] == record.checkpoint.version:
                current[row, : record.batch.lengths[row]] = entry[1]
                rows.append(row)
        return current, rows


def _current_logprobs(model: DecoderLM, record: ForwardRecord) -> torch.Tensor:
    """One no-grad forward of the record's inputs at the current weights, its forward state restored."""
    checkpoint = record.checkpoint
    with torch.no_grad(), restored_forward_state(record.rng_state, model):
        return run_model(model, checkpoint, checkpoint.capture(), record.batch)


def correct_record(
    model: DecoderLM, record: ForwardRecord, cotangent: torch.Tensor, known: KnownLogprobs
) -> tuple[torch.Tensor, CorrectionStats | None]:
    """``record``'s cotangent, reweighted if it is stale and asks for a correction (Rules 1 and 6)."""
    correction = record.options.correction
    age = staleness(record.checkpoint, record.version)
    if correction is None or age == 0:
        return cotangent, None
    if correction.policy == "always":
        current, rows = _current_logprobs(model, record), list(range(len(record.batch.lengths)))
    else:
        current, rows = known.current(record)
        if not rows:
            return cotangent, None
    corrected = cotangent.clone()
    corrected[rows], stats = correct_cotangent(cotangent[rows], current[rows], record.forward_logprobs[rows], correction, age)
    return corrected, stats
