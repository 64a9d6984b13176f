"""The sensitivity suite: every injected bug is caught, and the suite itself fails closed (NOTE [Mutation verdicts])."""

from __future__ import annotations

import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
from hypothesis import settings

from canaries.memory.canary import CHECKPOINT_STATE_CHECK
from canaries.mutations import canary as mutations_module
from canaries.mutations.canary import MUTATIONS, Mutation, judge, judge_mutation, mutation
from canaries.mutations.catalogue import PARTS
from canaries.registry import CANARIES, Canary, Judged, canary
from canaries.request import CanaryRun, CannotFocus, canary_run
from validation.errors import SetupError
from validation.evidence import Checks, verify
from validation.profiles import EXPLORATION

# A fragment of each mutation's first failure: caught where it shows, by the check meant for it, for the right reason.
FIRST_FAILURE = {
    "staleness_off_by_one": "StaleGradientError",
    "correct_fresh_records": "corrected (staleness 0): expected False, found True",
    "sequence_weight_per_token": "mean weight: expected",
    "per_rank_normalisation": "gradient of the globally normalised loss",
    "stale_weights": "agreement with the FP64 oracle",  # silently wrong, not refused
    "partial_commit": "expected unchanged, found replaced",
    "commit_non_finite": "expected GradientCommitError, found no error",
    "replay_without_rng": "caller's CPU RNG after backward: expected unchanged, found changed",
    "offload_alias": "census",
    "fold_in_arrival_order": ".grad differs from the tree oracle",
    "no_cross_process_reduction": "W=2 differs from W=1",
    # where two features meet (NOTE [Intersection checks], NOTE [Admission intersections])
    "shared_correction_cache": "(staleness, corrected) per step/logical rank: expected W=1's",
    "flush_before_checks": "refused with StaleGradientError; expected the state unchanged, found: .grad objects replaced",
    "fp32_masters_for_fp64": "grad norm of the stepped gradients",
    "saved_scale_ignores_training": "admitted (forced offload)",
    "lora_term_uncounted": "admitted (forced offload)",
    "groups_admitted_one_by_one": "refused with MemoryAdmissionError; expected the state unchanged, found: records or placements",
    "optimizer_state_unchecked": "expected a TrainerError (refused), found success",
    "when_available_across_dropout": "uncorrected or with weights 1, found staleness 1",
    "budget_ignores_checkpoints": "admitted (forced retain)",
    # the bugs the suite let through
    "known_norm_without_length": "grad norm: expected the norm of the",
    "flush_assigns": "expected the committed .grad plus both logical ranks' buffers",
    "busy_counts_every_checkpoint": "found CheckpointBusyError",
    "scale_without_worst_case": "admitted (forced offload)",
    # the planner's witnesses (NOTE [Planner certificate])
    "attention_term_dropped": "under-estimates: ['",
    "host_budget_ignored": "tight host:one: offload",
    "offload_priced_at_zero": "offload 0.000 ms <= retain 0.000 ms",
    "scale_across_shape_classes": " refused, wrong: ",
}

# make test runs a mutation of each kind the suite must catch (a derivative scenario, a commit fault, an intersection,
# an admission term); the rest are slow: the planner's run whole (its grid, seconds each), the logical-rank ones spawn
# ranks, and together they cost about 10 s of CPU. CI runs them all (its slow tier), and `rtv run`'s mutations canary
# catches each.
_DEFAULT = {"stale_weights", "staleness_off_by_one", "commit_non_finite", "flush_assigns", "lora_term_uncounted"}
_SLOW = set(MUTATIONS) - _DEFAULT


def test_every_mutation_has_its_first_failure_pinned() -> None:
    assert sorted(FIRST_FAILURE) == sorted(MUTATIONS)


