"""The derivative canary and its FP64 oracle (NOTE [Derivative canary], NOTE [Oracle trainer]).

The ``quick`` profile runs here (``rtv canary derivative --profile nightly``
is the deep one); a deliberately broken trainer must fail it with a shrunk,
named op sequence; emptying the stale cells must fail its coverage check; the oracle is checked against the plain-autograd reference of
``validation.oracle`` so the two judges do not share a mistake.
"""

from __future__ import annotations

import re
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import settings

import reference_trainer as rt
from canaries.derivative import canary as derivative
from canaries.derivative import scenarios as derivative_scenarios
from canaries.derivative.intersections import INTERSECTIONS
from canaries.derivative.machine import explore
from canaries.derivative.oracle_pair import FAULTS, TOLERANCES, build_trainer, sequences
from canaries.derivative.scenarios import SCENARIOS, check_logical_normalisation, run_scenario
from canaries.presets import preset
from canaries.registry import canary
from canaries.request import canary_run
from reference_trainer import staging as staging_module
from validation.errors import SetupError
from validation.evidence import verify
from validation.oracle import OracleTrainer
from validation.profiles import EXPLORATION
from validation.reference import plain_gradients, relative_error, snapshot_weights
from validation.trainers import trainer_with_policy

# The checks a passing quick run records beside the exploration's: the fixed scenarios and every
# intersection check (NOTE [Intersection checks]).
FIXED = [
    "logical_global_normalisation",
    *(f"scenario:{n}" for n in SCENARIOS),
    "scenario:stale_grid[full]",
    *INTERSECTIONS,
]


@pytest.mark.slow  # the whole quick profile (about 5 s); each scenario passes in the default run, and rtv run runs the profile
def test_quick_profile_passes_and_writes_valid_evidence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = canary("derivative").run(canary_run("cpu", "quick"), tmp_path)

    record = verify(path)
    assert record["kind"] == "derivative-canary" and record["passed"] is True
    assert set(record["checks"]) == {
        *FIXED,
        "state_machine",
        derivative.BACKPROPAGATING_CHECK,
        derivative.COVERAGE_CHECK,
    }
    m = record["measurements"]
    # Non-vacuous: the run compared real gradients, stale ones, corrected ones, and predicted errors.
    assert m["examples"] >= 3 and m["backwards"] >= 50 and m["optimizer_steps"] >= 20
    assert m["examples_backpropagated"] >= 0.9 * m["examples"]
    assert m["corrected_records"] > 0 and m["errors_predicted_and_matched"] > 0
    # Stale records are most of what was judged, and every claimed cell holds some (counted independently here).
    cells = {
        (c["staleness"], c["placement"], c["corrected"], c["checkpoint"], c["level"]): c["records"] for c in m["cells"]
    }
    assert sum(cells.values()) == m["records_checked"]
    stale = sum(n for (staleness, *_), n in cells.items() if staleness > 0)
    assert stale == m["stale_records_backpropagated"] and stale > m["records_checked"] / 2
    for staleness in (1, 2):
        for placement in ("retain", "offload", "replay"):
            for corrected in (False, True):
                for kind in ("lora", "full"):
                    assert cells.get((staleness, placement, corrected, kind, "token" if corrected else None), 0) > 0
        for level in ("sequence", "geometric", "average"):  # the stale cells gain the levels
            for kind in ("lora", "full"):
                assert cells.get((staleness, "retain", True, kind, level), 0) > 0
    assert m["claimed_cells_empty"] == []
    assert 0 < m["worst_gradient_relative_l2"] <= TOLERANCES[torch.float32].gradient
    assert 0 < m["worst_logprob_relative_l2"] <= TOLERANCES[torch.float32].logprobs
    assert m["min_reference_norm"] > 0
    assert record["skips"] == {"cuda_rng_unchanged_by_backward": "CPU preset"}
    out = capsys.readouterr().out
    assert "derivative canary: PASSED; 1 skipped" in out and f"wrote {path}" in out


