"""The logical ranks one process hosts run as threads ("fibers"), one at a time, handing a baton.

Each hosted logical rank runs on its own thread, only while it holds the
process's baton (NOTE [Logical ranks] Rule 2, in ``ranks/__init__.py``): the
driver (``rounds.py``) gives it the baton with :meth:`Fiber.step` and it
hands it back at its next collective point with :meth:`Fiber.pause`.

A new thread starts with torch's defaults: grad mode on, no autocast and, on
CUDA, device 0. A fiber therefore runs its body inside the caller's
:class:`ThreadContext`, captured on the caller's thread when the fiber is made
(at ``run_logical`` entry): its grad mode, its autocast state per device type
and the trainer's device (``torch.cuda.device`` for a CUDA device, through
``testing.substitute_device_context`` in tests).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..seams import device_context

__all__ = ["AUTOCAST_DEVICE_TYPES", "Fiber", "FiberCoordinator", "Raise", "Request", "ThreadContext", "current_fiber"]

AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")

_thread = threading.local()


def current_fiber() -> Fiber | None:
    return getattr(_thread, "fiber", None)


@dataclass
class Raise:
    """A reply that makes the paused fiber raise ``error``."""

    error: BaseException


@dataclass
class Request:
    kind: str  # "reduce" | "agree"
    tensor: torch.Tensor | None = None
    error: BaseException | None = None


@dataclass(frozen=True)
class ThreadContext:
    """What a thread inherits from the caller: grad mode, autocast per device type, the trainer's device."""

    grad_enabled: bool
    autocast: tuple[tuple[str, torch.dtype], ...]  # (device type, dtype) for each enabled autocast
    device: torch.device | None

    @classmethod
    def capture(cls, device: torch.device | None) -> ThreadContext:
        """The calling thread's state, to be entered on another thread with :meth:`enter`."""
        autocast = tuple(
            (kind, torch.get_autocast_dtype(kind)) for kind in AUTOCAST_DEVICE_TYPES if torch.is_autocast_enabled(kind)
        )
        return cls(torch.is_grad_enabled(), autocast, device)

    @contextmanager
    def enter(self) -> Iterator[None]:
        with ExitStack() as stack:
            if self.device is not None:
                stack.enter_context(device_context(self.device))
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for kind, dtype in self.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype))
            yield


class Fiber:
    """A logical rank's code on a thread that runs only between ``step`` and its next ``pause``."""

    def __init__(self, logical_rank: int, body: Callable[[], Any], device: torch.device | None = None) -> None:
        self.logical_rank = logical_rank
        self.body = body
        self.request: Request | None = None
        self.reply: Any = None
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self._run = threading.Semaphore(0)
        self._paused = threading.Semaphore(0)
        self._context = ThreadContext.capture(device)
        self._thread = threading.Thread(target=self._main, name=f"logical-rank-{logical_rank}", daemon=True)
        self.started = False

    def _main(self) -> None:
        self._run.acquire()
        _thread.fiber = self
        try:
            with self._context.enter():
                self.result = self.body()
        except BaseException as exc:  # noqa: BLE001 - kept and raised again in the caller's frame
            self.error = exc
        finally:
            self.done = True
            self.request = None
            self._paused.release()

    def step(self, reply: Any = None) -> None:
        """Give this fiber the baton until it pauses or finishes (main thread)."""
        self.reply = reply
        if not self.started:
            self.started = True
            self._thread.start()
        self._run.release()
        self._paused.acquire()
        if self.done:
            self._thread.join()

    def pause(self, request: Request) -> Any:
        """Hand the baton back with ``request``; return the round's reply (fiber thread)."""
        self.request = request
        self._paused.release()
        self._run.acquire()
        self.request = None
        reply, self.reply = self.reply, None
        if isinstance(reply, Raise):
            raise reply.error
        return reply


class FiberCoordinator:
    """The trainer's ``Coordinator`` for one logical rank: agreement is a round (Rule 3)."""

    def agree(self, error: BaseException | None) -> None:
        fiber = current_fiber()
        assert fiber is not None, "logical-rank backward outside its fiber"
        fiber.pause(Request("agree", error=error))
