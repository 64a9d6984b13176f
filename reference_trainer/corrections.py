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
     (:class:`KnownLogprobs`); it never adds a forward.
  7. ``"when_available"`` scope and bound: log-probs are known per logical
     rank (the one whose code made the forward, NOTE [Logical ranks] Rule 2;
     the process's own code is one more scope) and checkpoint, so a logical
     rank is corrected only by its own forwards and the result does not
     depend on how many processes host the logical ranks. A row is kept only
     while it can still be used: a pending older record of its scope asks
     for ``"when_available"`` and has the same tokens, and the checkpoint is
     still at the row's revision. Entries that lose either are dropped at the
     next forward or release of the scope, so the cache never holds more
     rows than the pending records of its scope have distinct rows.
  8. Dropout: the ratio compares two forwards of the same tokens, which is
     meaningful only if both used the same dropout masks. Two different
     forwards draw the same masks only if neither draws any, so
     ``"when_available"`` pairs only forwards made without dropout (model in
     eval mode or ``config.dropout == 0``); a record that drew masks is never
     corrected by it, and its log-probs are never kept. ``"always"`` restores
     the forward's RNG instead (Rule 6), so it corrects with dropout too.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .checkpoints import CheckpointVersion
from .errors import GradientCommitError
from .inputs import PaddedBatch
from .records import ForwardRecord
from .running import run_model
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
    """Reweight ``cotangent`` (any shape) token by token; returns it and the statistics.

    With no active token (an all-zero cotangent) nothing is reweighted and
    every statistic is 0 (``tokens=0``): there is no weight to average.
    """
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
Scope = tuple[int | None, str]  # (logical rank that made the records, None: the process's own; checkpoint name)
Rows = dict[TokenKey, tuple[CheckpointVersion, torch.Tensor]]  # one scope's known rows: (revision, log-probs)


def _token_keys(batches: list[PaddedBatch]) -> list[list[TokenKey]]:
    """Every row's key of each batch, from one host read of them all (NOTE [Host syncs])."""
    flat = read_on_host(torch.cat([torch.stack((b.input_ids, b.targets)).reshape(-1) for b in batches]), "token keys")
    keys, start = [], 0
    for batch in batches:
        size, width = batch.input_ids.numel(), batch.input_ids.shape[1]
        ids, targets = flat[start : start + size], flat[start + size : start + 2 * size]
        rows = [(r * width, r * width + n) for r, n in enumerate(batch.lengths)]  # (start, end) of each row's real tokens
        keys.append([(tuple(ids[a:b]), tuple(targets[a:b])) for a, b in rows])
        start += 2 * size
    return keys


def _scope(record: ForwardRecord) -> Scope:
    return record.owner, record.checkpoint.name


def _wants_current(record: ForwardRecord) -> bool:
    correction = record.options.correction
    return correction is not None and correction.policy == "when_available"


class KnownLogprobs:
    """Current-revision log-probs by scope and token content, for ``"when_available"`` (Rules 6-8).

    ``dropout``: the model's ``config.dropout``; with it, a forward in train
    mode draws masks and takes no part (Rule 8). Each record's token keys are
    read on the host at most once, and only when a row of it may be kept or
    looked up.
    """

    def __init__(self, dropout: float) -> None:
        self._dropout = dropout
        self._known: dict[Scope, Rows] = {}
        self._keys: weakref.WeakKeyDictionary[ForwardRecord, list[TokenKey]] = weakref.WeakKeyDictionary()

    def _maskless(self, record: ForwardRecord) -> bool:
        """The record's forward drew no dropout masks (Rule 8)."""
        return self._dropout == 0 or not record.rng_state.training

    def _read_keys(self, records: list[ForwardRecord]) -> None:
        """Read the token keys of those of ``records`` not read yet, all in one host read."""
        unread = [r for r in records if r not in self._keys]
        if unread:
            for record, keys in zip(unread, _token_keys([r.batch for r in unread])):
                self._keys[record] = keys

    def _users(self, scope: Scope, version: CheckpointVersion, pending: Iterable[ForwardRecord]) -> list[ForwardRecord]:
        """Pending records of ``scope`` that could use log-probs made at ``version``: older, ``when_available``, maskless."""
        return [
            r for r in pending
            if _scope(r) == scope and r.version != version and _wants_current(r) and self._maskless(r)
        ]

    def _prune(self, scope: Scope, current: CheckpointVersion, pending: Iterable[ForwardRecord]) -> Rows:
        """Drop the rows of ``scope`` nothing can use any more (Rule 7); returns what is left.

        Only the keys already read count: a row exists only if every record that
        could use it was pending, and its keys read, when the row was kept.
        """
        known = {k: e for k, e in self._known.pop(scope, {}).items() if e[0] == current}
        if known:
            wanted = {key for r in self._users(scope, current, pending) for key in self._keys.get(r, ())}
            known = {k: e for k, e in known.items() if k in wanted}
        if known:
            self._known[scope] = known
        return known

    def remember(self, record: ForwardRecord, pending: Iterable[ForwardRecord]) -> None:
        """Keep the rows of ``record`` that an older pending record of its scope may use (Rule 7).

        Nothing is read on the host unless such a record is pending.
        """
        scope, pending = _scope(record), list(pending)
        users = self._users(scope, record.version, pending) if self._maskless(record) else []
        if not users:
            self._prune(scope, record.version, pending)
            return
        self._read_keys(users + [record])
        wanted = {key for r in users for key in self._keys[r]}
        known = self._prune(scope, record.version, pending)
        for row, key in enumerate(self._keys[record]):
            if key in wanted:  # a copy of the row: the padded batch's storage is not kept alive
                known[key] = (record.version, record.forward_logprobs[row, : record.batch.lengths[row]].clone())
        if known:
            self._known[scope] = known

    def released(self, record: ForwardRecord, pending: Iterable[ForwardRecord]) -> None:
        """``record`` is no longer pending: forget its keys and the rows only it could use."""
        self._keys.pop(record, None)
        self._prune(_scope(record), record.checkpoint.version, pending)

    def forget(self, name: str) -> None:
        """Drop every scope of checkpoint ``name`` (its weights were replaced)."""
        for scope in [s for s in self._known if s[1] == name]:
            del self._known[scope]

    def current(self, record: ForwardRecord) -> tuple[torch.Tensor, list[int]]:
        """Padded current log-probs of ``record``'s rows (NaN where unknown) and the rows known."""
        known = self._known.get(_scope(record), {}) if self._maskless(record) else {}
        current = torch.full_like(record.forward_logprobs, math.nan)
        rows: list[int] = []
        if not known:
            return current, rows
        self._read_keys([record])
        for row, key in enumerate(self._keys[record]):
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