def test_coverage_fails_when_no_stale_backward_can_succeed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control of the coverage check: every staleness bound capped at 0 empties the stale cells.

    The intersection checks fill no cell and the scenarios' cells are the exploration's too (the quick profile's
    test and each scenario's test run them), so both are left out here.
    """
    monkeypatch.setattr(derivative, "INTERSECTIONS", {})
    monkeypatch.setattr(derivative, "_fixed_checks", lambda config: [])
    result = derivative.examine(preset("cpu").on_this_machine(), profile="quick", bound_cap=0)

    assert list(result.failures) == [derivative.COVERAGE_CHECK]  # everything else agrees with the oracle
    assert "(1, 'retain', False, 'lora', None)" in result.failures[derivative.COVERAGE_CHECK]
    assert all(staleness == 0 for staleness, *_ in result.measured.cells)


def _gradients_off_by_a_tenth_of_a_percent():
    original = staging_module.record_backward

    def record_backward(model, record, cotangent, retain_graph):
        return {n: g * 1.001 for n, g in original(model, record, cotangent, retain_graph).items()}

    return mock.patch.object(staging_module, "record_backward", record_backward)


@pytest.mark.slow  # hypothesis shrinks a failing interleaving (about 2 s); the mutation tests show the scenarios catch broken trainers
def test_a_broken_trainer_fails_with_a_shrunk_named_op_sequence() -> None:
    config = preset("cpu").on_this_machine()
    with _gradients_off_by_a_tenth_of_a_percent():
        report = explore(config, EXPLORATION["quick"], on_example=lambda harness: None)
        result = derivative.examine(config, profile="quick")

    assert report is not None and report.startswith("CanaryFailure: ") and "agreement with the FP64 oracle" in report
    assert "state = DerivativeMachine()" in report
    ops = [line for line in report.splitlines() if line.startswith("state.") and "agrees_with_oracle" not in line]
    ops = [op for op in ops if op != "state.teardown()"]
    first = [line for line in report.splitlines() if "state.start(" in line]
    assert first and re.search(r"kind='(lora|full)', placements=\[.*\], correct=\[.*\], seed=\d+", first[0]), report
    assert len(ops) <= 3, f"not shrunk to a minimal sequence:\n{report}"
    # The first fixed check catches it too, and the run stops there.
    assert result.checks == {"logical_global_normalisation": False}
    assert "gradient of the globally normalised loss" in result.failures["logical_global_normalisation"]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_each_scenario_passes_and_exercises_what_it_claims(name: str) -> None:
    measured = run_scenario(preset("cpu").on_this_machine(), name)
    stale_cells = {cell for cell, n in measured.cells.items() if cell[0] > 0 and n > 0}
    claims = {
        "stale_grid": stale_cells
        == {
            (s, p, c, "lora", "token" if c else None)
            for s in (1, 2)
            for p in ("retain", "offload", "replay")
            for c in (False, True)
        }
        | {(s, "retain", True, "lora", level) for s in (1, 2) for level in ("sequence", "geometric", "average")},
        "stale_exact": measured.stale_records >= 3 and measured.errors_predicted == 2,
        "bounds": measured.errors_predicted == 4,
        "corrections": measured.corrected_records == 1 and measured.stale_records == 2,
        "faults": measured.errors_predicted == 2 * len(FAULTS) - 1,  # one retry succeeds
        "non_finite": measured.backwards == 1 and measured.steps == 1,  # the two NaN backwards are refused
        "save_load": measured.errors_predicted == 2,
        "drops": measured.backwards == 1,
    }
    assert claims[name], measured


def test_logical_ranks_normalise_by_the_global_token_count() -> None:
    error = check_logical_normalisation(preset("cpu").on_this_machine())
    assert 0 < error <= TOLERANCES[torch.float32].gradient


def test_the_logical_check_is_the_same_whatever_the_global_rng_and_restores_it() -> None:
    """Its dropout masks come from its own seed: a fresh process's initial seed differs per process, and the
    evidence must not (NOTE [Derivative canary] Rule 7)."""
    config, errors = preset("cpu").on_this_machine(), []
    with torch.random.fork_rng():
        for seed in (1, 2):
            torch.manual_seed(seed)
            before = torch.get_rng_state()
            errors.append(check_logical_normalisation(config))
            assert torch.equal(torch.get_rng_state(), before), "the caller's RNG was not restored"
    assert errors[0] == errors[1]


def test_unknown_profile_and_preset_are_refused_with_a_fix(tmp_path: Path) -> None:
    with pytest.raises(SetupError, match="unknown profile 'weekly'") as info:
        canary("derivative").run(canary_run("cpu", "weekly"), tmp_path)
    assert "quick" in info.value.fix
    with pytest.raises(SetupError, match="unknown preset 'tpu'"):
        canary("derivative").run(canary_run("tpu", "quick"), tmp_path)
    assert list(tmp_path.iterdir()) == []


def _run_swapped_gpu_preset(tmp_path: Path, checks: list[str] | None = None) -> dict:
    """The gpu preset's record on this CPU machine, asserting its logical-rank check spawned 2 gloo processes."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the gpu preset is not swapped")
    spawned = mock.patch.object(derivative_scenarios, "run_ranks", wraps=derivative_scenarios.run_ranks)
    with spawned as spawn:
        record = verify(canary("derivative").run(canary_run("gpu", "quick", checks=checks), tmp_path))
    assert [c.args[1] for c in spawn.call_args_list] == [2], "the logical-rank check runs on the preset's 2 processes"
    assert spawn.call_args.kwargs["backend"] == "gloo"  # a CPU model: gloo even where CUDA exists
    assert record["config"]["preset"]["swapped_for_cpu"] is True
    assert record["config"]["preset"]["model"]["dtype"] == "torch.bfloat16"
    assert record["skips"] == {"cuda_rng_unchanged_by_backward": "preset swapped to CPU (no CUDA device)"}
    assert record["passed"], record["details"]
    return record


@pytest.mark.slow  # spawns the logical-rank checks of a second preset (about 5 s of ranks)
def test_gpu_preset_runs_swapped_on_cpu_its_logical_ranks_and_a_bf16_scenario(tmp_path: Path) -> None:
    """The fast sibling of the slow end-to-end run below: the swapped path, its spawn and BF16 tolerances."""
    checks = [derivative.LOGICAL_CHECK, "scenario:stale_exact"]
    assert set(_run_swapped_gpu_preset(tmp_path, checks)["checks"]) == set(checks)


@pytest.mark.slow
def test_gpu_preset_runs_swapped_on_cpu_and_reports_cuda_checks_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(EXPLORATION, "quick", settings(EXPLORATION["quick"], max_examples=1))  # the path, not depth
    record = _run_swapped_gpu_preset(tmp_path)
    assert record["measurements"]["claimed_cells_empty"] == []


# --- the oracle itself ---------------------------------------------------------------------


def _trainer_and_oracle() -> tuple[rt.Trainer, OracleTrainer]:
    return build_trainer(preset("cpu").on_this_machine())


def test_oracle_gradient_matches_the_plain_fp64_reference() -> None:
    trainer, oracle = _trainer_and_oracle()
    data = sequences(5, [6, 3], trainer.model.config.vocab_size)
    seqs = [(ids, t) for ids, t, _ in data]
    torch.manual_seed(11)
    rng = torch.get_rng_state()
    record = oracle.forward("policy", seqs, rng_state=rng, bound=2, correction=None)
    found = oracle.backward([(record, row, a) for row, (_, _, a) in enumerate(data)]).increments["policy"]

    def loss(outs: list[torch.Tensor]) -> torch.Tensor:
        return sum((o * a.double()).sum() for o, (_, _, a) in zip(outs, data))

    reference = plain_gradients(
        trainer.model.config, snapshot_weights(trainer, "policy"), seqs, loss, rng, dtype=torch.float64
    )
    for name, grad in reference.items():
        assert float(grad.abs().max()) > 0, name
        assert relative_error(found[name], grad) < 1e-12, name


def test_oracle_predicts_staleness_and_changes_nothing() -> None:
    _, oracle = _trainer_and_oracle()
    data = sequences(6, [4], 64)
    rng = torch.get_rng_state()
    fresh = oracle.forward("policy", [(data[0][0], data[0][1])], rng_state=rng, bound=0, correction=None)
    stale = oracle.forward("policy", [(data[0][0], data[0][1])], rng_state=rng, bound=0, correction=None)
    oracle.backward([(fresh, 0, data[0][2])])
    assert oracle.optim_step()["policy"].stepped and oracle.revision("policy") == 1
    before = oracle.grads("policy")
    with pytest.raises(rt.StaleGradientError) as info:
        oracle.backward([(stale, 0, data[0][2])])
    assert (info.value.staleness, info.value.bound, info.value.forward_revision) == (1, 0, 0)
    assert all(torch.equal(before[n], g) for n, g in oracle.grads("policy").items())
    assert not oracle.is_live(stale)
    with pytest.raises(rt.StaleGradientError):
        oracle.optim_step()  # the bound-0 gradient is one revision old now


def test_oracle_corrects_only_stale_records_with_the_contract_weights() -> None:
    _, oracle = _trainer_and_oracle()
    ((ids, targets, adv),) = sequences(7, [5], 64)
    rng = torch.get_rng_state()
    correction = rt.ImportanceCorrection(clip_low=0.5, clip_high=1.5, policy="always")
    records = [
        oracle.forward("policy", [(ids, targets)], rng_state=rng, bound=2, correction=correction) for _ in range(2)
    ]
    forward_logprobs = oracle.logprobs(records[1])[0]
    fresh = oracle.backward([(records[0], 0, adv)])
    assert not fresh.records[0].corrected
    oracle.optim_step()
    current = oracle.forward("policy", [(ids, targets)], rng_state=rng, bound=2, correction=None)
    expected = torch.exp(oracle.logprobs(current)[0] - forward_logprobs).clamp(0.5, 1.5)[targets >= 0]
    stale = oracle.backward([(records[1], 0, adv)]).records[0]
    assert stale.corrected and stale.staleness == 1 and stale.tokens == int((targets >= 0).sum())
    assert stale.weight_mean == pytest.approx(float(expected.mean()), rel=1e-12)
    assert float((expected - 1).abs().max()) > 1e-3, "non-vacuous: the weights moved away from 1"


def test_clipping_leaves_grad_the_same_way_for_fp32_and_bf16_checkpoints() -> None:
    """Was a bug found by this canary (BF16 clipped only the master copies); the oracle models torch's rule."""
    ratios = {}
    for dtype in (torch.float32, torch.bfloat16):
        trainer = trainer_with_policy(rt.ModelConfig.tiny(dtype=dtype))
        out = trainer.forward(rt.ForwardInput(torch.arange(1, 9)), options=rt.ForwardOptions(corrections=()))
        trainer.backward(-out.target_logprobs.sum())
        before = {n: p.grad.float().norm() for n, p in trainer.checkpoint("policy").named_parameters()}
        assert trainer.optim_step(max_grad_norm=1e-3)["policy"].clipped
        ratios[dtype] = max(
            float(p.grad.float().norm() / before[n]) for n, p in trainer.checkpoint("policy").named_parameters()
        )
    assert ratios[torch.float32] == pytest.approx(ratios[torch.bfloat16], rel=1e-2), ratios


def test_nproc_sets_the_processes_and_logical_dp_follows() -> None:
    """``rtv run --nproc``: an argument of ``preset``, resolved once into the run's request, never the environment."""
    assert preset("gpu").processes == 2
    eight = preset("gpu", processes=8)
    assert (eight.processes, eight.logical_dp) == (8, 8)
    assert (preset("cpu", processes=2).logical_dp) == 2
    assert (preset("gpu", 3).processes, preset("gpu", 3).logical_dp) == (3, 3)
    assert preset("gpu").processes == 2, "a count given once changes nothing after"
    for bad in (0, True, "2"):
        with pytest.raises(SetupError, match="expected a positive int"):
            preset("gpu", processes=bad)
