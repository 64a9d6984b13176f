"""Importance correction of stale token cotangents.

NOTE [Importance correction]
  1. Eligible: only ``target_logprobs`` cotangents of a *stale* record (staleness > 0) whose options carry an
     ``ImportanceCorrection``; fresh records are never touched.
  2. Each active token (target not masked, non-zero cotangent) is multiplied by
     ``w = clip(exp(min(r, max_log_ratio)), clip_low, clip_high)``, ``r`` its level's log-ratio (Rule 9), detached
     and bounded in log space before ``exp`` so no ratio overflows (``e**20`` at most by default); a token clipped at
     a bound gets the bound itself. Masked targets take part in no ratio and keep cotangent 0 at every level; rows
     without an active token are never read, nor inactive tokens at level ``"token"``.
  3. Weights are FP32, or FP64 for FP64 inputs or a bound that is not a normal FP32 number (e.g. 1e300). A weighted
     cotangent no longer finite in its dtype is refused with a ``GradientCommitError`` naming the weight, the dtype
     and the option, before anything is committed.
  4. ``lp_forward`` must be finite on active tokens; ``lp_current`` may be ``-inf`` (weight ``clip_low``);
     NaN or ``+inf`` raise.
  5. The backward still differentiates the forward's weights; only the cotangents change. Unbiased only without
     clipping and only for score-function objectives.
  6. Current log-probs: ``"always"`` runs one no-grad forward at the current weights with the forward's RNG, mode
     and autocast restored; ``"when_available"`` corrects only rows a forward at the current revision already scored
     (:class:`KnownLogprobs`) and never adds a forward.
  7. ``"when_available"`` scope: log-probs are known per logical rank (NOTE [Logical ranks] Rule 2; the process's own
     code is one more scope), checkpoint and autocast state, so a logical rank is corrected only by its own forwards
     (the result does not depend on the process count) and an autocast forward never pairs with an FP32 one. A row
     is kept only while a pending older record of its scope asks for it with the same tokens and the checkpoint is at
     the row's revision, so the cache holds no more rows than its pending records need; rows a load restored
     (NOTE [Resume] Rule 2) stay while the revision does. A record made at a kept older version
     (NOTE [Weight captures] Rule 4) keeps and prunes nothing.
  8. Dropout: a ratio of two forwards means something only if both drew the same masks, which holds only when
     neither draws any; so ``"when_available"`` pairs only forwards without dropout and never corrects or keeps a
     record that drew masks. ``"always"`` restores the forward's RNG (Rule 6), so it corrects with dropout too.
  9. Levels (``ImportanceCorrection.level``), ``r_t`` token ``t``'s log-ratio, sums over a row's ``n`` unmasked
     targets: ``"token"`` (default) ``r_t``; ``"sequence"`` ``sum r_t``; ``"geometric"`` ``sum r_t / n``;
     ``"average"`` ``log(sum exp(r_t) / n)`` (``logsumexp``). Unclipped, ``"sequence"`` is unbiased for the sequence
     objective and ``"token"`` for the per-token sum; the other two are biased for both (measured in
     ``tests/property/test_importance_level_oracle.py``).
  10. Statistics (``CorrectionStats``): the applied weights per active token (mean, max, fraction clipped, effective
     sample size) and, per unit of the level, the raw ratios (after the overflow bound, before the clip) beside the
     clipped ones (min, max, mean, quantiles), with the level, bound and staleness.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable

import torch

from .checkpoints import CheckpointVersion
from .host_reads import read_on_host
from .importance import CorrectionStats, correct_cotangent
from .inputs import PaddedBatch
from .model import DecoderLM
from .records import ForwardRecord
from .rng import restored_forward_state
from .running import run_model
from .staleness import staleness

__all__ = ["KnownLogprobs", "correct_record"]


TokenKey = tuple[tuple[int, ...], tuple[int, ...]]  # (input ids, target ids) of one row
Autocast = tuple[str, torch.dtype | None]  # a forward's device type and autocast dtype (None: autocast off)
# (logical rank that made the records, None: the process's own; checkpoint name; autocast state)
Scope = tuple[int | None, str, Autocast]
Rows = dict[TokenKey, tuple[CheckpointVersion, torch.Tensor]]  # one scope's known rows: (revision, log-probs)


def _token_keys(batches: list[PaddedBatch]) -> list[list[TokenKey]]:
    """Every row's key of each batch, from one host read of them all (NOTE [Host syncs])."""
    flat = read_on_host(torch.cat([torch.stack((b.input_ids, b.targets)).reshape(-1) for b in batches]), "token keys")
    keys, start = [], 0
    for batch in batches:
        size, width = batch.input_ids.numel(), batch.input_ids.shape[1]
        ids, targets = flat[start : start + size], flat[start + size : start + 2 * size]
        rows = [
            (r * width, r * width + n) for r, n in enumerate(batch.lengths)
        ]  # (start, end) of each row's real tokens
        keys.append([(tuple(ids[a:b]), tuple(targets[a:b])) for a, b in rows])
        start += 2 * size
    return keys


