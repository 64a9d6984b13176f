"""Per-token behaviour versions and log-probs at backward: lag, masking of stale tokens, the behaviour ratio.

NOTE [Behaviour tokens]
  1. A ``ForwardInput`` may carry, per position and aligned with its
     ``target_logprobs``, the behaviour log-prob of the target token and the
     revision and generation of the weights that drew it (-1: unknown, e.g.
     prompt positions; an unknown generation is taken to be the forward's).
     A behaviour token is a real target (not masked) with a known revision.
  2. Behaviour lag = the forward's revision - the token's revision (the
     trainer lag, NOTE [Staleness] Rule 1, is beside it in the report),
     defined only between weights of one generation: revisions restart or
     are restored at a new generation (``Trainer.load``, a checkpoint
     removed and added again), so a token drawn under another generation
     has no lag; it is stale whatever the bound (Rule 3), counted, and
     left out of the lag distribution. ``BackwardReport`` gives per record,
     over its behaviour tokens of the forward's generation, the lag's
     minimum, median (the lower one), maximum and histogram. A negative lag
     within a generation (a token drawn by weights newer than the forward's,
     a bookkeeping error upstream) is reported as it is.
  3. A behaviour token of another generation, and with
     ``max_behaviour_staleness = b`` one whose lag exceeds ``b``, is stale
     and masked: its cotangent becomes 0, so it gets no
     gradient; it takes part in no ratio, the staleness correction's
     included (there it is a masked target, NOTE [Importance correction]
     Rule 2); it is counted
     (``stale_tokens``). Never silently used.
  4. The behaviour ratio of a real, unmasked target with a behaviour log-prob
     is ``exp(forward log-prob - behaviour log-prob)``; its raw statistics
     (token level, ``RatioStats``) are reported whenever behaviour log-probs
     are given. With ``behaviour_corrections=(ImportanceCorrection(...),)``
     the rows holding behaviour log-probs are reweighted at its level, clips
     and bound (NOTE [Importance correction] Rules 2-4, 9-10; its ``policy``
     is not used); a real target of such a row without a behaviour log-prob
     takes part in no ratio and gets no gradient. This runs before any
     staleness correction of the record, which then multiplies in.
  5. A record with behaviour data adds one host read at backward (its lags
     and counts, NOTE [Host syncs]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .host_reads import read_on_host
from .importance import CorrectionStats, RatioStats, correct_cotangent
from .records import ForwardRecord
from .staleness import staleness

__all__ = ["BehaviourStats", "behaviour_cotangent"]


@dataclass(frozen=True, kw_only=True)
class BehaviourStats:
    """One record's behaviour tokens (Rules 2-4): lag distribution, stale tokens masked, ratio statistics.

    ``tokens``: behaviour tokens (stale ones and those of another generation
    included); the lags are over those of the forward's generation, 0 when
    there are none. ``ratio``: ``None`` without behaviour log-probs;
    ``correction``: ``None`` without a behaviour correction.
    """

    tokens: int
    lag_min: int
    lag_median: int
    lag_max: int
    lag_histogram: dict[int, int]
    max_behaviour_staleness: int | None
    stale_tokens: int
    ratio: RatioStats | None
    correction: CorrectionStats | None


def behaviour_cotangent(
    record: ForwardRecord, cotangent: torch.Tensor
) -> tuple[torch.Tensor, BehaviourStats | None, torch.Tensor | None]:
    """``record``'s cotangent with stale behaviour tokens masked and any behaviour correction applied.

    Also returns the stale mask ``(B, T)`` (``None`` without behaviour data): the staleness correction that runs
    next must leave those tokens out of every ratio, as if their targets were masked (Rule 3).
    """
    batch = record.batch
    if batch.behaviour_revisions is None and batch.behaviour_logprobs is None:
        return cotangent, None, None
    real = batch.targets >= 0  # (B, T)
    unknown = torch.full_like(batch.targets, -1)
    revisions = batch.behaviour_revisions if batch.behaviour_revisions is not None else unknown
    generations = batch.behaviour_generations if batch.behaviour_generations is not None else unknown
    known = real & (revisions >= 0)
    other_generation = known & (generations >= 0) & (generations != record.version.generation)  # Rule 2
    lags = record.version.revision - revisions  # (B, T), Rule 2
    bound = record.options.max_behaviour_staleness
    too_old = known & (lags > bound) if bound is not None else torch.zeros_like(known)
    stale = other_generation | too_old  # Rule 3
    cotangent = cotangent.masked_fill(stale, 0.0)  # Rule 3
    ratio, correction = None, None
    if batch.behaviour_logprobs is not None:
        behaviour = batch.behaviour_logprobs
        used = real & ~stale & ~behaviour.isnan()
        ratio = RatioStats.of(torch.exp(record.logprobs()[used].double() - behaviour[used].double()))
        cotangent, correction = _corrected(record, cotangent, behaviour, used)
    counts = torch.stack((known.sum(), stale.sum()))
    *known_lags, tokens, stale_tokens = read_on_host(torch.cat((lags[known & ~other_generation], counts)), "behaviour lags")
    histogram: dict[int, int] = {}
    for lag in sorted(known_lags):
        histogram[lag] = histogram.get(lag, 0) + 1
    ordered = sorted(known_lags) or [0]
    return cotangent, BehaviourStats(
        tokens=tokens, lag_min=ordered[0], lag_median=ordered[(len(ordered) - 1) // 2], lag_max=ordered[-1],
        lag_histogram=histogram, max_behaviour_staleness=bound, stale_tokens=stale_tokens,
        ratio=ratio, correction=correction), stale


def _corrected(record: ForwardRecord, cotangent: torch.Tensor, behaviour: torch.Tensor,
               used: torch.Tensor) -> tuple[torch.Tensor, CorrectionStats | None]:
    """Rule 4's reweighting of the rows holding ``behaviour`` log-probs, when a behaviour correction is asked for."""
    correction = record.options.behaviour_correction
    rows = used.any(-1)
    if correction is None or not bool(rows.any()):
        return cotangent, None
    corrected = cotangent.clone()
    corrected[rows], stats = correct_cotangent(
        cotangent[rows], record.logprobs()[rows], behaviour[rows], correction,
        staleness(record.checkpoint, record.version), used[rows])
    return corrected, stats
