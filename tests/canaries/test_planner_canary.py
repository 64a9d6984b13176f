"""The planner canary's certificate (NOTE [Planner certificate]) on a fake clock, and one quick real run."""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import reference_trainer as rt
from canaries.planner import calibration
from canaries.planner.certificate import TIMING_CHECKS, ArmMemory, CellResult, cell_verdict, certify
from canaries.presets import PRESETS
from canaries.registry import canary as canary_entry
from canaries.request import canary_run
from tests.benchmark_fakes import FakeMeter
from tests.hogs import pinned_apart
from tests.validation.test_abba_timing import work
from validation import abba
from validation.load import LOADED_CORES

SECONDS = {"retain": 1.0, "offload": 1.2, "replay": 1.5, "auto": 1.0}  # what each arm costs on the fake clock


def _timed(costs: dict[str, float], blocks: int = 12) -> dict[str, list[float]]:
    """Per-block seconds of ``costs``' arms through ``abba.run_block`` on a clock each arm advances (with jitter)."""
    now = [0.0]
    jitter = itertools.cycle([0.0, 0.01, -0.01, 0.005, -0.02, 0.015, -0.005])  # 7: never in step with the arms
    arms = {name: (lambda c=c: now.__setitem__(0, now[0] + c * (1 + next(jitter)))) for name, c in costs.items()}
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    for index in range(blocks):
        for name, value in abba.run_block(arms, index, lambda: now[0]).items():
            seconds[name].append(value)
    return seconds


def _cell(label: str, predicted: dict[str, float], *, auto_cost: float = 1.0, peak: int = 90) -> CellResult:
    memory = {
        p: ArmMemory(measured_peak=peak, predicted_peak=100, measured_host=0, saved_estimate=10, saved_ratio=0.9)
        for p in predicted
    }
    return CellResult(
        label,
        None,
        None,
        seconds=_timed({**SECONDS, "auto": auto_cost}),
        predicted=predicted,
        memory=memory,
        admitted=list(predicted),
        auto=["retain"],
    )


def _checks(cells: dict[str, CellResult], planned: list[str] | None = None) -> dict[str, bool | None]:
    return {name: ok for name, ok, _ in certify(planned or list(cells), cells)[1]}


GOOD = {"retain": 0.0, "offload": 0.1, "replay": 0.4}
KEPT_OUT = "certificate: placements kept out where they fit: predicted / measured peak within the bound"


def test_a_planner_that_orders_as_measured_passes_every_check() -> None:
    figures, checks = certify(["a"], {"a": _cell("a", GOOD)})
    assert all(ok is not False for _, ok, _ in checks), checks
    assert _checks({"a": _cell("a", GOOD)})[KEPT_OUT] is None  # every placement admitted: nothing kept out
    assert figures["pairs_apart"] == 3 and figures["ordering"] == 1.0 and figures["worst_regret"] == 0.0


def test_reversed_prices_fail_the_ordering() -> None:  # the negative control of the ordering
    figures, _ = certify(["a"], {"a": _cell("a", {"retain": 0.4, "offload": 0.1, "replay": 0.0})})
    assert figures["ordering"] == 0.0


def test_a_predicted_tie_between_pairs_apart_is_a_wrong_order() -> None:  # offload priced at zero
    assert (
        _checks({"a": _cell("a", {"retain": 0.0, "offload": 0.0, "replay": 0.4})})[
            "certificate: pairwise ordering on pairs apart"
        ]
        is False
    )


def test_auto_slower_than_the_best_is_regret_with_its_interval() -> None:
    figures, _ = certify(["a"], {"a": _cell("a", GOOD, auto_cost=1.2)})
    cell = figures["cells"][0]
    assert cell["best"] == "retain" and cell["gated_regret"] == pytest.approx(0.2, abs=0.02)
    low, high = cell["regret_interval"]
    assert low <= 0.2 <= high and figures["worst_regret"] > 0.1


def test_a_regret_within_the_noise_is_gated_as_zero() -> None:  # 0.3% slower: inside the jitter's interval
    cell = certify(["a"], {"a": _cell("a", GOOD, auto_cost=1.003)})[0]["cells"][0]
    assert cell["regret"] > 0 and cell["regret_interval"][0] <= 0 and cell["gated_regret"] == 0.0


