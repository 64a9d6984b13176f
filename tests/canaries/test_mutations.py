"""The sensitivity suite: every injected bug is caught, and the suite itself fails closed (NOTE [Mutation verdicts])."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import pytest
from hypothesis import settings

from canaries.mutations import MUTATIONS, Mutation, judge_mutation, mutation, run_suite
from canaries.registry import CANARIES, canary
from validation.errors import SetupError
from validation.evidence import verify
from validation.profiles import EXPLORATION


def test_the_whole_suite_catches_every_mutation_on_the_cpu_preset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Verdicts, not exploration depth, are under test: one explored example keeps the unmutated baseline cheap.
    monkeypatch.setitem(EXPLORATION, "quick", settings(EXPLORATION["quick"], max_examples=1))
    record = verify(canary("mutations").run("cpu", "quick", tmp_path))

    assert record["kind"] == "mutation-suite" and record["passed"] is True, record["measurements"]
    assert record["checks"]["unmutated:derivative passes"] is True
    assert record["checks"]["unmutated:memory passes"] is True
    results = record["measurements"]["mutations"]
    assert sorted(record["measurements"]["caught"]) == sorted(MUTATIONS)
    assert record["measurements"]["inapplicable"] == []
    for name in MUTATIONS:
        assert results[name]["caught"] and results[name]["failed_checks"], name
    # Each bug is caught where it shows, by the check meant for it.
    assert results["staleness_off_by_one"]["failed_checks"] == ["scenario:bounds"]
    assert "StaleGradientError" in results["staleness_off_by_one"]["first_failure"]
    assert results["correct_fresh_records"]["failed_checks"] == ["scenario:corrections"]
    assert "corrected (staleness 0): expected False, found True" in results["correct_fresh_records"]["first_failure"]
    assert results["per_rank_normalisation"]["failed_checks"] == ["logical_global_normalisation"]
    assert "agreement with the FP64 oracle" in results["stale_weights"]["first_failure"]  # silently wrong, not refused
    assert "expected unchanged, found replaced" in results["partial_commit"]["first_failure"]
    assert results["offload_alias"]["caught_by"] == "memory"
    assert "offload" in " ".join(results["offload_alias"]["failed_checks"])
    # Mutated runs are failures by design: their records stay out of the run's folder.
    assert [p.name.split("-")[0] for p in tmp_path.iterdir()] == ["mutations"]


def test_a_mutation_that_is_not_caught_fails_the_suite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    harmless = Mutation("harmless", "changes nothing (negative control of the suite)", "memory", nullcontext)
    monkeypatch.setitem(MUTATIONS, "harmless", harmless)
    record = verify(run_suite("cpu", "quick", tmp_path, names=["harmless"]))

    assert record["passed"] is False
    assert record["checks"] == {"unmutated:memory passes": True, "caught:harmless": False}
    assert record["measurements"]["caught"] == []


def test_an_inapplicable_mutation_is_listed_not_passed(tmp_path: Path) -> None:
    # The gpu preset has no dropout: replay without RNG restore cannot show there.
    outcome = judge_mutation(mutation("replay_without_rng"), "gpu", scratch=tmp_path)
    assert (outcome.applicable, outcome.caught) == (False, False)
    assert list(tmp_path.iterdir()) == [], "nothing ran"


def test_every_mutation_is_caught_by_a_registered_canary_and_unknown_names_are_refused() -> None:
    assert {m.caught_by for m in MUTATIONS.values()} <= set(CANARIES) - {"mutations"}
    with pytest.raises(SetupError, match="unknown mutation 'typo'") as info:
        mutation("typo")
    assert "stale_weights" in info.value.fix
