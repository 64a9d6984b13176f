"""The sensitivity suite: every injected bug is caught, and the suite itself fails closed (NOTE [Mutation verdicts])."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from canaries import mutations
from canaries.mutations import MUTATIONS, Mutation, judge_mutation, mutation, run_mutations
from reference_trainer.checkpoints import Checkpoint, WeightCapture
from reference_trainer.commit import GradientTransaction
from reference_trainer.ranks import LogicalRank
from validation.evidence import verify

HAS_MEMORY_CANARY = importlib.util.find_spec("canaries.memory") is not None


def test_the_whole_suite_catches_every_mutation_on_the_cpu_preset(tmp_path: Path) -> None:
    names = [n for n, m in MUTATIONS.items() if m.caught_by == "derivative" or HAS_MEMORY_CANARY]
    record = verify(run_mutations("cpu", out_dir=tmp_path, names=names))

    assert record["kind"] == "mutation-suite" and record["passed"] is True, record["measurements"]
    assert record["checks"]["unmutated:derivative passes"] is True
    results = record["measurements"]["mutations"]
    assert sorted(record["measurements"]["caught"]) == sorted(names)
    assert record["measurements"]["inapplicable"] == []
    for name in names:
        assert results[name]["caught"] and results[name]["failed_checks"], name
    # Each bug is caught where it shows, by the check meant for it.
    assert results["staleness_off_by_one"]["failed_checks"] == ["scenario:bounds"]
    assert "StaleGradientError" in results["staleness_off_by_one"]["first_failure"]
    assert results["correct_fresh_records"]["failed_checks"] == ["scenario:corrections"]
    assert "corrected (staleness 0): expected False, found True" in results["correct_fresh_records"]["first_failure"]
    assert results["per_rank_normalisation"]["failed_checks"] == ["logical_global_normalisation"]
    assert "agreement with the FP64 oracle" in results["stale_weights"]["first_failure"]  # silently wrong, not refused
    assert "expected unchanged, found replaced" in results["partial_commit"]["first_failure"]
    if HAS_MEMORY_CANARY:
        assert record["checks"]["unmutated:memory passes"] is True
        assert results["offload_alias"]["caught_by"] == "memory"


def test_a_mutation_that_is_not_caught_fails_the_suite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from contextlib import nullcontext

    harmless = Mutation("harmless", "changes nothing (negative control of the suite)", "derivative", nullcontext)
    monkeypatch.setitem(MUTATIONS, "harmless", harmless)
    record = verify(run_mutations("cpu", out_dir=tmp_path, names=["harmless"]))

    assert record["passed"] is False
    assert record["checks"] == {"unmutated:derivative passes": True, "caught:harmless": False}
    assert record["measurements"]["caught"] == []


def test_an_inapplicable_mutation_is_listed_not_passed(tmp_path: Path) -> None:
    # The gpu preset has no dropout: replay without RNG restore cannot show there.
    outcome = judge_mutation(mutation("replay_without_rng"), "gpu", out_dir=tmp_path)
    assert (outcome.applicable, outcome.caught) == (False, False)


def test_mutations_patch_only_inside_their_block() -> None:
    from reference_trainer import commit, corrections, residency, rng, staleness, trainer

    originals = (Checkpoint._copy_on_write, WeightCapture.check_ledger, GradientTransaction.publish,
                 corrections.staleness, residency.restored_forward_state, LogicalRank.global_token_count)
    for m in MUTATIONS.values():
        if m.inject is None:
            continue
        with m.apply():
            pass
    assert (Checkpoint._copy_on_write, WeightCapture.check_ledger, GradientTransaction.publish,
            corrections.staleness, residency.restored_forward_state, LogicalRank.global_token_count) == originals
    assert trainer.check_age is staleness.check_age is commit.check_age
    assert residency.restored_forward_state is rng.restored_forward_state


def test_memory_mutations_are_injected_by_the_memory_canary_and_names_are_checked() -> None:
    assert MUTATIONS["offload_alias"].caught_by == "memory"
    with pytest.raises(ValueError, match="injected by canaries.memory"):
        MUTATIONS["offload_alias"].apply()
    with pytest.raises(ValueError, match="unknown mutation 'typo'"):
        mutation("typo")
    assert set(mutations.__all__) >= {"MUTATIONS", "run_mutations", "mutation"}