def test_an_under_estimated_peak_fails() -> None:
    assert _checks({"a": _cell("a", GOOD, peak=101)})["certificate: measured peak / predicted peak <= 1"] is False


def test_an_under_estimated_saved_state_fails() -> None:
    cell = _cell("a", GOOD)
    cell.memory["offload"] = ArmMemory(
        measured_peak=90, predicted_peak=100, measured_host=0, saved_estimate=10, saved_ratio=1.1
    )
    assert _checks({"a": cell})["certificate: held after a forward / admitted saved bytes <= 1"] is False


def test_a_refusal_is_wrong_when_a_placement_measured_fits() -> None:
    cell = _cell("a", GOOD)
    cell.auto, cell.device_limit = None, 95  # every measured peak (90) fits 95
    assert _checks({"a": cell})["certificate: no wrong refusal"] is False
    cell.device_limit = 80
    assert _checks({"a": cell})["certificate: no wrong refusal"] is True


def test_a_failed_or_missing_cell_fails_the_certificate() -> None:
    failed = _cell("a", GOOD)
    failed.error = "RuntimeError: boom"
    assert _checks({"a": failed})["certificate: every planned cell has a verdict, none failed"] is False
    assert (
        _checks({"a": _cell("a", GOOD)}, ["a", "b"])["certificate: every planned cell has a verdict, none failed"]
        is False
    )


@pytest.mark.slow
def test_the_quick_canary_passes_and_every_placement_is_admitted_somewhere(tmp_path: Path) -> None:
    from canaries.planner import canary

    judged = canary.judge(canary_run("cpu", "quick"))
    assert all(c.ok or c.skipped for c in judged.checks), [c for c in judged.checks if not c.ok]
    cells = judged.measurements["certificate"]["cells"]
    path = canary_entry("planner").record("cpu", judged, tmp_path)  # its fitted constants load into a trainer
    trainer = rt.Trainer(rt.DecoderLM(rt.ModelConfig.tiny(), seed=0), planner_calibration=path)
    assert trainer.memory_limit_bytes is None
    admitted = {p for r in judged.measurements["cells"].values() for p in r["admitted"]}
    assert admitted == {"retain", "offload", "replay"}
    # Replay wins somewhere, where timings were judged (a loaded cell has no measured best: Rule 9).
    assert "replay" in {c["best"] for c in cells} or any(c["load"] for c in cells)
    assert any(c["status"] == "refused" and c["refusal_right"] for c in cells)


# --- calibration (NOTE [Planner calibration]) -------------------------------------------------------------

TRUE = {"seconds_per_byte": 2e-9, "seconds_per_token": 3e-5, "seconds_per_record": 4e-4}


def _calibration_cell(index: int, constants: dict[str, float] = TRUE) -> CellResult:
    """A cell whose arms cost ``features · constants`` on the fake clock (sizes vary from cell to cell)."""
    records, tokens, moved = 1 + index % 3, 32.0 * (1 + index % 4), 1e5 * (1 + (index * 7) % 11)
    features = {"retain": [0.0, 0.0, 0.0], "offload": [moved, 0.0, records], "replay": [0.0, tokens * records, records]}
    costs = {
        p: 0.01 + sum(f * constants[n] for f, n in zip(vector, calibration.FEATURES)) for p, vector in features.items()
    }
    return CellResult(
        f"c{index}",
        None,
        None,
        seconds=_timed({**costs, "auto": costs["retain"]}, blocks=16),
        predicted=dict.fromkeys(features, 0.0),
        admitted=list(features),
        auto=["retain"],
        features=features,
    )


def test_constants_fitted_on_half_the_cells_order_the_other_half() -> None:
    cells = [_calibration_cell(i) for i in range(12)]
    found = calibration.held_out(cells)
    assert found["pairs_apart"] >= 10 and found["ordering"] >= calibration.HELD_OUT_GATE
    for name, value in TRUE.items():
        assert found["constants"][name] == pytest.approx(value, rel=0.2), found["constants"]


def test_the_held_out_gate_is_not_vacuous() -> None:  # prices from constants off by the wrong orders fail it
    cells = [_calibration_cell(i) for i in range(12)]
    wrong = {"seconds_per_byte": 1e-6, "seconds_per_token": 0.0, "seconds_per_record": 0.0}
    verdicts = [cell_verdict(calibration.priced(c, wrong)) for c in cells[1::2]]
    assert sum(v.pairs_ordered for v in verdicts) / sum(v.pairs_apart for v in verdicts) < calibration.HELD_OUT_GATE


