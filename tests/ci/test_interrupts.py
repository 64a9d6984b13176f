"""Bounded calls and signal handling: the two things that let the launcher always reach its teardown."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from ci.interrupts import CallTimeout, Interrupted, bounded, signals_deferred, signals_raise


def test_bounded_returns_raises_or_times_out():
    assert bounded(lambda x, y=0: x + y, 1, y=2, timeout=5) == 3
    with pytest.raises(ZeroDivisionError):
        bounded(lambda: 1 / 0, timeout=5)
    gate = threading.Event()
    started = time.monotonic()
    with pytest.raises(CallTimeout, match=r"hang did not return within 0\.2 s"):
        bounded(gate.wait, timeout=0.2, name="hang")
    assert time.monotonic() - started < 2
    gate.set()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_interrupts_a_hanging_call_at_once(signum):
    gate = threading.Event()
    threading.Timer(0.1, os.kill, (os.getpid(), signum)).start()
    before = signal.getsignal(signum)
    with pytest.raises(Interrupted) as info, signals_raise():
        bounded(gate.wait, timeout=30, name="hang")
    gate.set()
    assert info.value.signum == signum
    assert signal.getsignal(signum) is before


def test_deferred_signals_are_recorded_not_raised():
    received: list[int] = []
    with signals_deferred(received):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
    assert received == [signal.SIGTERM]
