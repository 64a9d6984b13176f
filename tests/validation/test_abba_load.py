"""``compare`` beside a machine meter (NOTE [Alternating blocks] Rules 4-6), with a fake clock and a fake load.

A loaded block is left out and replaced within the budget; a run the load cut
short is ``inconclusive (loaded: ...)``; an idle machine still decides, a
wrong timing included.
"""

from __future__ import annotations

import pytest

from tests.benchmark_fakes import FakeMeter
from tests.validation.test_abba import FakeMachine, FakeProbe, constant, run
from validation.abba import EXTENSION


def test_load_present_from_the_start_is_flagged_by_the_meter_though_the_share_probe_calibrated_under_it() -> None:
    # The share probe reads 1.0 throughout (it calibrated under the load); the meter sees 1.5 cores of other work.
    meter = FakeMeter([0.0, 0.0, 1.5, 0.0, 0.0, 1.5, 0.0, 0.0])
    (result,) = run(FakeMachine(constant({"base": 1.0, "arm": 1.0})), "base", "arm", max_blocks=8, meter=meter)
    assert result.loaded == (2, 5) and result.blocks == 6 and result.others[2] == 1.5
    assert result.verdict == "tie" and result.load == ""  # 2 of 8 loaded: within max_loaded, decided on the other 6


def test_loaded_blocks_are_replaced_within_the_budget_so_the_run_still_decides() -> None:
    meter = FakeMeter([0.0, 0.0, 1.5, 0.0, 0.0, 1.5])
    (result,) = run(
        FakeMachine(constant({"base": 1.0, "arm": 1.02})), "base", "arm", max_blocks=8, budget_s=1e3, meter=meter
    )
    assert len(result.ratios) == 10 and result.blocks == 8 and result.loaded == (2, 5)
    assert result.looks == (8,) and result.verdict == "tie" and result.load == "" and result.reading == "tie"


@pytest.mark.parametrize("ratio", [1.0, 1.5])
def test_a_machine_loaded_throughout_is_inconclusive_loaded_never_a_verdict(ratio: float) -> None:
    machine = FakeMachine(constant({"base": 1.0, "arm": ratio}))
    (result,) = run(machine, "base", "arm", max_blocks=8, budget_s=1e3, meter=FakeMeter(idle=1.7))
    assert len(result.ratios) == EXTENSION * 8 and result.blocks == 0  # every block replaced, up to the cap
    assert result.verdict == "inconclusive" and result.reading.startswith("inconclusive (loaded: 32 of 32 blocks")
    assert "median 1.70 of 2 cores busy with other work" in result.reading


def test_the_budget_ends_the_replacing_and_the_verdict_is_the_load_s() -> None:
    # Each block costs 4 s; 40 s of budget (warm-ups included) leave room for 8 blocks, half of them loaded.
    meter = FakeMeter([1.2, 0.0] * 20)
    (result,) = run(
        FakeMachine(constant({"base": 1.0, "arm": 1.0})), "base", "arm", max_blocks=8, budget_s=40.0, meter=meter
    )
    assert len(result.ratios) == 8 and result.blocks == 4 and result.load.startswith("4 of 8 blocks loaded")


def test_an_idle_machine_still_decides_a_wrong_timing() -> None:
    """The negative control: a 10% regression on an idle machine is a regression, not an excuse."""
    (result,) = run(
        FakeMachine(constant({"base": 1.0, "arm": 1.10})),
        "base",
        "arm",
        max_blocks=8,
        budget_s=1e3,
        meter=FakeMeter(idle=0.1),
    )
    assert result.verdict == "regression" and result.reading == "regression" and result.load == ""


def test_noise_on_an_idle_machine_is_plain_inconclusive_not_the_load_s() -> None:
    import numpy as np

    noise = np.random.default_rng(2).lognormal(0.0, 0.3, 100_000)
    (result,) = run(
        FakeMachine(lambda name, i: noise[i]), "base", "arm", max_blocks=16, budget_s=1e9, meter=FakeMeter(idle=0.05)
    )
    assert result.verdict == "inconclusive" and result.load == "" and result.reading == "inconclusive"


def test_a_few_loaded_blocks_replaced_to_max_blocks_leave_an_inconclusive_verdict_the_data_s() -> None:
    noise = iter(__import__("numpy").random.default_rng(3).lognormal(0.0, 0.3, 100_000))
    meter = FakeMeter([0.0, 1.5])
    (result,) = run(FakeMachine(lambda name, i: next(noise)), "base", "arm", max_blocks=16, budget_s=1e9, meter=meter)
    assert result.loaded == (1,) and result.blocks == 16 and result.verdict == "inconclusive" and result.load == ""


def test_an_injected_probe_alone_meters_nothing() -> None:
    """Fakes replace the real witnesses as a whole: fake-clock tests never read this machine's load."""
    (result,) = run(
        FakeMachine(constant({"base": 1.0, "arm": 1.0})), "base", "arm", max_blocks=8, load_probe=FakeProbe()
    )
    assert result.others == () and result.verdict == "tie"
