"""The planner's constants (NOTE [Planner calibration constants]): loaded by a trainer, pricing its decisions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import reference_trainer as rt
from validation.trainers import trainer_with_policy

CONSTANTS = {"seconds_per_byte": 1e-6, "seconds_per_token": 1e-3, "seconds_per_record": 0.5}


def _first_decision(**options) -> rt.PlacementDecision:
    trainer = trainer_with_policy(lora=rt.LoRAConfig(rank=4), **options)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    outputs = trainer.forward([rt.ForwardInput(row[:-1].clone(), row[1:].clone()) for row in tokens])
    trainer.backward(-sum(o.target_logprobs.sum() for o in outputs))
    return outputs[0].decision


@pytest.mark.parametrize("where", ["top", "evidence"])
def test_a_loaded_calibration_prices_offload_and_replay(tmp_path: Path, where: str) -> None:
    path = tmp_path / "calibration.json"
    body = CONSTANTS if where == "top" else {"measurements": {"calibration": {"constants": CONSTANTS}}}
    path.write_text(json.dumps(body))
    decision = _first_decision(planner_calibration=path)
    saved, tokens = decision.saved_bytes, 2 * 16  # the first forward: no measured speed yet, the calibration's
    assert decision.predicted_seconds["offload"] == pytest.approx(2 * saved * 1e-6 + 0.5)
    assert decision.predicted_seconds["replay"] == pytest.approx(tokens * 1e-3 + 0.5)
    default = _first_decision().predicted_seconds  # negative control: the defaults price otherwise
    assert default["offload"] == pytest.approx(2 * saved / 4e9) and default["replay"] == pytest.approx(tokens * 2e-5)


def test_a_fit_that_found_transfers_free_prices_offload_at_its_overhead(tmp_path: Path) -> None:
    decision = _first_decision(planner_calibration=rt.PlannerCalibration(0.0, 1e-3, 0.25))
    assert decision.predicted_seconds["offload"] == 0.25


@pytest.mark.parametrize(
    "body",
    [
        {"seconds_per_byte": 1e-6},
        {**CONSTANTS, "seconds_per_byte": float("nan")},
        {**CONSTANTS, "seconds_per_token": -1.0},
        {**CONSTANTS, "seconds_per_record": "1"},
    ],
)
def test_a_bad_calibration_is_refused_before_the_model_is_touched(tmp_path: Path, body: dict) -> None:
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(body))
    model = rt.DecoderLM(rt.ModelConfig.tiny(), seed=0)
    with pytest.raises(rt.ConfigError, match="planner_calibration"):
        rt.Trainer(model, planner_calibration=path)
    assert all(p.requires_grad for p in model.parameters())  # not frozen: nothing changed
    with pytest.raises(rt.ConfigError, match="planner_calibration"):
        rt.Trainer(model, planner_calibration=tmp_path / "missing.json")


def test_a_loaded_trainer_takes_its_calibration_again_as_the_machines(tmp_path: Path) -> None:
    calibration = rt.PlannerCalibration(**CONSTANTS)
    trainer = trainer_with_policy(lora=rt.LoRAConfig(rank=4), planner_calibration=calibration)
    trainer.save(tmp_path / "save")

    def first_decision(**options) -> rt.PlacementDecision:
        loaded = rt.Trainer.load(tmp_path / "save", rt.DecoderLM(rt.ModelConfig.tiny(), seed=0), **options)
        tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
        return loaded.forward([rt.ForwardInput(row[:-1].clone(), row[1:].clone()) for row in tokens])[0].decision

    decision = first_decision(planner_calibration=calibration)
    assert decision.predicted_seconds["replay"] == pytest.approx(2 * 16 * 1e-3 + 0.5)
    assert first_decision().predicted_seconds["replay"] == pytest.approx(2 * 16 * 2e-5)  # not kept: the default
    with pytest.raises(rt.ConfigError, match="planner_calibration"):
        first_decision(planner_calibration=tmp_path / "missing.json")
