"""Per-token behaviour versions and log-probs at backward: lag, masking of stale tokens, the behaviour ratio.

NOTE [Behaviour tokens]
  1. A ``ForwardInput`` may carry, per position beside ``target_logprobs``,
     the behaviour log-prob of the target token and the revision and
     generation of the weights that drew it (-1: unknown, e.g. prompts; an
     unknown generation is the forward's). A behaviour token is a real
     (unmasked) target with a known revision.
  2. Behaviour lag = the forward's revision - the token's (the trainer lag,
     NOTE [Staleness] Rule 1, beside it), defined only within one generation,
     since revisions restart at a new one: a token of another generation has
     no lag, is stale whatever the bound (Rule 3), counted and left out of
     the lag distribution. ``BackwardReport`` gives per record the lag's
     minimum, lower median, maximum and histogram; a negative lag (an
     upstream bookkeeping error) is reported as it is.
  3. A behaviour token of another generation, or with
     ``max_behaviour_staleness = b`` one lagging more than ``b``, is stale and
     masked: cotangent 0, no gradient, in no ratio (the staleness
     correction's included, NOTE [Importance correction] Rule 2), counted in
     ``stale_tokens``. Never silently used.
  4. The behaviour ratio of an unmasked target with a behaviour log-prob is
     ``exp(forward log-prob - behaviour log-prob)``; its raw statistics
     (``RatioStats``) are reported whenever behaviour log-probs are given.
     ``behaviour_corrections=(ImportanceCorrection(...),)`` reweights those
     rows at its level, clips and bound (NOTE [Importance correction] Rules
     2-4, 9-10; ``policy`` unused); a target of such a row without a
     behaviour log-prob is in no ratio and gets no gradient. This runs before
     any staleness correction, which multiplies in.
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
    *known_lags, tokens, stale_tokens = read_on_host(
        torch.cat((lags[known & ~other_generation], counts)), "behaviour lags"
    )
    histogram: dict[int, int] = {}
    for lag in sorted(known_lags):
        histogram[lag] = histogram.get(lag, 0) + 1
    ordered = sorted(known_lags) or [0]
    return (
        cotangent,
        BehaviourStats(
            tokens=tokens,
            lag_min=ordered[0],
            lag_median=ordered[(len(ordered) - 1) // 2],
            lag_max=ordered[-1],
            lag_histogram=histogram,
            max_behaviour_staleness=bound,
            stale_tokens=stale_tokens,
            ratio=ratio,
            correction=correction,
        ),
        stale,
    )


def _corrected(
    record: ForwardRecord, cotangent: torch.Tensor, behaviour: torch.Tensor, used: torch.Tensor
) -> tuple[torch.Tensor, CorrectionStats | None]:
    """Rule 4's reweighting of the rows holding ``behaviour`` log-probs, when a behaviour correction is asked for."""
    correction = record.options.behaviour_correction
    rows = used.any(-1)
    if correction is None or not bool(rows.any()):
        return cotangent, None
    corrected = cotangent.clone()
    corrected[rows], stats = correct_cotangent(
        cotangent[rows],
        record.logprobs()[rows],
        behaviour[rows],
        correction,
        staleness(record.checkpoint, record.version),
        used[rows],
    )
    return corrected, stats
