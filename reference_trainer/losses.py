"""Token-level policy-gradient objectives on ``target_logprobs``.

Pure functions of tensors: they build a scalar loss from per-token log-probs
(the trainer's ``target_logprobs``, or any differentiable log-probs) and know
nothing about the trainer. ``trainer.backward(loss)`` then turns the loss's
gradient with respect to each log-prob (its *cotangent*) into weight gradients.

NOTE [Loss inputs]

1. ``logprobs`` is one sequence ``(T,)``, a batch ``(B, T)``, or a list of 1-D
   tensors of any lengths (one per sequence, e.g. each output's
   ``target_logprobs``); a list is right-padded with :func:`pad_sequences` and
   the padding is masked.
2. ``mask`` is ``None`` (every position counts) or a **bool** tensor (or list)
   shaped like ``logprobs``. The trainer gives masked targets a log-prob of 0,
   which is not distinguishable from a certain token, so pass
   ``mask=target_tokens >= 0``; otherwise prompt positions dilute
   ``token_mean``. Integer masks are refused: a target-id tensor passed by
   mistake would silently select the wrong positions.
3. ``advantages`` are per token (shaped like ``logprobs``) or per sequence
   (shape ``logprobs.shape[:-1]``: a scalar for one sequence, ``(B,)`` for a
   batch, or a list of ``B`` numbers for a list), spread over that sequence's
   tokens. No other broadcasting. Advantages and behaviour log-probs are
   detached: they are constants of the objective.
4. ``reduction`` (N = number of unmasked tokens, n_b = those of sequence b):

   * ``"token_mean"``: ``sum_{b,t} l_bt / N`` (every token weighs the same);
   * ``"sum"``: ``sum_{b,t} l_bt``;
   * ``"sequence_mean"``: ``(1/B) sum_b (sum_t l_bt / n_b)`` (every sequence
     weighs the same, GRPO's original form).

   An empty denominator counts as 1, so an all-masked input gives a loss of 0
   with zero gradient, never NaN.
5. Masked positions contribute exactly 0 to the value and the gradient, even
   where their log-probs are ``-inf``. Losses are computed in FP32, or FP64 for
   FP64 inputs.

With the trainer's importance correction (NOTE [Importance correction]) a stale
forward's cotangents ``dL/dlogp_t`` are multiplied by
``w_t = clip(exp(logp_current - logp_forward))``; these objectives need no
change for it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from torch.nn.utils.rnn import pad_sequence

from .errors import ConfigError, int_at_least, is_number

if TYPE_CHECKING:  # typing.TypeIs from Python 3.13; for the annotations only, never imported at run time
    from typing_extensions import TypeIs

__all__ = [
    "Reduction",
    "pad_sequences",
    "reinforce_loss",
    "ppo_clip_loss",
    "group_advantages",
]

Reduction = Literal["token_mean", "sum", "sequence_mean"]
_REDUCTIONS = ("token_mean", "sum", "sequence_mean")

TokenValues = torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...]  # one tensor, or one per sequence


def pad_sequences(
    sequences: Sequence[torch.Tensor], *, padding_value: float | bool = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D tensors of lengths ``T_b`` into ``(B, max T_b)``.

    Returns ``(padded, real)`` where ``real`` is a bool ``(B, max T_b)`` mask of
    the positions that came from the inputs. Gradients flow back to the inputs.
    """
    if isinstance(sequences, torch.Tensor) or len(sequences) == 0:
        raise ConfigError("sequences", sequences, "a non-empty list of 1-D tensors")
    for i, seq in enumerate(sequences):
        if not isinstance(seq, torch.Tensor) or seq.dim() != 1:
            found = tuple(seq.shape) if isinstance(seq, torch.Tensor) else seq
            raise ConfigError(f"sequences[{i}]", found, "a 1-D tensor")
    padded = pad_sequence(list(sequences), batch_first=True, padding_value=padding_value)
    lengths = torch.tensor([seq.shape[0] for seq in sequences], device=padded.device)
    real = torch.arange(padded.shape[1], device=padded.device) < lengths[:, None]  # (B, T)
    return padded, real


def reinforce_loss(
    logprobs: TokenValues,
    advantages: TokenValues | float,
    mask: TokenValues | None = None,
    *,
    reduction: Reduction = "token_mean",
) -> torch.Tensor:
    """REINFORCE: ``l_t = -A_t * logp_t``, reduced (see NOTE [Loss inputs]).

    Its gradient with respect to ``logp_t`` is ``-A_t / N`` for ``token_mean``,
    ``-A_t`` for ``sum`` and ``-A_t / (B n_b)`` for ``sequence_mean`` on unmasked
    tokens, 0 on masked ones. Returns a 0-d tensor.
    """
    _check_reduction(reduction)
    lp, real = _batch("logprobs", logprobs)
    mask2 = _mask(mask, logprobs, real)
    adv = _advantages(advantages, logprobs, lp)
    lp = torch.where(mask2, lp, 0.0)
    adv = torch.where(mask2, adv, 0.0)
    return _reduce(-(adv * lp), mask2, reduction)


