"""Bounded SDK calls and signals turned into exceptions: what lets the launcher always reach teardown.

Hand-written because neither the SkyPilot SDK nor the standard library has
it: SkyPilot's ``sky.get`` and friends block without a timeout, and Python's
default SIGTERM kills the process without running ``finally``.

- :func:`bounded` runs one call in a daemon thread and waits at most
  ``timeout`` seconds; past that it raises :class:`CallTimeout` and leaves
  the thread behind (a blocked HTTP read cannot be killed, only abandoned).
  The main thread waits on an event, which a signal interrupts, so SIGINT
  and SIGTERM are handled at once even while a call hangs.
- :func:`signals_raise` turns SIGINT and SIGTERM into :class:`Interrupted`
  for the body; :func:`signals_deferred` records them without raising
  (teardown must not be cut short by a second Ctrl-C or a runner's SIGTERM).
  Both restore the previous handlers; off the main thread they do nothing.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

__all__ = ["CallTimeout", "Interrupted", "bounded", "signals_raise", "signals_deferred"]

T = TypeVar("T")
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class CallTimeout(Exception):
    """An SDK call did not return within its own timeout."""

    def __init__(self, name: str, seconds: float) -> None:
        super().__init__(f"{name} did not return within {seconds:g} s")
        self.name = name
        self.seconds = seconds


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived (a BaseException, like KeyboardInterrupt, so ``except Exception`` lets it pass)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum


def bounded(call: Callable[..., T], *args: Any, timeout: float, name: str | None = None, **kwargs: Any) -> T:
    """``call(*args, **kwargs)``, or :class:`CallTimeout` after ``timeout`` seconds; its own errors propagate."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = call(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = error
        finally:
            done.set()

    threading.Thread(target=target, name=f"bounded:{name or call.__name__}", daemon=True).start()
    if not done.wait(timeout):
        raise CallTimeout(name or getattr(call, "__name__", "call"), timeout)
    if "error" in box:
        raise box["error"]
    return box["value"]


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def _handlers(handler: Callable[[int, Any], None]) -> Iterator[None]:
    if not _on_main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, handler) for signum in _SIGNALS}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


@contextmanager
def signals_raise() -> Iterator[None]:
    """SIGINT/SIGTERM raise :class:`Interrupted` in the main thread while the body runs."""

    def handler(signum: int, _frame: Any) -> None:
        raise Interrupted(signum)

    with _handlers(handler):
        yield


@contextmanager
def signals_deferred(received: list[int]) -> Iterator[None]:
    """SIGINT/SIGTERM are appended to ``received`` and otherwise ignored while the body runs."""

    def handler(signum: int, _frame: Any) -> None:
        received.append(signum)

    with _handlers(handler):
        yield
