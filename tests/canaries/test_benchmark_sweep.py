"""The cost-growth sweep: its grids per preset and profile, its budget, and a fit that recovers known costs.

Timing is faked (``CostClock``); the run that really sweeps is the GPU one
(tests/gpu/test_cuda_sweep.py) and ``rtv bench --profile default`` itself.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from canaries.benchmark import canary as benchmark
from canaries.benchmark import sweep
from canaries.benchmark.arms import TimedWorkload
from canaries.cli import main
from tests.benchmark_fakes import FakeMachine, FakeMeter, FakeProbe, fake_pauses, tiny_plan
from validation.load import Load, Meter, inconclusive

# Known costs (seconds): fixed, per token, per token² (B*T**2), per arm.
COSTS = {"plain": (2e-3, 1e-5, 0.0), "retain@s0": (3e-3, 1e-5, 0.0), "replay@s0": (2e-3, 1.4e-5, 2e-9)}


class CostClock:
    """A fake clock advanced by each arm's known cost at the shape it was built for (``factor`` times it: load).

    Each run returns a fake loss of 1.0 (the sweep's like-with-like check reads it).
    """

    def __init__(self) -> None:
        self.now, self.factor = 0.0, 1.0

    def __call__(self) -> float:
        return self.now

    def build(self, group, seed: int) -> dict:
        batch, length = group.workload.sequences, group.workload.seq_len

        def arm(name: str):
            fixed, per_token, per_token2 = COSTS[name]
            cost = fixed + per_token * batch * length + per_token2 * batch * length**2

            def run() -> float:
                self.now += cost * self.factor
                return 1.0

            return run

        return {name: arm(name) for name in group.arms}


def test_the_fit_recovers_known_fixed_per_token_and_quadratic_costs() -> None:
    clock = CostClock()
    judged = sweep.measure("cpu", "default", clock=clock, load_probe=FakeProbe(), build=clock.build)
    fits = judged.measurements["fits"]
    assert set(fits) == {"plain", "retain@s0", "replay@s0"} and judged.checks.passed
    for arm, known in COSTS.items():
        assert [fits[arm][t] for t in sweep.TERMS] == pytest.approx(known, rel=1e-6, abs=1e-12)
        assert max(map(abs, fits[arm]["residuals"])) < 1e-12
    points = judged.measurements["points"]
    assert [(p["batch"], p["seq_len"]) for p in points] == [(1, 32), (4, 32), (1, 128), (4, 128)]
    # a fixed extra cost: the ratio falls with tokens; the fit's model agrees with the closed form
    ratios = [next(c for c in p["comparisons"] if c["arm"] == "retain@s0")["ratio"] for p in points]
    assert ratios[0] > ratios[1] > ratios[3]
    closed = (3e-3 + 1e-5 * 4096) / (2e-3 + 1e-5 * 4096)
    assert sweep.predicted_ratio(fits["retain@s0"], fits["plain"], 4, 1024) == pytest.approx(closed, rel=1e-6)
    model = judged.measurements["model"]
    assert model["note"] == "model, not a measurement"
    assert [(s["batch"], s["seq_len"]) for s in model["shapes"]] == [(4, 1024), (4, 4096)]
    assert model["shapes"][0]["ratios"]["retain@s0"] == pytest.approx(closed, rel=1e-6)
    quadratic = (2e-3 + 1.4e-5 * 4 * 4096 + 2e-9 * 4 * 4096**2) / (2e-3 + 1e-5 * 4 * 4096)
    assert model["shapes"][1]["ratios"]["replay@s0"] == pytest.approx(quadratic, rel=1e-6)
    assert model["ratios"]["replay@s0"] == sorted(model["ratios"]["replay@s0"]), "a per-token² cost: rising"


class LoadedBlocks(FakeMeter):
    """A machine meter that finds two blocks of every three loaded and slows every arm 3x while they run."""

    def __init__(self, clock: CostClock) -> None:
        super().__init__()
        self.clock, self.loaded = clock, False

    def start(self) -> None:
        self.loaded = self.reads % 3 != 0
        self.clock.factor = 3.0 if self.loaded else 1.0

    def stop(self) -> Load:
        self.clock.factor = 1.0
        self.reads += 1
        return Load(1.5 if self.loaded else 0.0, 2, 0.1, "fake")


def test_blocks_the_load_probe_flagged_are_left_out_of_the_fit() -> None:
    """The loaded blocks (3x slower) are most of each shape's blocks: kept in the medians, they would triple the fit."""
    clock = CostClock()
    judged = sweep.measure(
        "cpu", "default", clock=clock, load_probe=FakeProbe(), meter=LoadedBlocks(clock), build=clock.build
    )
    fits = judged.measurements["fits"]
    for point in judged.measurements["points"]:
        comparison = point["comparisons"][0]
        assert len(comparison["loaded"]) > len(comparison["ratios"]) / 2  # the load is real in the data ...
    for arm, known in COSTS.items():  # ... and absent from the fit
        assert [fits[arm][t] for t in sweep.TERMS] == pytest.approx(known, rel=1e-6, abs=1e-12)


def test_a_sweep_whose_shapes_were_all_loaded_skips_its_fit_as_loaded_and_still_passes() -> None:
    clock = CostClock()
    judged = sweep.measure(
        "cpu", "default", clock=clock, load_probe=FakeProbe(), meter=FakeMeter(idle=1.6), build=clock.build
    )
    checks = {c.name: c for c in judged.checks}
    fit = checks["every arm's costs were fitted"]
    assert fit.skipped and fit.detail.startswith("inconclusive (loaded: 4 of 4 shapes fully loaded (32 of 32 blocks")
    assert "1.60 of 2 cores busy with other work" in fit.detail
    assert judged.checks.passed and not checks["at every shape, every arm's first loss equals plain's"].skipped


def test_rtv_bench_on_a_loaded_machine_exits_0_and_prints_the_skip_with_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    clock = CostClock()
    monkeypatch.setattr(
        sweep,
        "measure",
        functools.partial(
            sweep.measure, clock=clock, load_probe=FakeProbe(), meter=FakeMeter(idle=1.6), build=clock.build
        ),
    )
    assert main(["bench", "--sweep", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "SKIP  every arm's costs were fitted: inconclusive (loaded: 4 of 4 shapes fully loaded" in out
    assert "→ inconclusive (loaded: 32 of 32 blocks loaded, median 1.60 of 2 cores busy with other work)" in out


def test_a_sweep_whose_arms_disagree_on_the_first_loss_fails_whatever_the_load() -> None:
    clock = CostClock()

    def unlike(group, seed):
        arms = clock.build(group, seed)
        arms["retain@s0"] = lambda: 2.0
        return arms

    judged = sweep.measure(
        "cpu", "default", clock=clock, load_probe=FakeProbe(), meter=FakeMeter(idle=1.6), build=unlike
    )
    assert not judged.checks.passed


def test_noisy_costs_leave_residuals_and_a_fit_near_the_truth() -> None:
    """Negative control for the residuals: 2% scatter on each point shows in them, the fit stays close."""
    import numpy as np

    rng = np.random.default_rng(0)
    batches, lengths = [1, 4, 8] * 3, [64] * 3 + [256] * 3 + [1024] * 3
    fixed, per_token = 2e-3, 1e-5
    seconds = [(fixed + per_token * b * t) * rng.lognormal(0, 0.02) for b, t in zip(batches, lengths)]
    fitted = sweep.fit(batches, lengths, seconds)
    assert max(map(abs, fitted["residuals"])) > 1e-6
    assert fitted["per_token"] == pytest.approx(per_token, rel=0.1)


def _fake_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = CostClock()
    monkeypatch.setattr(
        sweep, "measure", functools.partial(sweep.measure, clock=clock, load_probe=FakeProbe(), build=clock.build)
    )


def _records(folder: Path) -> dict[str, dict]:
    return {r["kind"]: r for r in (json.loads(p.read_text()) for p in folder.glob("bench-*/benchmark-*.json"))}


@pytest.mark.slow  # the default-profile test below covers the sweep's record and report; this, --sweep alone
def test_rtv_bench_sweep_runs_only_the_sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_sweep(monkeypatch)
    assert main(["bench", "--sweep", "--out", str(tmp_path)]) == 0
    assert set(_records(tmp_path)) == {"benchmark-sweep"}


@pytest.mark.slow  # a benchmark and a sweep (about 1 s); the sweep alone runs by default
def test_rtv_bench_default_runs_the_benchmark_then_the_sweep_and_reports_the_fit_with_residuals_and_the_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``--profile quick`` runs no sweep: test_benchmark.py's exit-code test finds exactly one record there."""
    _fake_sweep(monkeypatch)
    machine = FakeMachine({"retain@s0": 1.0}, real_steps=3)
    monkeypatch.setattr(benchmark, "plan", tiny_plan)
    fake_pauses(monkeypatch)
    monkeypatch.setattr(
        benchmark,
        "measure",
        functools.partial(benchmark.measure, clock=machine.clock, load_probe=FakeProbe(), build=machine.build),
    )
    assert main(["bench", "--profile", "default", "--out", str(tmp_path)]) == 0
    records = _records(tmp_path)
    assert set(records) == {"benchmark", "benchmark-sweep"}
    record = records["benchmark-sweep"]
    assert record["config"]["profile"] == "default" and record["passed"]
    html = Path(capsys.readouterr().out.rsplit("report: ", 1)[1].strip())
    assert (html.parent / "plots" / f"sweep-{record['digest'][:12]}-ratios.png").exists()
    page = html.with_suffix(".md").read_text()
    assert "Cost growth sweep (default)" in page and "Cost fit" in page and "Residuals" in page
    assert "model, not a measurement" in page and "4×1024" in page and "4×4096" in page


def test_the_cpu_nightly_grid_is_64_to_1024_tokens_by_batch_1_4_8_for_every_placement_and_staleness() -> None:
    nightly = sweep.plan("cpu", "nightly")
    assert sorted({(w.sequences, w.seq_len) for w in nightly.workloads}) == [
        (b, t) for b in (1, 4, 8) for t in (64, 128, 256, 512, 1024)
    ]
    assert len(nightly.workloads) == 15 and {w.model for w in nightly.workloads} == {"small"}
    assert sorted(nightly.arms) == sorted(f"{p}@s{s}" for p in ("retain", "offload", "replay") for s in (0, 2))
    default = sweep.plan("cpu", "default")
    assert len(default.workloads) >= len(sweep.TERMS) + 1, "a fit of three terms needs a residual to show"
    assert len({w.seq_len for w in default.workloads}) >= 2 and len({w.sequences for w in default.workloads}) >= 2


@pytest.mark.parametrize(("preset", "model"), [("gpu", "small"), ("gpu-8b", "qwen3_8b")])
@pytest.mark.parametrize("profile", ["quick", "default", "nightly"])
def test_a_gpu_preset_sweeps_4x_1k_2k_4k_on_its_model_like_the_seed(preset: str, model: str, profile: str) -> None:
    planned = sweep.plan(preset, profile, cuda=True)
    expected = [
        TimedWorkload(model=model, sequences=4, seq_len=t, lora=True, dtype="bfloat16", device="cuda")
        for t in (1024, 2048, 4096)
    ]
    assert list(planned.workloads) == expected and not planned.swapped
    swapped = sweep.plan(preset, profile, cuda=False)  # no CUDA: the same code path on tiny CPU shapes, said so
    assert swapped.swapped and {w.device for w in swapped.workloads} == {"cpu"} and swapped.arms == planned.arms


def test_the_default_sweep_fits_its_budget_and_leaves_the_benchmark_its_own_within_5_minutes() -> None:
    """Rule 4 of NOTE [Cost growth], by construction: no timing, the planned blocks at the measured bound."""
    default = sweep.plan("cpu", "default")
    assert sweep.seconds_bound(default) <= default.budget_s
    bench = benchmark.plan("cpu", "default")
    assert bench.budget_s + default.budget_s + sweep.OUTSIDE_S <= sweep.RUN_BUDGETS_S["default"] == 300.0
    # the bound is not vacuous: the nightly grid's blocks would not fit default's budget
    assert sweep.seconds_bound(sweep.plan("cpu", "nightly")) > 10 * default.budget_s


def test_a_shape_s_share_of_the_budget_follows_its_block_bound() -> None:
    small, large = (TimedWorkload(model="small", sequences=b, seq_len=t) for b, t in ((1, 32), (4, 128)))
    assert sweep.block_bound(large, ("retain@s0",)) > 2 * sweep.block_bound(small, ("retain@s0",))
    assert sweep.block_bound(small, ("retain@s0", "replay@s0")) > sweep.block_bound(small, ("retain@s0",))
    step = sweep.block_bound(small, ()) / 2  # plain alone, twice a block
    assert step == pytest.approx(sum(c * x for c, x in zip(sweep.STEP_BOUND, (1, 32, 32**2))))


def test_each_shape_gets_the_share_of_the_budget_its_block_bound_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    given = []

    def recording(arms, **kwargs):
        given.append(kwargs["budget_s"])
        return real_compare(arms, **kwargs)

    real_compare = sweep.compare
    monkeypatch.setattr(sweep, "compare", recording)
    clock = CostClock()
    sweep.measure("cpu", "default", clock=clock, load_probe=FakeProbe(), build=clock.build)
    default = sweep.plan("cpu", "default")
    bounds = [sweep.block_bound(w, default.arms) for w in default.workloads]
    assert sum(given) == pytest.approx(default.budget_s)
    assert given == pytest.approx([default.budget_s * b / sum(bounds) for b in bounds])
    assert given[-1] > 3 * given[0], "4x128 asks for more than 1x32"


def median_step(arm, meter, bound: float, tries: int = 3) -> tuple[float, Load]:
    """The median of 5 timed steps after 2 warm-ups, re-timed up to ``tries`` times while the machine is loaded or
    the median is over ``bound`` (a short window's noise is not the step's cost: the blocks are extended first)."""
    import time

    arm(), arm()
    for _ in range(tries):
        seconds = []
        meter.start()
        for _ in range(5):
            start = time.perf_counter()
            arm()
            seconds.append(time.perf_counter() - start)
        reading = meter.stop()
        if not reading.loaded and sorted(seconds)[2] <= bound:
            break
    return sorted(seconds)[2], reading


def within_bound(name: str, seconds: float, bound: float, reading: Load) -> None:
    """Fails a step over its bound on an unloaded machine; on a loaded one, skips with the measured load."""
    if seconds > bound and reading.loaded:
        pytest.skip(f"{name}: {seconds:.3f} s > {bound:.3f} s, {inconclusive(reading)}")
    assert seconds <= bound, f"{name}: {seconds:.3f} s > {bound:.3f} s ({reading})"


@pytest.mark.parametrize(
    ("seconds", "others", "outcome"), [(0.088, 1.4, "skipped"), (0.088, 0.1, "failed"), (0.050, 1.4, "passed")]
)
def test_a_step_over_its_bound_is_inconclusive_loaded_on_a_busy_machine_and_a_failure_on_an_idle_one(
    seconds: float, others: float, outcome: str
) -> None:
    reading = Load(others, 2, 0.5, "fake")
    try:
        within_bound("plain at small 4x32", seconds, 0.065, reading)
    except pytest.skip.Exception as skipped:
        assert outcome == "skipped" and str(skipped).startswith(
            "plain at small 4x32: 0.088 s > 0.065 s, inconclusive (loaded: 1.40 of 2 cores"
        )
    except AssertionError:
        assert outcome == "failed"
    else:
        assert outcome == "passed"


@pytest.mark.bench
def test_the_step_bound_is_above_real_steps_at_the_default_grid() -> None:
    """Rule 4's bound, against this machine: each arm's median step at each default shape is below its bound."""
    import torch

    default = sweep.plan("cpu", "default")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for workload in default.workloads:
            arms = benchmark.build_arms(benchmark.Group(workload, ("plain", *default.arms), False), 0)
            plain_bound = sweep.block_bound(workload, ()) / 2
            for name, arm in arms.items():
                bound = plain_bound * (1 if name == "plain" else sweep.ARM_FACTOR)
                seconds, reading = median_step(arm, Meter(), bound)
                within_bound(f"{name} at {workload.label}", seconds, bound, reading)
    finally:
        torch.set_num_threads(before)


def test_rtv_bench_gives_the_sweep_what_the_benchmark_left_of_its_5_minutes() -> None:
    planned = sweep.plan("cpu", "default").budget_s
    assert sweep.budget_left("cpu", "default", 100.0) == planned  # an idle machine: the plan's
    assert sweep.budget_left("cpu", "default", 250.0) == pytest.approx(300.0 - 250.0 - sweep.OUTSIDE_S)
    assert sweep.budget_left("cpu", "default", 400.0) == sweep.MIN_BUDGET_S > 0  # compare needs a positive one
    assert sweep.budget_left("cpu", "nightly", 1e5) == sweep.plan("cpu", "nightly").budget_s  # no run budget
    assert sweep.budget_left("gpu-8b", "default", 1e4) == sweep.plan("gpu-8b", "default").budget_s