def ppo_clip_loss(
    logprobs: TokenValues,
    behaviour_logprobs: TokenValues,
    advantages: TokenValues | float,
    mask: TokenValues | None = None,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    reduction: Reduction = "token_mean",
) -> torch.Tensor:
    """PPO's clipped surrogate, per token, reduced (see NOTE [Loss inputs]).

    ``r_t = exp(logp_t - logp_behaviour_t)`` (behaviour detached) and
    ``l_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)``.

    Gradient with respect to ``logp_t`` (``token_mean``): ``-r_t A_t / N`` where
    the unclipped term is the smaller one (inside the clip range, or the
    pessimistic side: ``A_t > 0, r_t < 1 - clip_low`` or
    ``A_t < 0, r_t > 1 + clip_high``), 0 where the clipped term is smaller.
    ``clip_low`` in ``[0, 1]``, ``clip_high >= 0`` (asymmetric bounds give
    DAPO's clip-higher). Returns a 0-d tensor.
    """
    _check_reduction(reduction)
    _check_bound("clip_low", clip_low, 0.0, 1.0)
    _check_bound("clip_high", clip_high, 0.0, float("inf"))
    lp, real = _batch("logprobs", logprobs)
    behaviour = _like("behaviour_logprobs", behaviour_logprobs, logprobs, lp).detach()
    mask2 = _mask(mask, logprobs, real)
    adv = torch.where(mask2, _advantages(advantages, logprobs, lp), 0.0)
    # Masking the log-ratio before exp keeps inf/NaN of masked positions out of
    # the backward (0 * inf would be NaN).
    ratio = torch.exp(torch.where(mask2, lp - behaviour.to(lp.dtype), 0.0))
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    return _reduce(torch.where(mask2, per_token, 0.0), mask2, reduction)


def group_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_size: int | None = None,
    *,
    groups: torch.Tensor | None = None,
    eps: float = 1e-6,
    scale: bool = True,
) -> torch.Tensor:
    """GRPO advantages: ``A_i = (r_i - mean_g) / (std_g + eps)`` within each group.

    ``rewards``: 1-D, one per sequence. Groups are consecutive runs of
    ``group_size`` (which must divide ``len(rewards)``), or given by an integer
    ``groups`` tensor of group ids shaped like ``rewards``, or, with neither,
    the whole batch. ``std_g`` is the **population** standard deviation
    (divide by the group size ``n``, not ``n - 1``): defined for a group of one
    (whose advantage is 0), and equal rewards give exactly 0. ``scale=False``
    returns ``r_i - mean_g`` (Dr. GRPO). Computed in FP64, returned in FP32
    (FP64 for FP64 rewards); the result carries no gradient.
    """
    if group_size is not None and groups is not None:
        raise ConfigError("group_size", group_size, "None when groups is given (pass one of them)")
    r = torch.as_tensor(rewards).detach()
    if r.dim() != 1 or r.numel() == 0:
        raise ConfigError("rewards", tuple(r.shape), "a non-empty 1-D tensor", "flatten (groups, size) rewards")
    if not bool(torch.isfinite(r).all()):
        raise ConfigError("rewards", r.tolist(), "finite rewards")
    _check_bound("eps", eps, 0.0, float("inf"))
    n = r.shape[0]
    if groups is not None:
        integer = isinstance(groups, torch.Tensor) and not groups.dtype.is_floating_point
        if not integer or groups.dtype == torch.bool:
            raise ConfigError("groups", groups, "an integer tensor of group ids")
        if tuple(groups.shape) != (n,):
            raise ConfigError("groups", tuple(groups.shape), f"shape {(n,)} (one id per reward)")
        index = torch.unique(groups, return_inverse=True)[1].to(r.device)
    elif group_size is not None:
        if not int_at_least(group_size, 1) or n % group_size:
            allowed = f"a positive int dividing the number of rewards ({n})"
            raise ConfigError("group_size", group_size, allowed)
        index = torch.arange(n, device=r.device) // group_size
    else:
        index = torch.zeros(n, dtype=torch.long, device=r.device)

    out_dtype = torch.float64 if r.dtype == torch.float64 else torch.float32
    r = r.to(torch.float64)
    num_groups = int(index.max()) + 1
    counts = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, index, torch.ones_like(r))
    mean = torch.zeros_like(counts).index_add_(0, index, r) / counts
    centred = r - mean[index]
    if not scale:
        return centred.to(out_dtype)
    var = torch.zeros_like(counts).index_add_(0, index, centred.square()) / counts
    return (centred / (var.sqrt()[index] + eps)).to(out_dtype)


