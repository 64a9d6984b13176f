"""What a save keeps for the forwards pending when it is made, gathered from every process (NOTE [Resume] Rules 2
and 5): the weights of the older versions they used, and the current log-probs a ``"when_available"`` correction of
them would use (NOTE [Importance correction] Rule 7).

A forward pends on the process that hosts its logical rank (NOTE [Logical ranks] Rule 2), and so do the log-probs
known for it, while rank 0 alone writes the save: each save gathers both from every process, so that the save is the
same for any ``W``. Each function is collective: every process calls it, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .checkpoints import Checkpoint
from .errors import ConfigError, int_at_least

__all__ = [
    "Kept",
    "LogprobRow",
    "agreed_kept",
    "agreed_logprobs",
    "check_logprobs",
    "group_exchange",
    "resume_logprobs",
]


def group_exchange(obj: Any, label: str) -> list[Any]:
    """Every process's ``obj`` by rank, without logical ranks: alone, or over the default process group."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


Kept = dict[int, tuple[dict[str, torch.Tensor], int]]  # revision -> (weights, largest staleness bound)
# {"owner": logical rank or None, "autocast": [device type, autocast dtype's name or None], "inputs", "targets":
# int64 ids, "logprobs": per token}
LogprobRow = dict[str, Any]
_ROW_KEYS = {"owner", "autocast", "inputs", "targets", "logprobs"}


def _autocast_row(state: tuple[str, torch.dtype | None]) -> list[str | None]:
    """A cache scope's autocast state (``corrections.Autocast``) as plain values a save holds."""
    device, dtype = state
    return [device, None if dtype is None else str(dtype).removeprefix("torch.")]


def _autocast_state(row: object) -> tuple[str, torch.dtype | None] | None:
    """The autocast state a saved row names, or None when it names none."""
    if not (isinstance(row, list) and len(row) == 2 and isinstance(row[0], str)):
        return None
    if row[1] is None:
        return row[0], None
    dtype = getattr(torch, row[1], None) if isinstance(row[1], str) else None
    return (row[0], dtype) if isinstance(dtype, torch.dtype) else None


def _kept_versions(trainer: Any, checkpoint: Checkpoint) -> Kept:
    """Each older version of this generation a pending forward of this process used or ``checkpoint`` keeps, while a
    forward at it could still be backpropagated (NOTE [Resume] Rule 2)."""
    kept = {r: (capture.tensors, bound) for r, (capture, bound) in checkpoint.kept.items()}
    for record in trainer.records:
        version, bound = record.version, record.options.max_gradient_staleness
        if (
            record.checkpoint is checkpoint
            and version.generation == checkpoint.generation
            and 0 < checkpoint.revision - version.revision <= bound
        ):
            tensors, held = kept.get(version.revision, (record.capture.tensors, bound))
            kept[version.revision] = (tensors, max(held, bound))
    return kept


def agreed_kept(trainer: Any, exchange: Callable[[Any, str], list[Any]]) -> dict[str, Kept]:
    """Checkpoint name -> the kept versions of every process, on every process (NOTE [Resume] Rules 2 and 5).

    A forward pends on the process that hosts its logical rank (NOTE [Logical ranks] Rule 2), so each process
    says which revisions its forwards need and at which bound; a version keeps the largest. Every process holds
    the same weights at a revision (logical ranks replicate the state), so rank 0's own are written; one that only
    other processes' forwards used is sent by the lowest of them, on the host: the save is the same for any ``W``.
    ``exchange(obj, label)``: every process's ``obj`` by rank, collective.
    """
    local = {c.name: _kept_versions(trainer, c) for c in trainer.checkpoints.values()}
    needs = exchange(
        {name: {r: b for r, (_, b) in kept.items()} for name, kept in local.items()}, "save: kept versions"
    )
    senders = {}  # (name, revision) rank 0 lacks -> the lowest process that holds it
    for rank, part in reversed(list(enumerate(needs))):
        senders.update(
            {(name, r): rank for name, revisions in part.items() for r in revisions if r not in needs[0].get(name, {})}
        )
    sent: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    if senders:  # the same on every process: every one exchanges, or none
        me = dist.get_rank() if dist.is_initialized() else 0
        mine = {
            key: {n: t.detach().cpu() for n, t in local[key[0]][key[1]][0].items()}
            for key, rank in senders.items()
            if rank == me
        }
        for part in exchange(mine, "save: kept weights"):
            sent.update(part)
    agreed: dict[str, Kept] = {}
    for checkpoint in trainer.checkpoints.values():
        name, kept = checkpoint.name, local[checkpoint.name]
        bounds: dict[int, int] = {}
        for part in needs:
            for revision, bound in part.get(name, {}).items():
                bounds[revision] = max(bound, bounds.get(revision, bound))
        agreed[name] = {
            r: (kept[r][0] if r in kept else _received(checkpoint, sent[name, r]), bound)
            for r, bound in sorted(bounds.items())
        }
    return agreed