class _Shares:
    """A load probe reporting the given CPU shares, block by block (the warm-up first)."""

    def __init__(self, shares: list[float]) -> None:
        self.shares = iter(shares)

    def start(self) -> None:
        pass

    def stop(self) -> float:
        return next(self.shares)


def test_loaded_blocks_are_left_out_of_a_cells_timing() -> None:
    from canaries.planner.timing import timed_blocks as timed

    now = [0.0]
    arms = {"a": lambda: now.__setitem__(0, now[0] + 1.0), "b": lambda: now.__setitem__(0, now[0] + 2.0)}
    timing = timed(arms, 4, lambda: now[0], _Shares([1.0, 1.0, 0.5, 0.9, 0.1]))
    assert (timing.loaded, timing.run) == (2, 4) and timing.seconds == {"a": [1.0, 1.0], "b": [2.0, 2.0]}
    assert timing.load is not None and "2 of 4 blocks" in timing.load  # more than MAX_LOADED of them: loaded


def test_every_grid_gates_the_cells_where_only_replaying_both_pending_forwards_fits() -> None:
    """The tight no-offload cells (auto's known wrong refusal, now demotion to replay) are in quick and default."""
    from canaries.planner.canary import CELL_GRIDS

    for profile, cells in CELL_GRIDS.items():
        tight_zero = [c for c in cells if (c.device, c.host, c.pending) == ("tight", "zero", 2)]
        assert tight_zero and any(c.dropout > 0 for c in tight_zero), profile


