"""Fakes for benchmark tests: a clock advanced by fixed per-arm costs, a quiet load probe, a machine meter, a tiny plan.

The arms still do their real (tiny) work, so first losses, bytes held and
allocation peaks are real; only the timing that ``compare`` sees is fake.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from canaries.benchmark import canary as benchmark
from canaries.benchmark.arms import TimedArm, TimedWorkload
from canaries.registry import canary
from validation.evidence import verify
from validation.load import Load

__all__ = ["TINY", "FAKE_PAUSES", "FakeProbe", "FakeMeter", "FakeMachine", "fake_pauses", "tiny_plan", "run_fake"]

TINY = TimedWorkload(model="tiny", sequences=1, seq_len=4)


class FakeProbe:
    def start(self) -> None:
        pass

    def stop(self) -> float:
        return 1.0


class FakeMeter:
    """Reads the given cores busy with other work, block by block (measured blocks only), then ``idle``."""

    def __init__(self, others: Iterable[float] = (), idle: float = 0.0) -> None:
        self.others, self.idle, self.reads = iter(others), idle, 0

    def start(self) -> None:
        pass

    def stop(self) -> Load:
        self.reads += 1
        return Load(next(self.others, self.idle), 2, 0.1, "fake")


class FakeMachine:
    """A clock that advances by a fixed cost per arm run; the timing is fake.

    ``real_steps``: how many runs of each arm do their real work (enough for
    the first-loss check); ``None``: every run (bytes held and allocation
    peaks are then measured on real steps).
    """

    def __init__(self, costs: dict[str, float], real_steps: int | None = None) -> None:
        self.costs, self.now, self.real_steps = costs, 0.0, real_steps

    def clock(self) -> float:
        return self.now

    def build(self, group: benchmark.Group, seed: int) -> dict[str, TimedArm]:
        arms = benchmark.build_arms(group, seed)
        for name, arm in arms.items():
            arm.step = self.advancing(name, arm.step)
        return arms

    def advancing(self, name: str, step: Callable[[], float]) -> Callable[[], float]:
        runs = 0

        def run() -> float:
            nonlocal runs
            runs += 1
            self.now += self.costs.get(name, 1.0)
            return step() if self.real_steps is None or runs <= self.real_steps else 0.0

        return run


FAKE_PAUSES = {
    "workload": TINY.label,
    "bytes": 2**20,
    "published_bytes": 2**19,
    "step_seconds": 0.5,
    "max_blocks": 8,
    "budget_s": 10.0,
    "arms": [
        {
            "arm": arm,
            "blocks": 8,
            "ratio": ratio,
            "ratio_ci": [ratio - 0.1, ratio + 0.1],
            "seconds": ratio / 2,
            "seconds_ci": [ratio / 2 - 0.05, ratio / 2 + 0.05],
            "extra_seconds": ratio / 2 - 0.5,
            "extra_seconds_ci": [ratio / 2 - 0.55, ratio / 2 - 0.45],
            "reading": "measured",
        }
        for arm, ratio in (("save", 0.8), ("load", 0.4), ("offload", 1.2), ("publish", 1.1))
    ],
}


def fake_pauses(monkeypatch) -> None:
    """``rtv bench``'s pause costs stood in by :data:`FAKE_PAUSES` (the real ones save and load real trainers)."""
    monkeypatch.setattr(benchmark, "measure_pauses", lambda workload, profile, **_: FAKE_PAUSES)


def tiny_plan(preset: str, profile: str, profiled_blocks: int = 0) -> benchmark.Plan:
    """One gated tiny workload; constant fake costs decide every verdict at the first look (8 blocks).

    No profiled blocks unless asked (each is two ``torch.profiler`` sessions,
    about 0.1 s each with Python stacks even on a tiny step).
    """
    arms = ("plain", "retain@s0", "replay@s0", "offload@s2")
    return benchmark.Plan((benchmark.Group(TINY, arms, True),), 8, 1e9, False, profiled_blocks)


def run_fake(tmp_path: Path, costs: dict[str, float], real_steps: int | None = None, **kwargs) -> dict:
    machine = FakeMachine(costs, real_steps)
    judged = benchmark.measure(
        "cpu", "quick", clock=machine.clock, load_probe=FakeProbe(), build=machine.build, **kwargs
    )
    return verify(canary("benchmark").record("cpu", judged, tmp_path))