# One test per mutation (xdist spreads them): each is the suite (judge) on that mutation alone, so its unmutated baseline
# is its own check (NOTE [Mutation verdicts] Rule 4) and the whole catalogue costs about one check per mutation.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in _SLOW else n for n in MUTATIONS])
def test_the_suite_catches_each_mutation_on_the_cpu_preset_by_the_check_meant_for_it(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Verdicts, not exploration depth, are under test: one explored example if a run explores at all.
    monkeypatch.setitem(EXPLORATION, "quick", settings(EXPLORATION["quick"], max_examples=1))
    m = MUTATIONS[name]
    record = verify(canary("mutations").record("cpu", judge(canary_run("cpu", "quick"), names=[name]), tmp_path))

    assert record["kind"] == "mutation-suite" and record["passed"] is True, record["measurements"]
    assert record["checks"] == {f"unmutated:{m.caught_by} passes": True, f"caught:{name}": True}
    result = record["measurements"]["mutations"][name]
    assert result["caught"] and m.check in result["failed_checks"], result
    if m.caught_by == "derivative":  # focused on its check; the run stops at the first failure anyway
        assert result["failed_checks"] == [m.check]
    assert FIRST_FAILURE[name] in result["first_failure"], result["first_failure"]
    # Mutated runs are failures by design: their records stay out of the run's folder.
    assert [p.name.split("-")[0] for p in tmp_path.glob("*.json")] == ["mutations"]


def test_the_registry_entry_point_runs_every_mutation_of_the_catalogue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one = {"busy_counts_every_checkpoint": MUTATIONS["busy_counts_every_checkpoint"]}  # a cheap stand-in catalogue
    monkeypatch.setattr(mutations_module, "MUTATIONS", one)
    record = verify(canary("mutations").run(canary_run("cpu", "quick"), tmp_path))
    assert record["passed"] is True and record["measurements"]["caught"] == list(one)
    assert record["config"]["checks"] == {name: m.check for name, m in one.items()}


def test_every_mutation_names_a_check_of_its_canary() -> None:
    from canaries.derivative import canary as derivative
    from canaries.memory import canary as memory
    from canaries.memory.scale import SCALE_CHECKS
    from canaries.planner.certificate import certify
    from canaries.presets import preset

    names = {
        "derivative": set(derivative.check_names(preset("cpu").on_this_machine())),
        "memory": set(memory.INTERSECTION_CHECKS)
        | set(SCALE_CHECKS)
        | {"offload: host copies hold what retain keeps on the device"},
        "planner": {name for name, _, _ in certify(["a cell"], {})[1]},
    }
    for m in MUTATIONS.values():
        assert m.check in names[m.caught_by], m.name


def test_focused_runs_refuse_unknown_checks_and_canaries_without_them(tmp_path: Path) -> None:
    with pytest.raises(SetupError, match="no checks named"):
        canary("derivative").run(canary_run("cpu", "quick", checks=["scenario:typo"]), tmp_path)
    with pytest.raises(SetupError, match="runs all its checks"):
        canary("learning").run(canary_run("cpu", "quick", checks=["anything"]), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_focused_memory_run_makes_only_the_intersection_checks_asked(tmp_path: Path) -> None:
    record = verify(canary("memory").run(canary_run("cpu", "quick", checks=[CHECKPOINT_STATE_CHECK]), tmp_path))
    assert record["checks"] == {CHECKPOINT_STATE_CHECK: True}
    assert record["config"]["checks"] == [CHECKPOINT_STATE_CHECK]


def test_a_mutation_that_is_not_caught_fails_the_suite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    harmless = Mutation(
        "harmless", "changes nothing (negative control of the suite)", "memory", nullcontext, CHECKPOINT_STATE_CHECK
    )
    monkeypatch.setitem(MUTATIONS, "harmless", harmless)
    record = verify(canary("mutations").record("cpu", judge(canary_run("cpu", "quick"), names=["harmless"]), tmp_path))

    assert record["passed"] is False
    assert record["checks"] == {"unmutated:memory passes": True, "caught:harmless": False}
    assert record["measurements"]["caught"] == []


def test_an_inapplicable_mutation_is_listed_not_passed(tmp_path: Path) -> None:
    # The gpu preset has no dropout: replay without RNG restore cannot show there.
    outcome = judge_mutation(mutation("replay_without_rng"), canary_run("gpu", "quick"), scratch=tmp_path)
    assert (outcome.applicable, outcome.caught) == (False, False)
    assert list(tmp_path.iterdir()) == [], "nothing ran"


def test_the_catalogue_lists_every_bug_of_every_part_of_the_trainer_once() -> None:
    written = [m.name for part in PARTS.values() for m in part]
    assert len(written) == len(set(written)), "a name written in two parts"
    assert sorted(MUTATIONS) == sorted(written)
    assert all(MUTATIONS[m.name] is m for part in PARTS.values() for m in part)


def test_every_mutation_is_caught_by_a_registered_canary_and_unknown_names_are_refused() -> None:
    assert {m.caught_by for m in MUTATIONS.values()} <= set(CANARIES) - {"mutations"}
    with pytest.raises(SetupError, match="unknown mutation 'typo'") as info:
        mutation("typo")
    assert "stale_weights" in info.value.fix


def test_a_mutation_a_loaded_machine_left_undecided_is_neither_caught_nor_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [Mutation verdicts] Rule 5: "not caught: inconclusive (loaded)" is a skip, said so, never a pass."""
    timed = Mutation("timed", "caught only by a clock (stand-in)", "memory", nullcontext, CHECKPOINT_STATE_CHECK)
    monkeypatch.setitem(MUTATIONS, "timed", timed)
    undecided = mutations_module.MutationOutcome(
        "timed", "memory", True, False, (), "", 0.0, "inconclusive (loaded: 3 cells)"
    )
    monkeypatch.setattr(mutations_module, "judge_mutation", lambda m, run, scratch: undecided)
    record = verify(canary("mutations").record("cpu", judge(canary_run("cpu", "quick"), names=["timed"]), tmp_path))
    assert record["checks"] == {"unmutated:memory passes": True}  # what it saw; the mutation is not counted caught
    assert record["skips"] == {"caught:timed": "not caught: inconclusive (loaded: 3 cells)"}
    assert record["measurements"]["inconclusive"] == ["timed"] and record["measurements"]["caught"] == []


def test_only_the_named_check_left_undecided_by_load_excuses_a_mutation() -> None:
    from validation.evidence import Check

    loaded = Check("certificate: worst regret", True, "inconclusive (loaded: 2 cells)", skipped=True)
    other = Check("certificate: pairwise ordering on pairs apart", True, "no pair apart", skipped=True)
    assert (
        mutations_module._inconclusive([other, loaded], "certificate: worst regret") == "inconclusive (loaded: 2 cells)"
    )
    assert mutations_module._inconclusive([other, loaded], None) == "inconclusive (loaded: 2 cells)"
    # A clock-free check that passed is a bug not caught, whatever the timing checks could not decide.
    assert mutations_module._inconclusive([loaded], "certificate: offload and replay priced above retain") == ""
    assert mutations_module._inconclusive([other], None) == ""


def test_every_planner_mutation_is_meant_for_a_check_that_reads_no_clock() -> None:
    """A loaded machine cannot hide them (NOTE [Planner certificate] Rule 9): their checks decide without timings."""
    from canaries.planner.certificate import TIMING_CHECKS

    planner = [m for m in MUTATIONS.values() if m.caught_by == "planner"]
    assert planner and all(m.check is not None and m.check not in TIMING_CHECKS for m in planner)


def test_a_canary_that_runs_only_whole_is_run_whole_for_its_mutations_and_silently(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rule 4 without a flag in the registry: a canary refuses a subset before it runs anything (CannotFocus),
    and the suite runs it whole, on the suite's preset and the mutated profile, with its lines dropped."""
    asked: list[CanaryRun] = []

    def judge_whole(run: CanaryRun) -> Judged:
        asked.append(run)
        run.runs_every_check("toy")
        checks = Checks(echo=run.echo)
        checks.check("toy check", not injected, "the toy's one check")
        return Judged("toy", {}, checks, {})

    injected: list[bool] = []
    module = type(sys)("toy_whole_canary")
    module.judge = judge_whole  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(CANARIES, "toy", Canary(name="toy", module=module.__name__, summary="runs whole"))
    monkeypatch.setitem(
        MUTATIONS, "toy_bug", Mutation("toy_bug", "fails the toy", "toy", lambda: _appended(injected), "toy check")
    )
    suite_run = canary_run("cpu", "default", processes=2)
    record = verify(canary("mutations").record("cpu", judge(suite_run, names=["toy_bug"]), tmp_path))
    assert record["checks"] == {"unmutated:toy passes": True, "caught:toy_bug": True}, record["details"]
    assert [r.checks for r in asked] == [("toy check",), None, ("toy check",), None], "refused, then run whole"
    assert {(r.preset, r.profile) for r in asked} == {(suite_run.preset, "quick")}
    assert "PASS  toy check" not in capsys.readouterr().out, "the mutated and unmutated runs are silent"
    with pytest.raises(CannotFocus):
        judge(canary_run("cpu", "quick", checks=["caught:toy_bug"]), names=["toy_bug"])


@contextmanager
def _appended(flags: list[bool]):
    flags.append(True)
    try:
        yield
    finally:
        flags.pop()
