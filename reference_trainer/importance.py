"""Importance weights by level, and their statistics (NOTE [Importance correction] in ``corrections.py``).

Pure tensor functions, no model: :func:`correct_cotangent` reweights one
cotangent given the current and forward log-probs; ``corrections.py``
decides when and with which log-probs. Rules 2-4 (overflow-free weights,
their dtype, which log-probs are accepted) and 9-10 (levels, statistics) are
implemented here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import GradientCommitError
from .options import ImportanceCorrection

__all__ = ["QUANTILES", "CorrectionStats", "RatioStats", "correct_cotangent", "correction_weights"]

_F32 = torch.finfo(torch.float32)
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


@dataclass(frozen=True, kw_only=True)
class RatioStats:
    """Minimum, maximum, mean and :data:`QUANTILES` (linear interpolation) of some ratios; all 0 for none."""

    min: float
    max: float
    mean: float
    quantiles: dict[float, float]

    @classmethod
    def of(cls, values: torch.Tensor) -> RatioStats:
        """The statistics of a 1-D tensor, computed in FP64 and read in one host transfer."""
        values = values.double()
        if values.numel() == 0:
            return cls(min=0.0, max=0.0, mean=0.0, quantiles={q: 0.0 for q in QUANTILES})
        # torch.quantile's linear interpolation, by a sort: torch.quantile refuses more than 2**24 values.
        ordered = values.sort().values
        at = torch.tensor(QUANTILES, dtype=torch.float64, device=values.device) * (values.numel() - 1)
        low_at = at.floor().long()
        below, above = ordered[low_at], ordered[at.ceil().long()]
        quantiles = below + (above - below) * (at - low_at)
        high = values.max()
        scale = torch.where(high > 0, high, torch.ones_like(high))
        mean = (values / scale).mean() * scale  # scaled first: a sum of ratios near e**709 would overflow
        parts = torch.cat((torch.stack((values.min(), high, mean)), quantiles))
        low, top, average, *levels = parts.tolist()
        return cls(min=low, max=top, mean=average, quantiles=dict(zip(QUANTILES, levels)))


@dataclass(frozen=True, kw_only=True)
class CorrectionStats:
    """One corrected record's weights (Rule 10).

    ``mean``, ``max``, ``fraction_clipped``, ``effective_sample_size`` are
    over the ``tokens`` active tokens, each counted with the weight applied
    to it. ``raw`` (before ``clip_low`` / ``clip_high``, after the
    ``max_log_ratio`` bound) and ``clipped`` are over the level's ``units``:
    active tokens at level ``"token"``, sequences (rows with an active token)
    otherwise.
    """

    mean: float
    max: float
    fraction_clipped: float
    effective_sample_size: float
    tokens: int
    staleness: int
    level: str
    max_log_ratio: float
    units: int
    raw: RatioStats
    clipped: RatioStats


def _weight_dtype(reference: torch.Tensor, correction: ImportanceCorrection) -> torch.dtype:
    bounds = (correction.clip_low, correction.clip_high)
    extreme = any(b > _F32.max or 0.0 < b < _F32.tiny for b in bounds)
    return torch.float64 if reference.dtype == torch.float64 or extreme else torch.float32


def _check_logprobs(current: torch.Tensor, forward: torch.Tensor) -> None:
    """Rule 4, over the tokens that take part."""
    if not bool(torch.isfinite(forward).all()):
        raise GradientCommitError(
            "importance correction: expected finite forward log-probs on active tokens, found non-finite"
        )
    if bool((torch.isnan(current) | (current == math.inf)).any()):
        raise GradientCommitError(
            "importance correction: expected current log-probs that are finite or -inf on active "
            "tokens, found NaN or +inf; check the current-weight forward"
        )


def clipped_exp(log_ratio: torch.Tensor, correction: ImportanceCorrection) -> tuple[torch.Tensor, torch.Tensor]:
    """``(clip(exp(min(log_ratio, max_log_ratio)), clip_low, clip_high), clipped)`` without overflow (Rule 2).

    ``log_ratio`` is never ``+inf`` or NaN (Rule 4); ``-inf`` gives ``clip_low``.
    ``clipped``: the weight is not the ratio (a clip bound or the log bound applied).
    """
    low, high, bound = correction.clip_low, correction.clip_high, correction.max_log_ratio
    log_low = math.log(low) if low > 0 else -math.inf
    log_high = math.log(high) if high > 0 else -math.inf
    top = min(log_high, bound)
    clipped = (log_ratio < log_low) | (log_ratio > top)
    weights = torch.exp(log_ratio.clamp(min=log_low, max=top)).clamp(min=low, max=high)
    if log_high <= bound:  # a ratio clipped at ``high`` is ``high`` itself (``exp(log b)`` need not be ``b``)
        weights = weights.masked_fill(log_ratio >= log_high, high)
    return weights.masked_fill(log_ratio <= log_low, low), clipped


def correction_weights(
    current: torch.Tensor, forward: torch.Tensor, correction: ImportanceCorrection
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, clipped)`` of token level for the active tokens given as 1-D tensors (Rules 2-4)."""
    dtype = _weight_dtype(forward, correction)
    current, forward = current.detach().to(dtype), forward.detach().to(dtype)
    _check_logprobs(current, forward)
    return clipped_exp(current - forward, correction)


