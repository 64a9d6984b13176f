"""ABBA blocks and ratio statistics, driven by a fake clock (no timing in tests)."""

from __future__ import annotations

import pytest

from validation.abba import run_abba, summarize_ratios


class FakeClock:
    """Advances by the cost of whichever arm ran last; a drift term grows every call."""

    def __init__(self, costs: dict[str, float], drift: float = 0.0) -> None:
        self.costs, self.drift, self.now, self.calls, self.pending = costs, drift, 0.0, 0, None

    def arm(self, name: str):
        def run() -> None:
            self.pending = name
        return run

    def __call__(self) -> float:
        if self.pending is not None:
            self.now += self.costs[self.pending] * (1 + self.drift * self.calls)
            self.pending = None
        self.calls += 1
        return self.now


def test_blocks_are_mirrored_and_warmups_discarded() -> None:
    order: list[str] = []
    arms = {name: (lambda n=name: order.append(n)) for name in ("a", "b", "c")}
    seconds = run_abba(arms, blocks=2, warmup_blocks=1, clock=lambda: 0.0)
    assert order == ["a", "b", "c", "c", "b", "a"] * 3
    assert {k: len(v) for k, v in seconds.items()} == {"a": 2, "b": 2, "c": 2}


def test_mirrored_blocks_cancel_linear_drift() -> None:
    clock = FakeClock({"a": 2.0, "b": 1.0}, drift=0.01)
    seconds = run_abba({"a": clock.arm("a"), "b": clock.arm("b")}, blocks=20, warmup_blocks=0, clock=clock)
    (summary,) = summarize_ratios(seconds, "b")
    assert summary.median_ratio == pytest.approx(2.0, rel=2e-3)
    assert summary.verdict == "slower" and summary.ci95[0] > 1.0


def test_equal_arms_are_not_significant() -> None:
    seconds = {"a": [1.0, 1.1, 0.9, 1.05, 0.95], "b": [1.0, 1.0, 1.0, 1.0, 1.0]}
    (summary,) = summarize_ratios(seconds, "b")
    assert summary.verdict == "not significant"
    assert summary.iqr[0] <= summary.median_ratio <= summary.iqr[1]
    assert summary.as_dict()["verdict"] == "not significant"
