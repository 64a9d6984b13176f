"""The learning canary on its tiny configuration: exact pairs, staleness, corrections, sensitivity, precondition."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from canaries.learning.arms import ARMS, arm, run_arm
from canaries.learning.canary import QUICK_ARMS, SEEDS, judge_plan, plan, tiny_plan
from canaries.learning.summary import area_under_curve, expected_staleness, ratio_distribution
from canaries.learning.workloads import Schedule
from canaries.presets import preset
from canaries.registry import CANARIES
from canaries.request import canary_run
from validation.errors import SetupError
from validation.evidence import verify

CPU = preset("cpu").on_this_machine()


@pytest.fixture
def record(tiny_learning_record: dict) -> dict:
    return copy.deepcopy(tiny_learning_record)  # a test may change its copy, never the others'


def test_the_tiny_run_passes_every_check(record: dict) -> None:
    assert record["kind"] == "learning" and record["passed"], [c for c, ok in record["checks"].items() if not ok]


def test_exact_pairs_are_bitwise_equal_per_seed_and_checked(record: dict) -> None:
    workload = record["measurements"]["workloads"]["next_byte"]
    pairs = {(p["arm"], p["with"]): p for p in workload["exact"]}
    assert set(pairs) == {("strict", "plain"), ("stale2_corrected_replay", "stale2_corrected")}
    for (name, other), pair in pairs.items():
        assert pair["per_seed"] == [True, True]
        assert workload["arms"][name]["digests"] == workload["arms"][other]["digests"]
        assert record["checks"][f"next_byte: {name} bitwise equal to {other} on every seed"]
    # Different arms really differ: the digests are not vacuous.
    assert workload["arms"]["stale2_uncorrected"]["digests"] != workload["arms"]["stale2_corrected"]["digests"]


def test_stale_records_had_the_scheduled_staleness_and_only_corrected_arms_corrected(record: dict) -> None:
    arms = record["measurements"]["workloads"]["next_byte"]["arms"]
    steps = 12
    for name in ("stale2_corrected", "stale2_uncorrected"):
        # Batch t is forwarded at revision max(0, t - 2) and backpropagated at revision t.
        assert arms[name]["staleness"] == [[0, 1] + [2] * (steps - 2)] * 2
    assert all(f == pytest.approx((steps - 1) / steps) for f in arms["stale2_corrected"]["fraction_corrected"])
    assert all(w is not None and w != 1.0 for w in arms["stale2_corrected"]["correction_weight_mean"])
    assert all(f == pytest.approx((steps - 1) / steps) for f in arms["stale2_sequence"]["fraction_corrected"])
    for name in ("plain", "strict", "stale2_uncorrected", "broken_dropped_updates"):
        assert arms[name]["fraction_corrected"] == [0.0, 0.0]


def test_level_arms_are_shown_with_their_raw_ratios_and_not_enforced(record: dict) -> None:
    workload = record["measurements"]["workloads"]["next_byte"]
    arms, checks = workload["arms"], record["checks"]
    level = arms["stale2_sequence"]
    assert (level["level"], level["enforced"], level["group"], level["baseline"]) == (
        "sequence",
        False,
        "levels",
        "strict",
    )
    assert {(v["arm"], v["baseline"]) for v in workload["verdicts"]} >= {("stale2_sequence", "strict")}
    assert not any("stale2_sequence meets" in c for c in checks)  # shown, not enforced
    assert "next_byte: stale2_sequence corrected a fraction > 0 of its records" in checks  # records still checked
    steps, seeds = 12, 2
    for name in ("stale2_corrected", "stale2_sequence"):
        raw, clipped = arms[name]["raw_ratio"], arms[name]["clipped_ratio"]
        assert raw["records"] == clipped["records"] == seeds * (steps - 1)
        assert raw["min"] <= raw["quantiles"]["0.5"] <= raw["max"] and raw["min"] != raw["max"]
        assert clipped["max"] <= 5.0  # the default clip_high
    assert arms["stale2_sequence"]["raw_ratio"]["max"] > 5.0  # before the clip: a product of 16 ratios
    for name in ("plain", "strict", "stale2_uncorrected"):
        assert arms[name]["raw_ratio"] is None and arms[name]["level"] is None


def test_ratio_distribution_matches_a_hand_computation() -> None:
    first = {"min": 0.5, "max": 4.0, "mean": 1.5, "quantiles": {0.05: 0.6, 0.5: 1.0, 0.95: 3.0}}
    second = {"min": 0.2, "max": 2.0, "mean": 1.0, "quantiles": {0.05: 0.3, 0.5: 0.9, 0.95: 1.8}}
    third = {"min": 0.9, "max": 1.1, "mean": 1.0, "quantiles": {0.05: 0.9, 0.5: 1.05, 0.95: 1.1}}
    pooled = ratio_distribution([first, second, third])
    assert pooled == {
        "records": 3,
        "min": 0.2,
        "max": 4.0,
        "mean": pytest.approx(3.5 / 3),
        "quantiles": {"0.05": 0.6, "0.5": 1.0, "0.95": 1.8},
    }  # the median over records, per quantile
    assert ratio_distribution([]) is None


def test_sensitivity_arms_are_caught_and_one_still_meets_the_criterion(record: dict) -> None:
    workload = record["measurements"]["workloads"]["next_byte"]
    sensitivity = {s["arm"]: s for s in workload["sensitivity"]}
    assert set(sensitivity) == {"broken_dropped_updates", "broken_flipped_layer"}
    assert all(s["caught"] for s in sensitivity.values())
    mild = sensitivity["broken_dropped_updates"]
    assert mild["meets_all"] and "worse" in mild["verdicts"].values() and mild["meets_and_worse"]
    assert record["checks"]["sensitivity: a broken arm meets its criterion and is still judged worse"]


def test_verdicts_pair_the_seeds_of_arm_and_baseline(record: dict) -> None:
    workload = record["measurements"]["workloads"]["next_byte"]
    arms = workload["arms"]
    for verdict in workload["verdicts"]:
        a, b = arms[verdict["arm"]][verdict["metric"]], arms[verdict["baseline"]][verdict["metric"]]
        assert verdict["differences"] == pytest.approx([x - y for x, y in zip(a, b)])
        spread = math.sqrt(sum((y - sum(b) / 2) ** 2 for y in b))  # sample SD of two values
        assert verdict["margin"] == pytest.approx(max(0.02, spread))
    strict = next(v for v in workload["verdicts"] if v["arm"] == "strict" and v["metric"] == "final")
    assert strict["verdict"] == "equivalent" and strict["ci_low"] == strict["ci_high"] == 0.0


def test_a_workload_already_solved_at_init_fails_the_canary_with_that_reason(tmp_path: Path) -> None:
    # 10 nats/byte is above the untrained model's ~5.5: the criterion is met before any training.
    result = verify(CANARIES["learning"].record("cpu", judge_plan(tiny_plan(success=10.0)), tmp_path))
    workload = result["measurements"]["workloads"]["next_byte"]
    assert not result["passed"]
    assert result["checks"] == {
        "next_byte: precondition (untrained model misses held-out loss <= 10.0 nats/byte after 12 steps)": False
    }
    assert "precondition failed" in workload["precondition"]["reason"] and "arms" not in workload
    assert all(5.0 < v < 6.0 for v in workload["precondition"]["initial"])  # near ln(256): untrained


def test_gate_enforces_equivalence(tmp_path: Path) -> None:
    gated = dataclasses.replace(tiny_plan(arms=("plain", "strict", "stale2_corrected")), gate=True)
    result = verify(CANARIES["learning"].record("cpu", judge_plan(gated), tmp_path))
    gates = {c: ok for c, ok in result["checks"].items() if "gated" in c}
    assert gates["next_byte: strict equivalent to plain (final, gated)"]
    # Staleness 2 learns measurably slower than strict on this short schedule: the gate fails it.
    assert not gates["next_byte: stale2_corrected equivalent to strict (auc, gated)"] and not result["passed"]


def test_the_rl_workload_learns_through_the_trainer_exactly_as_the_plain_loop() -> None:
    rl = (
        plan(CPU, "quick")
        .workloads[1]
        .replace(schedule=Schedule(steps=4, peak_lr=1e-2, warmup=1, eval_every=2), eval_prompts=8)
    )
    plain, strict = run_arm(arm("plain"), rl, 0), run_arm(arm("strict"), rl, 0)
    corrected = run_arm(arm("stale1_corrected"), rl, 0)
    assert (plain.values, plain.digest) == (strict.values, strict.digest)
    assert corrected.staleness == expected_staleness(arm("stale1_corrected"), 4) == [0, 1, 1, 1]
    assert corrected.corrected == [False, True, True, True] and corrected.digest != strict.digest


def test_profiles_and_presets() -> None:
    assert [len(plan(CPU, p).seeds) for p in ("quick", "default", "nightly")] == [3, 5, 10]
    assert SEEDS["cpu"]["default"] >= 5 and SEEDS["gpu"]["nightly"] > SEEDS["cpu"]["nightly"]
    gpu = preset("gpu").on_this_machine()
    assert [a.name for a in plan(CPU, "quick").arms] == list(QUICK_ARMS)
    assert (
        [a.name for a in plan(CPU, "default").arms]
        == [a.name for a in ARMS]
        == [a.name for a in plan(gpu, "nightly").arms]
    )
    if not torch.cuda.is_available():
        swapped = plan(gpu, "default")
        assert swapped.workloads[0].model.dtype == torch.float32 and "without CUDA" in swapped.notes[0]
    with pytest.raises(SetupError) as error:
        CANARIES["learning"].run(canary_run("gpu-8b", "quick"), Path("unused"))
    assert error.value.exit_code == 2 and "--preset gpu" in error.value.fix


def test_quick_fits_its_budget_by_design_and_keeps_every_exact_pair_and_broken_arm() -> None:
    """quick's 60 s (docs/harness.md#time-budgets) on 2 idle cores, planned at half: its runs times about 1.25 s
    of CPU each (the costlier RL runs), over 2 workers, stay within 30 s. Planned, not timed: no clock here."""
    quick = plan(CPU, "quick")
    described = quick.describe()
    assert described["runs"] == len(quick.seeds) * len(quick.arms) * len(quick.workloads)
    assert described["runs"] * 1.25 / quick.workers <= 30.0, described["runs"]
    assert described["profiles"]["cpu"]["quick"] == "3 seeds x 8 arms x 2 workloads"
    assert described["profiles"]["cpu"]["default"] == f"5 seeds x {len(ARMS)} arms x 2 workloads"
    names = {a.name for a in quick.arms}
    for spec in quick.arms:  # every verdict and exact pair of quick has its other side in quick
        assert {spec.baseline, spec.exact_with} - {None} <= names, spec.name
    exact = {a.name for a in ARMS if a.exact_with} | {a.exact_with for a in ARMS if a.exact_with}
    broken = {a.name for a in ARMS if a.sensitivity}
    assert exact | broken <= names and len(broken) == 2
    assert any(a.corrected for a in quick.arms) and any(a.delay and not a.corrected for a in quick.arms)


def test_schedule_and_area_under_curve() -> None:
    schedule = Schedule(steps=10, peak_lr=1.0, warmup=2, eval_every=4, final_fraction=0.1)
    assert [schedule.lr(s) for s in (0, 1, 9)] == pytest.approx([0.5, 1.0, 0.1])
    assert schedule.eval_steps() == [0, 4, 8, 10]
    assert area_under_curve([0, 2, 4], [1.0, 3.0, 1.0]) == pytest.approx(2.0)  # trapezoids: (4 + 4) / 4


@pytest.mark.slow
def test_quick_profile_through_the_registry(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    result = verify(CANARIES["learning"].run(canary_run("cpu", "quick"), tmp_path))
    assert result["passed"], [c for c, ok in result["checks"].items() if not ok]
    assert set(result["measurements"]["workloads"]) == {"next_byte", "pattern_rl"}
    for workload in result["measurements"]["workloads"].values():
        assert sorted(workload["arms"]) == sorted(QUICK_ARMS)  # a record's keys are written sorted
        assert all(arm["seeds"] == [0, 1, 2] for arm in workload["arms"].values())


def test_the_rollout_arms_sample_from_the_engine_at_their_behaviour_lag_on_the_rl_task_only() -> None:
    from canaries.learning.canary import LearningPlan, _arms_on, cpu_workloads

    text, rl = cpu_workloads()
    rl = rl.replace(
        schedule=Schedule(steps=4, peak_lr=1e-2, warmup=1, eval_every=2), prompts=2, group=2, eval_prompts=4
    )
    runs = {}
    for name, corrected in (
        ("engine_lag2_inflight_corrected", 1.0),
        ("engine_lag2_drain_corrected", 1.0),
        ("engine_lag1_drain", 0.0),
    ):
        runs[name] = run = run_arm(arm(name), rl, 0)
        assert run.staleness == expected_staleness(arm(name), 4) == [0, 1, min(2, arm(name).delay), arm(name).delay]
        assert run.fraction_corrected == corrected and len(run.raw_ratios) == (4 if corrected else 0)
    # Inflight: the next revision lands after the first token from step 2 on, so those steps' ratios differ.
    inflight, drain = runs["engine_lag2_inflight_corrected"], runs["engine_lag2_drain_corrected"]
    assert inflight.raw_ratios[:2] == drain.raw_ratios[:2] and inflight.raw_ratios[2:] != drain.raw_ratios[2:]
    every = LearningPlan(preset="cpu", profile="default", seeds=(0,), workloads=(text, rl))
    assert not any(a.loop == "engine" for a in _arms_on(text, every))
    assert sum(a.loop == "engine" for a in _arms_on(rl, every)) == 9
