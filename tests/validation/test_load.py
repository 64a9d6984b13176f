"""``validation.load``: Rule 1's arithmetic on faked counters, Rule 2's threshold, Rule 3's fallback, Rule 4's words."""

from __future__ import annotations

import os

import pytest

from validation import load
from validation.load import LOADED_CORES, CpuReading, Load, Meter, between, inconclusive


def test_other_work_is_the_machine_s_busy_seconds_less_the_measurement_s_own_over_the_wall() -> None:
    # 2 s of wall: the machine was busy 3.5 CPU seconds, 1.9 of them this process's and its helpers'.
    reading = between(CpuReading(busy=100.0, own=10.0, wall=50.0), CpuReading(busy=103.5, own=11.9, wall=52.0))
    assert reading.others == pytest.approx((3.5 - 1.9) / 2.0) and reading.seconds == 2.0
    assert reading.loaded and reading.source == "/proc/stat"


@pytest.mark.parametrize(("others", "loaded"), [(0.0, False), (LOADED_CORES, False), (LOADED_CORES + 0.01, True)])
def test_a_window_is_loaded_above_half_a_core_of_other_work(others: float, loaded: bool) -> None:
    assert Load(others, 2, 1.0).loaded is loaded


def test_the_meter_counts_its_helpers_cpu_as_its_own() -> None:
    asked = []
    samples = iter([CpuReading(0.0, 0.0, 0.0), CpuReading(0.0, 0.0, 0.0), CpuReading(2.0, 2.0, 1.0)])

    def sampler(pids):
        asked.append(tuple(pids))
        return next(samples)

    meter = Meter(pids=lambda: (41, 42), sampler=sampler)
    meter.start()
    assert meter.stop() == Load(0.0, os.cpu_count() or 1, 1.0)  # two workers busy, nobody else: not loaded
    assert asked == [(41, 42)] * 3


def test_without_proc_stat_the_load_average_less_this_process_stands_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(load.os, "getloadavg", lambda: (3.25, 0.0, 0.0))
    reading = between(CpuReading(None, 0.0, 0.0), CpuReading(None, 1.0, 1.0))
    assert reading.others == 2.25 and reading.loaded and "load average" in str(reading)


def test_a_real_sample_reads_this_machine_s_counters() -> None:
    first = load.read_cpu([os.getpid()])
    assert first.own >= 0 and first.wall > 0 and (first.busy is None or first.busy > 0)


def test_the_words_of_a_loaded_check() -> None:
    assert inconclusive(Load(1.234, 2, 3.0)) == (
        "inconclusive (loaded: 1.23 of 2 cores busy with other work over 3.0 s (/proc/stat))"
    )