# --- input normalisation (see NOTE [Loss inputs]) ---------------------------------


def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ConfigError("reduction", reduction, f"one of {_REDUCTIONS}")


def _check_bound(field: str, value: object, low: float, high: float) -> None:
    if not is_number(value) or not math.isfinite(value) or not low <= value <= high:
        raise ConfigError(field, value, f"a finite number in [{low}, {high}]")


def _is_list(value: object) -> TypeIs[list[Any] | tuple[Any, ...]]:
    return isinstance(value, (list, tuple))


def _batch(field: str, values: TokenValues) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, T)`` values in the compute dtype and the bool mask of real positions."""
    if _is_list(values):
        padded, real = pad_sequences(values)
        _check_float(field, padded)
    elif isinstance(values, torch.Tensor) and values.dim() in (1, 2):
        _check_float(field, values)
        padded = values if values.dim() == 2 else values[None]
        real = torch.ones(padded.shape, dtype=torch.bool, device=padded.device)
    else:
        found = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
        raise ConfigError(field, found, "a (T,) or (B, T) tensor or a list of 1-D tensors")
    return padded.to(torch.promote_types(padded.dtype, torch.float32)), real


def _check_float(field: str, values: torch.Tensor) -> None:
    if not values.dtype.is_floating_point:
        raise ConfigError(field, values.dtype, "a floating-point tensor of log-probs")


def _shape_of(values: object) -> object:
    if _is_list(values):
        return [tuple(v.shape) if isinstance(v, torch.Tensor) else v for v in values]
    return tuple(values.shape) if isinstance(values, torch.Tensor) else values


def _like(field: str, values: TokenValues, logprobs: TokenValues, lp: torch.Tensor) -> torch.Tensor:
    """``values`` laid out like ``logprobs`` (same shape, or same list lengths)."""
    if _is_list(logprobs):
        lengths = [tuple(v.shape) for v in logprobs]
        if not _is_list(values) or _shape_of(values) != lengths:
            allowed = f"a list of 1-D tensors of shapes {lengths}"
            raise ConfigError(field, _shape_of(values), allowed)
        return pad_sequences(values)[0]
    if not isinstance(values, torch.Tensor) or values.shape != logprobs.shape:
        raise ConfigError(field, _shape_of(values), f"a tensor of shape {tuple(logprobs.shape)}")
    return values.reshape(lp.shape)


def _mask(mask: TokenValues | None, logprobs: TokenValues, real: torch.Tensor) -> torch.Tensor:
    if mask is None:
        return real
    parts = mask if _is_list(mask) else [mask]
    if any(not isinstance(m, torch.Tensor) or m.dtype != torch.bool for m in parts):
        found = [getattr(m, "dtype", m) for m in parts]
        raise ConfigError("mask", found, "bool tensors", "pass target_tokens >= 0")
    return _like("mask", mask, logprobs, real) & real


def _advantages(advantages: TokenValues | float, logprobs: TokenValues, lp: torch.Tensor) -> torch.Tensor:
    """Per-token ``(B, T)`` advantages, detached, in the compute dtype."""
    if _is_list(logprobs):
        per_token = _is_list(advantages) and all(isinstance(a, torch.Tensor) and a.dim() == 1 for a in advantages)
    else:
        per_token = isinstance(advantages, torch.Tensor) and advantages.shape == logprobs.shape
    if per_token:
        adv = _like("advantages", cast(TokenValues, advantages), logprobs, lp)  # per_token: not a float
    else:
        adv = torch.as_tensor(
            [float(a) for a in advantages] if _is_list(advantages) else advantages,
            dtype=lp.dtype,
            device=lp.device,
        )
        per_sequence = (lp.shape[0],) if _is_list(logprobs) else tuple(logprobs.shape[:-1])
        if tuple(adv.shape) != per_sequence:
            raise ConfigError(
                "advantages",
                _shape_of(advantages),
                f"per-token shape {_shape_of(logprobs)} or per-sequence shape {per_sequence}",
            )
        adv = adv.reshape(-1, 1).expand(lp.shape)
    return adv.detach().to(lp.dtype)


def _reduce(per_token: torch.Tensor, mask: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "sum":
        return per_token.sum()
    if reduction == "token_mean":
        return per_token.sum() / mask.sum().clamp_min(1)
    per_sequence = per_token.sum(-1) / mask.sum(-1).clamp_min(1)  # (B,)
    return per_sequence.mean()