def _scope(record: ForwardRecord) -> Scope:
    state = record.rng_state
    return (
        record.owner,
        record.checkpoint.name,
        (state.device.type, state.autocast_dtype if state.autocast_enabled else None),
    )


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
        self._resumed: dict[Scope, dict[TokenKey, CheckpointVersion]] = {}  # rows a load restored (``resume``)
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
            r
            for r in pending
            if _scope(r) == scope and r.version != version and _wants_current(r) and self._maskless(r)
        ]

    def _prune(self, scope: Scope, current: CheckpointVersion, pending: Iterable[ForwardRecord]) -> Rows:
        """Drop the rows of ``scope`` nothing can use any more (Rule 7); returns what is left.

        Only the keys already read count: a row exists only if every record that
        could use it was pending, and its keys read, when the row was kept.
        """
        known = {k: e for k, e in self._known.pop(scope, {}).items() if e[0] == current}
        resumed = self._resumed.pop(scope, {})
        if known:
            wanted = {key for r in self._users(scope, current, pending) for key in self._keys.get(r, ())}
            known = {k: e for k, e in known.items() if k in wanted or resumed.get(k) == e[0]}
        if known:
            self._known[scope] = known
            self._resumed[scope] = {k: v for k, v in resumed.items() if k in known}
        return known

    def remember(self, record: ForwardRecord, pending: Iterable[ForwardRecord]) -> None:
        """Keep the rows of ``record`` that an older pending record of its scope may use (Rule 7).

        Nothing is read on the host unless such a record is pending. A record made at a kept older version (NOTE
        [Weight captures] Rule 4) has no current log-probs: it keeps nothing and prunes nothing.
        """
        if record.version != record.checkpoint.version:
            return
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
                known[key] = (record.version, record.logprobs()[row, : record.batch.lengths[row]].clone())
        if known:
            self._known[scope] = known

    def released(self, record: ForwardRecord, pending: Iterable[ForwardRecord]) -> None:
        """``record`` is no longer pending: forget its keys and the rows only it could use."""
        self._keys.pop(record, None)
        pending = list(pending)
        for scope in [s for s in self._known if s[:2] == (record.owner, record.checkpoint.name)]:  # any autocast state
            self._prune(scope, record.checkpoint.version, pending)

    def forget(self, name: str) -> None:
        """Drop every scope of checkpoint ``name`` (its weights were replaced)."""
        for scope in [s for s in self._known if s[1] == name]:
            del self._known[scope]
            self._resumed.pop(scope, None)

    def saved(self, pending: Iterable[ForwardRecord]) -> dict[Scope, Rows]:
        """The rows a record of ``pending`` can still use (Rule 7), for a save (NOTE [Resume] Rule 2)."""
        users = [r for r in pending if _wants_current(r) and self._maskless(r) and r.version != r.checkpoint.version]
        rows: dict[Scope, Rows] = {}
        for scope, known in self._known.items():
            for record in (r for r in users if _scope(r) == scope):
                rows.setdefault(scope, {}).update(
                    {
                        key: known[key]
                        for key in self._keys.get(record, ())
                        if key in known and known[key][0] == record.checkpoint.version
                    }
                )
        return rows

    def resume(self, rows: dict[Scope, Rows]) -> None:
        """Hold the rows a save kept (``saved``): the forwards that use them are made again after the load, so each
        is kept while its checkpoint stays at the row's version, even before they are (NOTE [Resume] Rule 2)."""
        for scope, known in rows.items():
            self._known[scope] = dict(known)
            self._resumed[scope] = {key: version for key, (version, _) in known.items()}

    def current(self, record: ForwardRecord) -> tuple[torch.Tensor, list[int]]:
        """Padded current log-probs of ``record``'s rows (NaN where unknown) and the rows known."""
        known = self._known.get(_scope(record), {}) if self._maskless(record) else {}
        current = torch.full_like(record.logprobs(), math.nan)
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
    model: DecoderLM,
    record: ForwardRecord,
    cotangent: torch.Tensor,
    known: KnownLogprobs,
    excluded: torch.Tensor | None = None,
) -> tuple[torch.Tensor, CorrectionStats | None]:
    """``record``'s cotangent, reweighted if it is stale and asks for a correction (Rules 1 and 6).

    ``excluded`` ``(B, T)``: targets treated as masked (Rule 2), e.g. stale behaviour tokens (NOTE [Behaviour
    tokens] Rule 3); ``None``: only the masked targets.
    """
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
    active = record.batch.targets >= 0 if excluded is None else (record.batch.targets >= 0) & ~excluded
    corrected = cotangent.clone()
    corrected[rows], stats = correct_cotangent(
        cotangent[rows], current[rows], record.logprobs()[rows], correction, age, active[rows]
    )
    return corrected, stats
