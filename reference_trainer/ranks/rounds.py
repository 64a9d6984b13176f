"""Rounds: at every collective point all processes exchange what each hosted logical rank asked for.

By Rules 3 and 6 of NOTE [Logical ranks] (``ranks/__init__.py``), every process
runs its fibers to their next collective point (each on its own RNG stream,
Rule 2), then all processes exchange the requests and act together (a
reduce, a backward's agreement), or fail every logical rank the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import GradientCommitError, PeerError
from ..peers import PeerFailure, mark_from_peer
from ..rng import rng_state, set_rng_state
from .fibers import Fiber, Raise, Request
from .layout import ordered_sum
from .state import LogicalState

__all__ = ["drive"]


@dataclass(frozen=True)
class _Status:
    logical_rank: int
    kind: str  # "reduce" | "agree" | "done" | "error"
    detail: Any = None


def _where(state: LogicalState, logical_rank: int) -> str:
    return f"logical rank {logical_rank} (physical rank {state.layout.rank})"


def _request(fiber: Fiber) -> Request:
    """The request of a fiber that is not done: it paused in this round with one."""
    assert fiber.request is not None, f"logical rank {fiber.logical_rank} paused without a request"
    return fiber.request


def _reduced(fiber: Fiber) -> torch.Tensor:
    """The tensor a fiber paused to reduce."""
    tensor = _request(fiber).tensor
    assert tensor is not None, "a reduce request carries its tensor"
    return tensor


def _status(state: LogicalState, fiber: Fiber, share: bool) -> _Status:
    logical_rank = fiber.logical_rank
    if fiber.done:
        if fiber.error is not None:
            return _Status(
                logical_rank, "error", PeerFailure.of(fiber.error, _where(state, logical_rank), logical_rank)
            )
        return _Status(logical_rank, "done", fiber.result if share else None)
    request = _request(fiber)
    if request.kind == "reduce":
        tensor = _reduced(fiber)
        return _Status(logical_rank, "reduce", (tuple(tensor.shape), str(tensor.dtype)))
    error = request.error
    return _Status(
        logical_rank,
        "agree",
        None if error is None else PeerFailure.of(error, _where(state, logical_rank), logical_rank),
    )


def drive(state: LogicalState, label: str, bodies: Mapping[int, Callable[[], Any]], share: bool = False) -> list[Any]:
    """Run one body per hosted logical rank through rounds; results by logical rank (all of them if ``share``)."""
    fibers = [Fiber(logical_rank, body, state.device) for logical_rank, body in bodies.items()]
    caller = rng_state(state.device)
    replies: dict[int, Any] = {f.logical_rank: None for f in fibers}
    try:
        while True:
            for fiber in fibers:
                if not fiber.done:
                    with state.as_rank(fiber.logical_rank):
                        fiber.step(replies[fiber.logical_rank])
            local = [_status(state, f, share) for f in fibers]
            statuses = [s for part in state.comm.exchange(local, label) for s in part]
            if all(s.kind in ("done", "error") for s in statuses):
                return _finish(statuses, fibers, share)
            replies = _decide(state, label, statuses, fibers)
    except BaseException as exc:
        _unwind(fibers, exc, label)
        raise
    finally:
        set_rng_state(caller, state.device)


def _decide(state: LogicalState, label: str, statuses: list[_Status], fibers: list[Fiber]) -> dict[int, Any]:
    kinds = {s.kind for s in statuses}
    if kinds == {"reduce"}:
        if len({s.detail for s in statuses}) == 1:
            mine = torch.stack([_reduced(f).detach() for f in fibers])  # (L/W, *shape)
            total = ordered_sum(list(state.comm.all_gather(mine, label)))
            return {f.logical_rank: total.to(_reduced(f).device).clone() for f in fibers}
        found = ", ".join(f"logical rank {s.logical_rank}: {s.detail[0]} {s.detail[1]}" for s in statuses)
        message = f"{label}: reduce expects one shape and dtype on every logical rank, found {found}"
        return {f.logical_rank: Raise(PeerError(message, command=label)) for f in fibers}
    if kinds == {"agree"}:
        failed = [s for s in statuses if s.detail is not None]
        common = min(failed, key=lambda s: (s.detail.from_peer, s.logical_rank)) if failed else None
        if common is None:
            state.sums.complete(label)  # every logical rank committed: fold the round across processes (Rule 4)
        replies: dict[int, Any] = {}
        for fiber in fibers:
            if common is None or common.logical_rank == fiber.logical_rank:
                replies[fiber.logical_rank] = None  # success, or its own error: the trainer raises it
            else:
                replies[fiber.logical_rank] = Raise(_as_commit_error(common.detail))
        return replies
    failed = [s for s in statuses if s.kind == "error"]
    root = min(failed, key=lambda s: (s.detail.from_peer, s.logical_rank)) if failed else None
    replies = {}
    for fiber in fibers:
        if fiber.done:
            continue
        if root is not None:
            cause = f"logical rank {root.logical_rank} raised {root.detail.name}: {root.detail.text}"
        else:
            doings = ", ".join(f"logical rank {s.logical_rank} {_doing(s.kind)}" for s in statuses)
            cause = f"logical ranks diverged: {doings}"
            cause += "; every logical rank must call reduce and backward the same number of times, in the same order"
        doing = _doing(_request(fiber).kind)
        if _request(fiber).kind == "agree":
            error: BaseException = GradientCommitError(
                f"{label}: backward committed nothing: {cause} while this one {doing}"
            )
        else:
            error = PeerError(f"{label}: {cause} while logical rank {fiber.logical_rank} {doing}", command=label)
        replies[fiber.logical_rank] = Raise(mark_from_peer(error) if root is not None else error)
    return replies


def _doing(kind: str) -> str:
    return {"reduce": "called reduce", "agree": "was in backward", "done": "returned", "error": "raised"}[kind]


def _as_commit_error(failure: PeerFailure) -> BaseException:
    """What a backward raises when a peer's backward failed: its error if a commit error, else a wrapper."""
    rebuilt = failure.rebuild()
    if not isinstance(rebuilt, GradientCommitError):
        rebuilt = GradientCommitError(
            f"backward failed and committed nothing: {failure.where} raised {failure.name}: {failure.text}"
        )
    return mark_from_peer(rebuilt)


def _finish(statuses: list[_Status], fibers: list[Fiber], share: bool) -> list[Any]:
    failed = [s for s in statuses if s.kind == "error"]
    if failed:
        root = min(failed, key=lambda s: (s.detail.from_peer, s.logical_rank))
        mine = [f for f in fibers if f.logical_rank == root.logical_rank]
        if mine and mine[0].error is not None:
            raise mine[0].error
        raise root.detail.rebuild()
    if share:
        return [s.detail for s in statuses]
    return [f.result for f in fibers]


def _unwind(fibers: list[Fiber], exc: BaseException, label: str) -> None:
    """Let every paused fiber raise, so its backward rolls back and its thread ends."""
    message = f"{label}: stopped because {type(exc).__name__}: {exc}"
    for _ in range(16):
        waiting = [f for f in fibers if not f.done and f.started]
        if not waiting:
            return
        for fiber in waiting:
            fiber.step(Raise(mark_from_peer(PeerError(message, command=label))))