def _received(checkpoint: Checkpoint, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weights another process sent, as its own capture holds them: on the checkpoint's device, keyed by the very
    name objects of its parameters (the pickler shares them, so the save's bytes match a ``W=1`` one's)."""
    return {name: tensors[name].to(live.device) for name, live in checkpoint.named_parameters()}


def agreed_logprobs(trainer: Any, exchange: Callable[[Any, str], list[Any]]) -> dict[str, list[LogprobRow]]:
    """Checkpoint name -> the current log-probs a pending forward of any process can still use, in a fixed order.

    Each logical rank's come from the process that hosts it; those of the processes' own code are rank 0's, as the
    process RNG is (NOTE [Resume] Rule 5). ``exchange`` as in :func:`agreed_kept`.
    """
    local = trainer.known_logprobs.saved(trainer.records)
    mine = {
        (owner, name, tuple(_autocast_row(autocast)), key): row
        for (owner, name, autocast), known in local.items()
        for key, (_, row) in known.items()
    }
    merged: dict[tuple[int | None, str, tuple[Any, ...], tuple[Any, ...]], torch.Tensor] = {}
    for rank, part in enumerate(exchange({k: v.detach().cpu() for k, v in mine.items()}, "save: known log-probs")):
        merged.update({k: v for k, v in part.items() if k[0] is not None or rank == 0})
    agreed: dict[str, list[LogprobRow]] = {name: [] for name in trainer.checkpoints}
    order = sorted(merged, key=lambda k: (-1 if k[0] is None else k[0], k[1], (k[2][0], k[2][1] or ""), k[3]))
    for owner, name, autocast, key in order:
        agreed[name].append(
            {
                "owner": owner,
                "autocast": list(autocast),
                "inputs": torch.tensor(key[0], dtype=torch.int64),
                "targets": torch.tensor(key[1], dtype=torch.int64),
                "logprobs": merged[owner, name, autocast, key],
            }
        )
    return agreed


def check_logprobs(name: str, rows: object) -> None:
    """Raise ``ConfigError`` unless ``rows`` are a save's log-prob rows of checkpoint ``name``: each an owner (None
    or an int >= 0), an autocast state ``[device type, dtype name or None]``, 1-D int64 ``inputs`` and ``targets``
    and floating ``logprobs`` of one length, no row twice."""
    where = f"saved current log-probs of {name!r}"
    if not isinstance(rows, list):
        raise ConfigError(where, type(rows).__name__, "a list of rows")
    seen = set()
    for index, row in enumerate(rows):
        ok = isinstance(row, dict) and set(row) == _ROW_KEYS and (row["owner"] is None or int_at_least(row["owner"], 0))
        ok = ok and _autocast_state(row["autocast"]) is not None
        tensors = [row[k] for k in ("inputs", "targets", "logprobs")] if ok else []
        ok = ok and all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in tensors)
        ok = ok and tensors[0].dtype == tensors[1].dtype == torch.int64 and tensors[2].is_floating_point()
        ok = ok and len({t.numel() for t in tensors}) == 1 and tensors[0].numel() > 0
        key = (
            (row["owner"], tuple(row["autocast"]), tuple(tensors[0].tolist()), tuple(tensors[1].tolist()))
            if ok
            else None
        )
        if not ok or key in seen:
            raise ConfigError(
                f"{where}, row {index}",
                repr(row)[:200],
                f"a distinct row with keys {sorted(_ROW_KEYS)}: an owner (None or an int >= 0), an "
                "autocast state [device type, a torch dtype's name or None], 1-D "
                "int64 inputs and targets and floating logprobs of one non-zero length",
            )
        seen.add(key)


def resume_logprobs(trainer: Any, checkpoint: Checkpoint, rows: list[LogprobRow]) -> None:
    """Hand ``rows`` (checked) to ``trainer``'s known log-probs, at ``checkpoint``'s restored version."""
    device = next(checkpoint.parameters()).device
    known: dict[Any, dict[Any, Any]] = {}
    for row in rows:
        key = (tuple(row["inputs"].tolist()), tuple(row["targets"].tolist()))
        scope = (row["owner"], checkpoint.name, _autocast_state(row["autocast"]))
        known.setdefault(scope, {})[key] = (checkpoint.version, row["logprobs"].to(device))
    trainer.known_logprobs.resume(known)
