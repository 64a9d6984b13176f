"""Every check that reads a clock, beside two CPU-bound processes: none reports failed (NOTE [Machine load] Rule 4).

The ``bench`` test starts the hogs itself (by pid, killed by pid in a
``finally``) and runs the real checks beside them: ``compare`` on known work,
the benchmark's and the sweep's ``quick`` profiles, the sweep's step bound.
Each may decide or be ``inconclusive (loaded: ...)``; none may fail, and an
A/A pair is never a gain or a regression. The default-suite sibling runs the
same checks on a fake clock beside a fake load.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import pytest

from canaries.benchmark import canary as benchmark
from canaries.benchmark import sweep
from tests.benchmark_fakes import FakeMachine, FakeMeter, FakeProbe, tiny_plan
from tests.canaries.test_benchmark_sweep import CostClock, median_step, within_bound
from tests.hogs import hogs
from tests.validation.test_abba_timing import work
from validation.abba import compare
from validation.load import Meter


def busy_for(seconds: float):
    """The load over a window of at least ``seconds`` of our own work: long enough that clock ticks do not decide it.

    ``/proc/stat`` counts in ticks (NOTE [Machine load] Rule 1): one ``work`` call
    (about 10 ms) on 2 cores reads within about 2 cores of the truth, either way.
    """
    load = Meter()
    load.start()
    ends = time.perf_counter() + seconds
    while time.perf_counter() < ends:
        work(1.0)()
    return load.stop()


def failed_checks(judged) -> list[str]:
    return [f"{c.name}: {c.detail}" for c in judged.checks if c.failed]


def test_beside_a_fake_load_no_timing_check_fails_and_each_says_it_was_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    busy = functools.partial(FakeMeter, idle=1.9)
    machine = FakeMachine({"plain": 1.0, "retain@s0": 1.5, "replay@s0": 4.5}, real_steps=3)  # would fail, idle
    (a_vs_b,) = compare(
        {"a": machine.advancing("a", lambda: 0.0), "b": machine.advancing("retain@s0", lambda: 0.0)},
        baseline="a",
        clock=machine.clock,
        load_probe=FakeProbe(),
        meter=busy(),
        max_blocks=8,
        budget_s=1e3,
    )
    assert a_vs_b.reading.startswith("inconclusive (loaded: 32 of 32 blocks loaded, median 1.90 of 2 cores")
    monkeypatch.setattr(benchmark, "plan", tiny_plan)
    judged = benchmark.measure(
        "cpu", "quick", clock=machine.clock, load_probe=FakeProbe(), meter=busy(), build=machine.build, target=1.03
    )
    clock = CostClock()
    swept = sweep.measure("cpu", "default", clock=clock, load_probe=FakeProbe(), meter=busy(), build=clock.build)
    for each in (judged, swept):
        assert failed_checks(each) == [] and each.checks.passed
        assert any(c.skipped and c.detail.startswith("inconclusive (loaded: ") for c in each.checks)


@pytest.mark.bench
def test_beside_two_cpu_hogs_no_timing_check_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    planned = benchmark.plan  # no profiled blocks: they read no clock for a check, and cost minutes beside hogs
    monkeypatch.setattr(benchmark, "plan", lambda *a: dataclasses.replace(planned(*a), profiled_blocks=0))
    with hogs(2) as pids:
        assert len(pids) == 2
        (a_vs_a,) = compare(
            {"a": work(1.0), "b": work(1.0)}, baseline="a", max_blocks=64, budget_s=15.0, warmup_blocks=3
        )
        (slower,) = compare(
            {"a": work(1.0), "b": work(1.10)}, baseline="a", max_blocks=64, budget_s=15.0, warmup_blocks=3
        )
        judged = benchmark.measure("cpu", "quick")
        swept = sweep.measure("cpu", "quick", budget_s=15.0)
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            workload = sweep.plan("cpu", "default").workloads[0]
            arms = benchmark.build_arms(benchmark.Group(workload, ("plain",), False), 0)
            bound = sweep.block_bound(workload, ()) / 2
            seconds, reading = median_step(arms["plain"], Meter(), bound)
        finally:
            torch.set_num_threads(before)
        beside = busy_for(1.0)
    assert beside.loaded, f"the hogs did not load the machine: {beside}"  # the test measures what it claims
    assert a_vs_a.verdict not in ("gain", "regression"), a_vs_a.reading
    assert slower.verdict != "gain", slower.reading
    assert failed_checks(judged) == [] and failed_checks(swept) == []
    try:
        within_bound(f"plain at {workload.label}", seconds, bound, reading)
    except pytest.skip.Exception:
        pass  # inconclusive (loaded): what a busy machine may say; a failure would have raised AssertionError