def sequence_log_ratios(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """``(R,)`` log-ratio of each row of ``(R, T)`` token log-ratios over its ``mask``-ed tokens (Rule 9).

    ``sequence``: their sum (the log of the product); ``geometric``: their
    mean; ``average``: the log of the mean ratio, by ``logsumexp`` (no ratio
    is formed). Unmasked entries are never read, NaN included.
    """
    if level == "average":
        total = torch.logsumexp(log_ratio.masked_fill(~mask, -math.inf), dim=-1)
        return total - mask.sum(-1).to(log_ratio.dtype).log()
    total = log_ratio.masked_fill(~mask, 0.0).sum(-1)
    return total if level == "sequence" else total / mask.sum(-1).to(log_ratio.dtype)


def unit_log_ratios(
    log_ratio: torch.Tensor, mask: torch.Tensor, active: torch.Tensor, level: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(units' log-ratios, index of each active token's unit)`` for ``(R, T)`` log-ratios (Rule 9).

    A named seam: the mutation suite patches it (``sequence_weight_per_token``).
    """
    if level == "token":
        return log_ratio[active], torch.arange(int(active.sum()), device=log_ratio.device)
    rows = active.any(-1)
    unit_of_row = torch.cumsum(rows, 0) - 1
    return sequence_log_ratios(log_ratio[rows], mask[rows], level), unit_of_row[active.nonzero()[:, 0]]


def _check_overflow(
    cotangent: torch.Tensor, corrected: torch.Tensor, weights: torch.Tensor, correction: ImportanceCorrection
) -> None:
    """Raise if a weight made a finite cotangent non-finite in its dtype (Rule 3), naming the option that allowed it."""
    overflowed = torch.isfinite(cotangent) & ~torch.isfinite(corrected)
    if not bool(overflowed.any()):
        return
    weight = float(weights[overflowed].max())
    option = next(
        (
            f"{name}={value:g}"
            for name, value in (("clip_low", correction.clip_low), ("clip_high", correction.clip_high))
            if weight == value
        ),
        f"max_log_ratio={correction.max_log_ratio:g}",
    )
    largest = torch.finfo(corrected.dtype).max
    raise GradientCommitError(
        f"importance correction: the importance weight {weight:.3g} overflowed {corrected.dtype} (largest finite "
        f"{largest:.3g}) when applied to the cotangent; {option} allowed a weight that large. Expected weight x "
        f"|cotangent| <= {largest:.3g}: lower {option.split('=')[0]} (or clip_high), scale the loss down, or make "
        "the forward in FP64; nothing was committed"
    )


def correct_cotangent(
    cotangent: torch.Tensor,
    current: torch.Tensor,
    forward: torch.Tensor,
    correction: ImportanceCorrection,
    staleness: int,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, CorrectionStats]:
    """Reweight ``cotangent`` by ``correction``'s level; returns it and the statistics (Rules 2-4, 9-10).

    The last dimension is the sequence (a 1-D cotangent is one sequence).
    ``mask``: the real targets (``None``: every position); a masked position
    takes no part in any ratio and its cotangent becomes 0. Active tokens
    are the unmasked ones with a non-zero cotangent; only the rows holding
    one are read. With no active token nothing is reweighted and every
    statistic is 0 (``tokens=0``): there is no weight to average.
    """
    mask = torch.ones_like(cotangent, dtype=torch.bool) if mask is None else mask
    width = cotangent.shape[-1] if cotangent.dim() else 1
    rows_mask, active = mask.reshape(-1, width), ((cotangent != 0) & mask).reshape(-1, width)
    read = active if correction.level == "token" else rows_mask & active.any(-1, keepdim=True)
    dtype = _weight_dtype(forward, correction)
    current, forward = current.detach().to(dtype).reshape(-1, width), forward.detach().to(dtype).reshape(-1, width)
    _check_logprobs(current[read], forward[read])
    log_ratios, unit = unit_log_ratios(current - forward, rows_mask, active, correction.level)
    unit_weights, unit_clipped = clipped_exp(log_ratios, correction)
    weights, clipped = unit_weights[unit], unit_clipped[unit]
    flat = cotangent.reshape(-1, width)
    corrected = flat.masked_fill(~rows_mask, 0.0)
    products = (flat[active].to(weights.dtype) * weights).to(cotangent.dtype)
    _check_overflow(flat[active], products, weights, correction)
    corrected[active] = products
    raw = torch.exp(log_ratios.double().clamp(max=correction.max_log_ratio))
    return corrected.reshape(cotangent.shape), _stats(weights, clipped, correction, staleness, raw, unit_weights)


def _stats(
    weights: torch.Tensor,
    clipped: torch.Tensor,
    correction: ImportanceCorrection,
    staleness: int,
    raw: torch.Tensor,
    unit_weights: torch.Tensor,
) -> CorrectionStats:
    count = int(weights.numel())
    peak = float(weights.max()) if count else 0.0
    # Scaled by the largest weight, so bounds like 1e300 or 1e-300 neither overflow nor underflow.
    scaled = weights.double() / peak if peak > 0 else torch.zeros_like(weights, dtype=torch.float64)
    total, squares = float(scaled.sum()), float((scaled * scaled).sum())
    return CorrectionStats(
        mean=peak * (total / count) if count else 0.0,
        max=peak,
        fraction_clipped=float(clipped.double().mean()) if count else 0.0,
        effective_sample_size=total * total / squares if squares > 0 else 0.0,
        tokens=count,
        staleness=staleness,
        level=correction.level,
        max_log_ratio=correction.max_log_ratio,
        units=int(raw.numel()),
        raw=RatioStats.of(raw),
        clipped=RatioStats.of(unit_weights),
    )
