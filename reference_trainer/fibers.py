"""The logical ranks one process hosts: their state, their threads ("fibers") and the rounds they meet in.

Each hosted logical rank runs on its own thread, only while it holds the
process's baton, and draws from its own RNG stream (NOTE [Logical ranks]
Rule 2, in ``ranks.py``); at every collective point all processes exchange
what each logical rank asked for and act together, or fail every logical rank
the same way (Rules 3 and 6). :class:`_LogicalState` is what a trainer keeps
for its logical ranks between calls: layout, transport, gradient buffers, RNG
streams and zero-mode outputs.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .commit import BufferGradSink
from .errors import GradientCommitError, PeerError
from .layout import LogicalLayout, ordered_sum
from .peers import _Comm, _Failure, _from_peer

__all__: list[str] = []

# --- per-trainer state: RNG streams (Rule 2) and buffers (Rule 5) -------------------


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _seeded_state(seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The RNG state ``manual_seed(seed)`` would give, without touching the live generators."""
    cpu = torch.Generator().manual_seed(seed).get_state()
    if device.type != "cuda":
        return cpu, None
    return cpu, torch.Generator(device=device).manual_seed(seed).get_state()


def _stream_seed(seed: int, logical_rank: int) -> int:
    digest = hashlib.sha256(f"{seed}/{logical_rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class _LogicalState:
    """A trainer's logical layout, transport, gradient buffers, RNG streams and zero-mode outputs."""

    def __init__(self, layout: LogicalLayout, comm: _Comm, seed: int, device: torch.device) -> None:
        self.layout = layout
        self.comm = comm
        self.device = device
        self.buffers = {lr: BufferGradSink() for lr in layout.hosted}
        self.rng = {lr: _seeded_state(_stream_seed(seed, lr), device) for lr in layout.hosted}
        self.commands = 0
        self.leading = False  # rank 0 is inside a zero-mode fn
        # Zero mode: the outputs hosted here by handle; on rank 0 also the caller's copies,
        # their logical ranks and the handles of copies the caller dropped (sent with the next command).
        self.outputs: dict[int, tuple[int, torch.Tensor]] = {}
        self.proxies: dict[int, weakref.ref[torch.Tensor]] = {}
        self.owners: dict[int, int] = {}
        self.dropped: list[int] = []
        self.next_handle = 0

    def busy(self) -> bool:
        return bool(self.outputs or self.proxies) or any(b.grads for b in self.buffers.values())

    def label(self, command: str) -> str:
        self.commands += 1
        return f"{command} (#{self.commands})"


# --- fibers and rounds (Rules 2-3) ---------------------------------------------------

_thread = threading.local()


def _current_fiber() -> _Fiber | None:
    return getattr(_thread, "fiber", None)


@dataclass
class _Raise:
    error: BaseException


@dataclass
class _Request:
    kind: str  # "reduce" | "agree"
    tensor: torch.Tensor | None = None
    error: BaseException | None = None


class _Fiber:
    """A logical rank's code on a thread that runs only between ``step`` and its next ``pause``."""

    def __init__(self, logical_rank: int, body: Callable[[], Any]) -> None:
        self.logical_rank = logical_rank
        self.body = body
        self.request: _Request | None = None
        self.reply: Any = None
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self._run = threading.Semaphore(0)
        self._paused = threading.Semaphore(0)
        self._grad_enabled = torch.is_grad_enabled()
        self._thread = threading.Thread(target=self._main, name=f"logical-rank-{logical_rank}", daemon=True)
        self._started = False

    def _main(self) -> None:
        self._run.acquire()
        _thread.fiber = self
        try:
            with torch.set_grad_enabled(self._grad_enabled):
                self.result = self.body()
        except BaseException as exc:
            self.error = exc
        finally:
            self.done = True
            self.request = None
            self._paused.release()

    def step(self, reply: Any = None) -> None:
        """Give this fiber the baton until it pauses or finishes (main thread)."""
        self.reply = reply
        if not self._started:
            self._started = True
            self._thread.start()
        self._run.release()
        self._paused.acquire()
        if self.done:
            self._thread.join()

    def pause(self, request: _Request) -> Any:
        """Hand the baton back with ``request``; return the round's reply (fiber thread)."""
        self.request = request
        self._paused.release()
        self._run.acquire()
        self.request = None
        reply, self.reply = self.reply, None
        if isinstance(reply, _Raise):
            raise reply.error
        return reply


@dataclass(frozen=True)
class _Status:
    logical_rank: int
    kind: str  # "reduce" | "agree" | "done" | "error"
    detail: Any = None


class _FiberCoordinator:
    """The trainer's ``Coordinator`` for one logical rank: agreement is a round (Rule 3)."""

    def agree(self, error: BaseException | None) -> None:
        fiber = _current_fiber()
        assert fiber is not None, "logical-rank backward outside its fiber"
        fiber.pause(_Request("agree", error=error))


def _where(state: _LogicalState, logical_rank: int) -> str:
    return f"logical rank {logical_rank} (physical rank {state.layout.rank})"


def _status(state: _LogicalState, fiber: _Fiber, share: bool) -> _Status:
    lr = fiber.logical_rank
    if fiber.done:
        if fiber.error is not None:
            return _Status(lr, "error", _Failure.of(fiber.error, _where(state, lr), lr))
        return _Status(lr, "done", fiber.result if share else None)
    request = fiber.request
    if request.kind == "reduce":
        return _Status(lr, "reduce", (tuple(request.tensor.shape), str(request.tensor.dtype)))
    error = request.error
    return _Status(lr, "agree", None if error is None else _Failure.of(error, _where(state, lr), lr))


def _drive(state: _LogicalState, label: str, bodies: dict[int, Callable[[], Any]], share: bool = False) -> list[Any]:
    """Run one body per hosted logical rank through rounds; results by logical rank (all of them if ``share``)."""
    fibers = [_Fiber(lr, body) for lr, body in bodies.items()]
    caller = _rng_state(state.device)
    replies: dict[int, Any] = {f.logical_rank: None for f in fibers}
    try:
        while True:
            for fiber in fibers:
                if not fiber.done:
                    _set_rng_state(state.rng[fiber.logical_rank], state.device)
                    fiber.step(replies[fiber.logical_rank])
                    state.rng[fiber.logical_rank] = _rng_state(state.device)
            local = [_status(state, f, share) for f in fibers]
            statuses = [s for part in state.comm.exchange(local, label) for s in part]
            if all(s.kind in ("done", "error") for s in statuses):
                return _finish(statuses, fibers, share)
            replies = _decide(state, label, statuses, fibers)
    except BaseException as exc:
        _unwind(fibers, exc, label)
        raise
    finally:
        _set_rng_state(caller, state.device)


def _decide(state: _LogicalState, label: str, statuses: list[_Status], fibers: list[_Fiber]) -> dict[int, Any]:
    kinds = {s.kind for s in statuses}
    if kinds == {"reduce"}:
        if len({s.detail for s in statuses}) == 1:
            mine = torch.stack([f.request.tensor.detach() for f in fibers])  # (L/W, *shape)
            total = ordered_sum(list(state.comm.all_gather(mine, label)))
            return {f.logical_rank: total.to(f.request.tensor.device).clone() for f in fibers}
        found = ", ".join(f"logical rank {s.logical_rank}: {s.detail[0]} {s.detail[1]}" for s in statuses)
        message = f"{label}: reduce expects one shape and dtype on every logical rank, found {found}"
        return {f.logical_rank: _Raise(PeerError(message, command=label)) for f in fibers}
    if kinds == {"agree"}:
        failed = [s for s in statuses if s.detail is not None]
        common = min(failed, key=lambda s: (s.detail.from_peer, s.logical_rank)) if failed else None
        replies: dict[int, Any] = {}
        for fiber in fibers:
            if common is None or common.logical_rank == fiber.logical_rank:
                replies[fiber.logical_rank] = None  # success, or its own error: the trainer raises it
            else:
                replies[fiber.logical_rank] = _Raise(_as_commit_error(common.detail))
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
        doing = _doing(fiber.request.kind)
        if fiber.request.kind == "agree":
            error: BaseException = GradientCommitError(
                f"{label}: backward committed nothing: {cause} while this one {doing}"
            )
        else:
            error = PeerError(f"{label}: {cause} while logical rank {fiber.logical_rank} {doing}", command=label)
        replies[fiber.logical_rank] = _Raise(_from_peer(error) if root is not None else error)
    return replies


def _doing(kind: str) -> str:
    return {"reduce": "called reduce", "agree": "was in backward", "done": "returned", "error": "raised"}[kind]


def _as_commit_error(failure: _Failure) -> BaseException:
    """What a backward raises when a peer's backward failed: its error if a commit error, else a wrapper."""
    rebuilt = failure.rebuild()
    if not isinstance(rebuilt, GradientCommitError):
        rebuilt = GradientCommitError(
            f"backward failed and committed nothing: {failure.where} raised {failure.name}: {failure.text}"
        )
    return _from_peer(rebuilt)


def _finish(statuses: list[_Status], fibers: list[_Fiber], share: bool) -> list[Any]:
    failed = [s for s in statuses if s.kind == "error"]
    if failed:
        root = min(failed, key=lambda s: (s.detail.from_peer, s.logical_rank))
        mine = [f for f in fibers if f.logical_rank == root.logical_rank]
        if mine:
            raise mine[0].error
        raise root.detail.rebuild()
    if share:
        return [s.detail for s in statuses]
    return [f.result for f in fibers]


def _unwind(fibers: list[_Fiber], exc: BaseException, label: str) -> None:
    """Let every paused fiber raise, so its backward rolls back and its thread ends."""
    message = f"{label}: stopped because {type(exc).__name__}: {exc}"
    for _ in range(16):
        waiting = [f for f in fibers if not f.done and f._started]
        if not waiting:
            return
        for fiber in waiting:
            fiber.step(_Raise(_from_peer(PeerError(message, command=label))))