@pytest.mark.parametrize(
    "preset", ["gpu", "gpu-8b"], ids=["small-preset", "8b-preset"]
)  # an id "gpu" reads as the marker
def test_a_gpu_preset_plans_a_declared_subset_where_each_placement_can_win_and_one_is_refused(
    preset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from canaries.planner import canary
    from reference_trainer.planner import analytic_saved_bytes

    assert canary.plan(PRESETS[preset].on_this_machine(), "default").device == "cpu"  # no CUDA here: the CPU grid
    on_gpu = PRESETS[preset]  # as it runs on a lent GPU: the preset's declared subset
    for profile in ("quick", "default", "nightly"):
        plan = canary.plan(on_gpu, profile)
        assert plan is canary.GPU_PLANS[preset].get(profile, canary.GPU_PLANS[preset]["default"])
        assert plan.device == "cuda" and plan.model.dtype == torch.bfloat16 and 0 < plan.budget_s <= 900
        levels = {(c.pending, c.device, c.host) for c in plan.cells}
        # retain wins unlimited; offload (or replay) where two retained forwards do not fit; replay alone with no
        # host room (the demotion cell); a right refusal under every measured peak.
        assert {(1, "none", "none"), (2, "tight", "none"), (2, "tight", "zero"), (1, "nothing", "none")} <= levels, (
            profile
        )
        assert all(c.rank == 16 for c in plan.cells if c.lora) and plan.blocks >= 4
        for cell in plan.cells:  # what offloading the cell's pending forwards pins stays within a lent machine's RAM
            saved = analytic_saved_bytes(
                plan.model, cell.batch, cell.seq_len, scores_saved=False, dropout_active=cell.dropout > 0
            )
            assert cell.pending * saved < 64 << 30, (cell.label, saved)
    assert set(canary.plan(on_gpu, "quick").cells) < set(canary.plan(on_gpu, "default").cells)


def test_offload_priced_at_zero_fails_without_any_pair_measurably_apart() -> None:
    """Rule 7 needs no clock: every arm costs the same here, so the ordering has nothing to judge."""
    flat = {"retain": 1.0, "offload": 1.0, "replay": 1.0, "auto": 1.0}

    def cell(predicted: dict[str, float]) -> CellResult:
        return replace(_cell("a", predicted), seconds=_timed(flat))

    free = _checks({"a": cell({"retain": 0.0, "offload": 0.0, "replay": 0.4})})
    assert free["certificate: pairwise ordering on pairs apart"] is None  # skipped: no pair apart
    details = [detail for _, _, detail in certify(["a"], {"a": cell(GOOD)})[1]]
    assert not [d for d in details if "nan" in d.lower()], details  # no figure to give reads n/a, never nan
    assert free["certificate: offload and replay priced above retain"] is False
    assert _checks({"a": cell(GOOD)})["certificate: offload and replay priced above retain"] is True  # the control


# --- a loaded machine (NOTE [Planner certificate] Rule 9) -------------------------------------------------------

SWAPPED = {"retain": 0.0, "offload": 0.5, "replay": 0.1}  # offload and replay in the wrong order, both above retain
TIMED = TIMING_CHECKS[:3]  # the certificate's; the fourth is the calibration's


def _arms() -> tuple[dict, list[float]]:
    now = [0.0]
    return {"a": lambda: now.__setitem__(0, now[0] + 1.0), "b": lambda: now.__setitem__(0, now[0] + 2.0)}, now


def test_a_machine_loaded_from_the_start_is_seen_against_one_idle_core() -> None:
    """A steady load lowers the warm-up's share too: relative to it no block stands out, against an idle core's
    share every block does (the planner canary's unmutated run failed under such a load)."""
    from canaries.planner.timing import timed_blocks

    arms, now = _arms()
    steady = timed_blocks(arms, 4, lambda: now[0], _Shares([0.33] * 5))
    assert (steady.loaded, steady.load) == (0, None)  # what the warm-up alone calls idle
    seen = timed_blocks(arms, 4, lambda: now[0], _Shares([0.33] * 5), idle_share=1.0)
    assert (seen.loaded, seen.run) == (4, 4) and seen.load is not None and "CPU share median 0.33" in seen.load
    idle = timed_blocks(arms, 4, lambda: now[0], _Shares([0.97] * 5), idle_share=1.0)
    assert (idle.loaded, idle.load) == (0, None) and len(idle.seconds["a"]) == 4


def test_other_work_the_share_cannot_see_flags_the_blocks_through_the_meter() -> None:
    """The second witness (NOTE [Alternating blocks] Rule 4): a full CPU share beside a machine the meter reads busy
    (other work on the other core: a second pytest worker, another rank) is loaded; the meter reading idle is the
    control. The planner canary's unmutated run failed its regret gate beside such a worker."""
    from canaries.planner.timing import timed_blocks

    arms, now = _arms()
    busy = FakeMeter(idle=1.0)
    seen = timed_blocks(arms, 4, lambda: now[0], _Shares([1.0] * 5), meter=busy, idle_share=1.0)
    assert (seen.loaded, seen.run, busy.reads) == (4, 4, 4), seen
    assert seen.load is not None and "other work median 1.00 of 2 cores" in seen.load
    arms, now = _arms()
    quiet = FakeMeter(idle=0.0)
    idle = timed_blocks(arms, 4, lambda: now[0], _Shares([1.0] * 5), meter=quiet, idle_share=1.0)
    assert (idle.loaded, idle.load, quiet.reads, len(idle.seconds["a"])) == (0, None, 4, 4)


def test_the_real_witnesses_flag_every_block_beside_a_hog_on_the_other_core() -> None:
    from canaries.planner.timing import timed_blocks

    probe, meter = abba.witnesses(None, None)
    with pinned_apart():
        timing = timed_blocks(
            {"a": work(1.0), "b": work(1.0)}, 4, time.perf_counter, probe, meter=meter, idle_share=1.0
        )
    assert timing.load is not None and "other work" in timing.load, timing
    assert min(r.others for r in timing.readings) > LOADED_CORES, timing.readings


@pytest.mark.slow  # a cell's memory census costs seconds; its sibling above drives the same witnesses on plain work
def test_a_cell_measured_beside_a_hog_on_the_other_core_is_loaded(tmp_path: Path) -> None:
    from canaries.planner import canary

    plan = canary.plan(PRESETS["cpu"].on_this_machine(), "quick")
    cell = plan.cells[0]
    model = rt.DecoderLM(plan.model.replace(dropout=cell.dropout), seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as `rtv run` measures; two threads on one pinned core would wait on each other
    try:
        with pinned_apart():
            result = canary.run_cell(model, cell, 4, idle_share=1.0)  # the canary's own witnesses
    finally:
        torch.set_num_threads(threads)
    assert result.error is None and result.load is not None and "other work" in result.load, result


def test_flagged_blocks_are_replaced_within_the_budget_and_no_further() -> None:
    from canaries.planner.timing import timed_blocks

    arms, now = _arms()
    shares = [1.0, 1.0, 0.1, 1.0, 1.0, 1.0, 1.0]  # the warm-up, then one loaded block among five
    extended = timed_blocks(arms, 4, lambda: now[0], _Shares(shares), extend_until=float("inf"))
    assert (extended.run, extended.loaded, len(extended.seconds["b"])) == (5, 1, 4)
    spent = timed_blocks(arms, 4, lambda: now[0], _Shares(shares), extend_until=0.0)  # the budget already spent
    assert (spent.run, spent.loaded, len(spent.seconds["b"])) == (4, 1, 3)
    always = timed_blocks(arms, 2, lambda: now[0], _Shares([1.0] + [0.1] * 10), extend_until=float("inf"))
    assert always.run == 4 and always.load is not None  # at most as many again, then loaded


def test_timing_failures_of_a_loaded_cell_are_inconclusive_never_failures() -> None:
    bad = _cell("a", SWAPPED, auto_cost=1.3)  # wrong order, 30% regret
    assert [_checks({"a": bad})[name] for name in TIMED] == [False, False, False]  # the control: idle, it fails
    bad.load = "16 of 16 blocks under 80% of CPU share 1.00, median share 0.33"
    figures, checks = certify(["a"], {"a": bad})
    for name, ok, detail in checks:
        if name in TIMED:
            assert ok is None and detail.startswith("inconclusive (loaded: 1 cells, a: 16 of 16 blocks"), (name, detail)
        else:
            assert ok is not False, (name, detail)
    assert figures["loaded_cells"] == ["a"]


def test_a_loaded_cell_is_left_out_and_the_others_still_judged() -> None:
    loaded = _cell("slow", SWAPPED, auto_cost=1.3)
    loaded.load = "measured"
    checks = {
        name: (ok, detail)
        for name, ok, detail in certify(["good", "slow"], {"good": _cell("good", GOOD), "slow": loaded})[1]
    }
    for name in TIMED:
        assert checks[name][0] is True and "left out: inconclusive (loaded: 1 cells, slow: measured)" in checks[name][1]
    wrong = _cell("wrong", SWAPPED, auto_cost=1.3)
    assert [_checks({"wrong": wrong, "slow": loaded})[name] for name in TIMED] == [False, False, False]


def test_a_price_that_drops_a_cost_fails_on_a_loaded_machine_too() -> None:  # Rule 7 reads no clock
    free = _cell("a", {"retain": 0.0, "offload": 0.0, "replay": 0.4})
    free.load = "measured"
    assert _checks({"a": free})["certificate: offload and replay priced above retain"] is False


# --- placements kept out where they fit (Rule 8) ------------------------------------------------------------------


def _kept_out(predicted_retain: int, measured_retain: int = 90) -> CellResult:
    """Retain kept out by a device limit of 95 (two placements admitted); its measured peak ``measured_retain``."""
    cell = _cell("a", {"retain": 0.0, "offload": 0.1, "replay": 0.4})
    cell.device_limit, cell.admitted = 95, ["offload", "replay"]
    cell.memory["retain"] = ArmMemory(
        measured_peak=measured_retain,
        predicted_peak=predicted_retain,
        measured_host=0,
        saved_estimate=10,
        saved_ratio=0.9,
    )
    return cell


def test_an_over_estimate_that_kept_a_fitting_placement_out_is_gated_in_bytes() -> None:
    from canaries.planner.certificate import Gates

    bound = Gates().kept_out_over_estimate
    assert _checks({"a": _kept_out(int(90 * bound) + 1)})[KEPT_OUT] is False  # 59x in the field; just over here
    assert _checks({"a": _kept_out(int(90 * bound))})[KEPT_OUT] is True
    assert _checks({"a": _kept_out(5900, measured_retain=96)})[KEPT_OUT] is None  # it does not fit: rightly out
    figures, _ = certify(["a"], {"a": _kept_out(180)})
    assert figures["cells"][0]["kept_out"] == {"retain": 2.0} and figures["worst_kept_out_over_estimate"] == 2.0


def test_fits_means_within_the_host_limit_too() -> None:
    """A placement over the host limit does not fit even when its device peak does: a refusal is right, an
    admission over it fails, and an over-estimate cannot have kept it out."""
    cell = _cell("a", GOOD)
    cell.auto, cell.device_limit, cell.host_limit = None, 95, 5  # every device peak (90) fits 95
    cell.memory = {p: replace(m, measured_host=10) for p, m in cell.memory.items()}
    assert _checks({"a": cell})["certificate: no wrong refusal"] is True
    cell.auto = ["offload"]
    assert _checks({"a": cell})["certificate: admitted placements within the limits (measured)"] is False
    kept = _kept_out(5900)
    kept.host_limit = 5
    kept.memory["retain"] = replace(kept.memory["retain"], measured_host=10)
    assert _checks({"a": kept})[KEPT_OUT] is None


# --- calibration held out (NOTE [Planner calibration] Rules 3-4) -----------------------------------------------


def test_the_held_out_constants_are_fitted_on_the_even_cells_alone() -> None:
    """Odd cells priced by other constants: a fit that sees them too lands between the two sets."""
    other = {"seconds_per_byte": 2e-8, "seconds_per_token": 3e-6, "seconds_per_record": 4e-3}
    cells = [_calibration_cell(i, TRUE if i % 2 == 0 else other) for i in range(12)]
    found = calibration.held_out(cells)["constants"]
    for name, value in TRUE.items():
        assert found[name] == pytest.approx(value, rel=0.2), found


def test_loaded_cells_are_neither_fitted_nor_judged() -> None:
    cells = [_calibration_cell(i) for i in range(12)]
    for cell in cells[:4]:
        cell.load = "measured"
    found = calibration.held_out(cells)
    assert (found["fitted_cells"], found["held_out_cells"]) == (4, 4)
    assert found["loaded_cells"] == ["c0", "c1", "c2", "c3"]
    name, ok, detail = calibration.held_out_check(found, "inconclusive (loaded: x)")
    assert name == TIMING_CHECKS[3] and ok is True and detail.endswith("left out: inconclusive (loaded: x)")
    for cell in cells:
        cell.load = "measured"
    assert calibration.held_out_check(calibration.held_out(cells), "inconclusive (loaded: x)")[1:] == (
        None,
        "inconclusive (loaded: x)",
    )


def test_no_replacement_block_starts_that_would_end_past_the_budget() -> None:
    from canaries.planner.timing import timed_blocks

    shares = [1.0, 1.0, 0.1, 1.0, 1.0, 1.0, 1.0]  # the 2nd of 4 blocks flagged
    for extend_until, run in ((35.0, 4), (37.0, 5)):  # 30 s spent (warm-up and 4 blocks of 6 s): one more ends at 36
        arms, now = _arms()
        assert timed_blocks(arms, 4, lambda now=now: now[0], _Shares(shares), extend_until=extend_until).run == run


def _replays_where_it_fits(plan_placement):
    """A planner whose ``auto`` replays whenever replay fits: the wrong choice wherever retain fits too."""

    def choose(request):
        if request.requested == "auto" and request.allow_replay:
            try:
                return plan_placement(replace(request, requested="replay"))
            except rt.MemoryAdmissionError:
                pass
        return plan_placement(request)

    return choose


@pytest.mark.bench  # times real work: a wrong choice must show in the regret on a real clock, idle
def test_on_an_idle_machine_the_regret_gate_catches_auto_replaying_where_retain_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from canaries.planner import canary
    from reference_trainer import admission

    plan = canary.plan(PRESETS["cpu"].on_this_machine(), "quick")
    cell = next(c for c in plan.cells if (c.device, c.host, c.pending) == ("none", "none", 1))  # retain wins
    model = rt.DecoderLM(plan.model.replace(dropout=cell.dropout), seed=0)

    def worst_regret() -> tuple[bool | None, str]:
        result = canary.run_cell(model, cell, plan.blocks, idle_share=1.0, extend_until=time.perf_counter() + 60)
        if result.load is not None:
            pytest.skip(f"inconclusive (loaded: {result.load})")
        (found,) = [
            (ok, detail) for name, ok, detail in certify([cell.label], {cell.label: result})[1] if name == TIMED[2]
        ]
        return found

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as `rtv run` measures
    try:
        right = worst_regret()
        monkeypatch.setattr(admission, "plan_placement", _replays_where_it_fits(admission.plan_placement))
        wrong = worst_regret()
    finally:
        torch.set_num_threads(threads)
    assert right[0] is True, right  # the control: the real planner retains here
    assert wrong[0] is False and f"{cell.label} 0.000" not in wrong[1], wrong
