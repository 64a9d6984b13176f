"""``validation.abba.compare`` driven by a fake clock and a fake load probe (no real timing here)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

import numpy as np
import pytest

from validation.abba import compare

GATE = 0.05


class FakeMachine:
    """Arms advance a fake clock by ``cost(name, run_index)`` seconds; nothing is timed for real."""

    def __init__(self, cost: Callable[[str, int], float]) -> None:
        self.cost, self.now, self.runs, self.order = cost, 0.0, 0, []

    def arm(self, name: str) -> Callable[[], None]:
        def run() -> None:
            self.now += self.cost(name, self.runs)
            self.runs += 1
            self.order.append(name)

        return run

    def arms(self, *names: str) -> dict[str, Callable[[], None]]:
        return {name: self.arm(name) for name in names}

    def clock(self) -> float:
        return self.now


class FakeProbe:
    """Returns the given busy shares block by block (warm-ups first), then 1.0."""

    def __init__(self, shares: Iterable[float] = ()) -> None:
        self.shares = iter(shares)

    def start(self) -> None:
        pass

    def stop(self) -> float:
        return next(self.shares, 1.0)


def constant(costs: dict[str, float]) -> Callable[[str, int], float]:
    return lambda name, run: costs[name]


def run(machine: FakeMachine, *names: str, **kwargs):
    kwargs.setdefault("load_probe", FakeProbe())
    return compare(machine.arms(*names), baseline=names[0], clock=machine.clock, **kwargs)


def test_blocks_alternate_abba_baab_and_warmups_are_discarded() -> None:
    machine = FakeMachine(constant({"a": 1.0, "b": 1.0}))
    (result,) = run(machine, "a", "b", max_blocks=3, warmup_blocks=1)
    assert machine.order == list("abbabaababbabaab")
    assert len(result.ratios) == 3 and result.blocks == 3


@pytest.mark.parametrize(("ratio", "expected"), [(1.10, "regression"), (1.02, "tie"), (0.90, "gain"), (1.04, "tie")])
def test_constant_ratios_are_decided_at_the_first_look(ratio: float, expected: str) -> None:
    (result,) = run(FakeMachine(constant({"base": 1.0, "arm": ratio})), "base", "arm")
    assert result.verdict == expected and result.blocks == 8 and result.looks == (8,)
    assert result.ratio == pytest.approx(ratio) and result.ci95 == (pytest.approx(ratio), pytest.approx(ratio))
    assert (result.arm, result.baseline, result.loaded) == ("arm", "base", ())


def test_symmetric_noise_centres_on_the_true_ratio() -> None:
    noise = np.random.default_rng(1).lognormal(0.0, 0.01, 10_000)
    (result,) = run(FakeMachine(lambda name, i: (1.0 if name == "base" else 1.01) * noise[i]), "base", "arm")
    assert result.verdict == "tie"
    assert result.ci95[0] <= 1.01 <= result.ci95[1] and result.ratio == pytest.approx(1.01, abs=0.01)


def test_linear_drift_in_time_is_cancelled_by_the_alternating_order() -> None:
    # Every run costs 1% more than the one before: over 8 blocks the arm times double.
    machine = FakeMachine(lambda name, i: (2.0 if name == "arm" else 1.0) * (1 + 0.01 * i))
    (result,) = run(machine, "base", "arm", warmup_blocks=1)
    assert result.arm_seconds[-1] > 1.2 * result.arm_seconds[0]  # the drift is real ...
    assert result.ratios == pytest.approx([2.0] * 8, rel=1e-12)  # ... and cancels within each block
    assert not result.drift.significant and result.verdict == "regression"


def test_a_trend_in_the_ratio_is_reported_as_significant_drift() -> None:
    machine = FakeMachine(lambda name, i: 1.0 + (0.002 * i if name == "arm" else 0.0))
    (result,) = run(machine, "base", "arm", max_blocks=16)
    assert result.drift.rho == pytest.approx(1.0) and result.drift.significant


def test_a_noisy_series_stays_inconclusive_through_every_look() -> None:
    noise = np.random.default_rng(2).lognormal(0.0, 0.3, 100_000)
    (result,) = run(FakeMachine(lambda name, i: noise[i]), "base", "arm", max_blocks=64)
    assert result.verdict == "inconclusive" and result.looks == (8, 16, 32, 64) and result.blocks == 64
    low, high = result.ci95
    assert low < 1 - GATE or high > 1 + GATE


def test_loaded_blocks_are_dropped() -> None:
    # Blocks 2 and 5 ran under load (share 0.5 of the calibrated 1.0) and show a bogus 3x ratio.
    loaded = {2, 5}
    shares = [1.0, 1.0] + [0.5 if b in loaded else 1.0 for b in range(8)]
    runs_per_block = 4

    def cost(name: str, i: int) -> float:
        block = i // runs_per_block - 2
        return 3.0 if name == "arm" and block in loaded else 1.0

    (result,) = run(FakeMachine(cost), "base", "arm", max_blocks=8, load_probe=FakeProbe(shares))
    assert result.loaded == (2, 5) and result.blocks == 6
    assert result.ratios[2] == pytest.approx(3.0) and result.ratio == pytest.approx(1.0)
    assert result.verdict == "tie"


def test_too_many_loaded_blocks_make_every_verdict_inconclusive() -> None:
    shares = [1.0, 1.0] + [0.5, 1.0, 1.0] * 30  # a third of the blocks loaded
    (result,) = run(
        FakeMachine(constant({"base": 1.0, "arm": 1.5})), "base", "arm", max_blocks=16, load_probe=FakeProbe(shares)
    )
    assert result.verdict == "inconclusive" and len(result.loaded) > 0.25 * len(result.ratios)
    assert result.ratio == pytest.approx(1.5)  # the data alone would say regression


def test_budget_stops_the_run_and_counts_as_a_look() -> None:
    (result,) = run(FakeMachine(lambda name, i: 1.0 + 0.3 * (i % 3)), "base", "arm", max_blocks=64, budget_s=70.0)
    # Each block costs about 4 x 1.3 s; the budget is on the same clock as the warm-ups.
    assert 10 <= result.blocks <= 14 and result.looks[-1] == result.blocks and len(result.looks) <= 4


def test_one_result_per_other_arm_in_arms_order() -> None:
    machine = FakeMachine(constant({"c": 1.25, "base": 1.0, "a": 0.75}))
    results = compare(machine.arms("c", "base", "a"), baseline="base", clock=machine.clock, load_probe=FakeProbe())
    assert [(r.arm, r.verdict) for r in results] == [("c", "regression"), ("a", "gain")]
    assert results[0].as_dict()["drift"] == {"rho": 0.0, "p_value": 1.0, "significant": False}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"baseline": "zzz"}, "baseline 'zzz'"),
        ({"baseline": "a", "gate": 1.5}, "gate=1.5"),
        ({"baseline": "a", "warmup_blocks": 0}, "warmup_blocks=0"),
        ({"baseline": "a", "budget_s": 0}, "budget_s=0"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(kwargs: dict, message: str) -> None:
    machine = FakeMachine(constant({"a": 1.0, "b": 1.0}))
    with pytest.raises(ValueError, match=message):
        compare(machine.arms("a", "b"), clock=machine.clock, **kwargs)
    assert machine.runs == 0


def simulate(true_ratio: float, *, trials: int, sigma: float = 0.04, seed: int = 0) -> Counter:
    """Verdicts of ``trials`` seeded runs with per-run lognormal noise and planned looks at 8/16/32/64."""
    rng = np.random.default_rng(seed)
    verdicts: Counter = Counter()
    for _ in range(trials):
        noise = rng.lognormal(0.0, sigma, 4 * 66)
        machine = FakeMachine(lambda name, i, noise=noise: (true_ratio if name == "arm" else 1.0) * noise[i])
        (result,) = run(machine, "base", "arm", max_blocks=64)
        verdicts[result.verdict] += 1
    return verdicts


@pytest.mark.parametrize("true_ratio", [1 + GATE, 1 - GATE])
def test_a_ratio_on_the_band_edge_is_rarely_called_outside(true_ratio: float) -> None:
    trials = 300
    verdicts = simulate(true_ratio, trials=trials, seed=int(true_ratio * 100))
    wrong = "regression" if true_ratio > 1 else "gain"
    assert verdicts[wrong] <= 0.05 * trials, verdicts


@pytest.mark.parametrize("true_ratio", [1 + 1.5 * GATE, 1 - 1.5 * GATE])
def test_a_ratio_outside_the_band_is_rarely_called_a_tie(true_ratio: float) -> None:
    trials = 300
    verdicts = simulate(true_ratio, trials=trials, seed=int(true_ratio * 1000))
    right = "regression" if true_ratio > 1 else "gain"
    assert verdicts["tie"] <= 0.05 * trials, verdicts
    assert verdicts[right] >= 0.5 * trials, verdicts  # and the looks still have the power to decide
