"""``validation.misses.MissLog``: each planner miss is one write-once, verified record that replays on a CPU."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch

import reference_trainer as rt
from reference_trainer import planner
from validation.evidence import EvidenceError, verify
from validation.misses import MISS_KIND, MissLog
from validation.trainers import trainer_with_policy

_REAL = planner.analytic_saved_bytes


def test_a_forced_miss_is_one_verified_record_that_replays_to_its_estimate(tmp_path: Path) -> None:
    trainer = trainer_with_policy()
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    inputs = [rt.ForwardInput(row[:-1].clone(), row[1:].clone()) for row in tokens]
    log = MissLog(tmp_path)
    with (
        mock.patch.object(planner, "analytic_saved_bytes", lambda *a, **k: _REAL(*a, **k) // 3),
        rt.observe_planner_misses(log),
    ):
        outputs = trainer.forward(inputs, options=rt.ForwardOptions(backward_state="retain", corrections=()))
    trainer.backward(-sum(o.target_logprobs.sum() for o in outputs))
    assert log.paths == list(tmp_path.glob("*.json")) and len(log.paths) == 1
    record = verify(log.paths[0])
    assert record["kind"] == MISS_KIND and record["passed"] and record["source"]["sha256"]
    miss = record["measurements"]
    assert miss["kind"] == "saved_bytes_exceeded" and miss["measured"] > miss["estimate"]
    with mock.patch.object(planner, "analytic_saved_bytes", lambda *a, **k: _REAL(*a, **k) // 3):
        assert rt.replay_estimate(miss["inputs"]) == miss["estimate"]  # from the file alone, on a CPU
    tampered = log.paths[0].read_text().replace(f'"estimate": {miss["estimate"]}', '"estimate": 1')
    log.paths[0].chmod(0o644)
    log.paths[0].write_text(tampered)
    with pytest.raises(EvidenceError, match="digest"):  # the digest no longer matches
        verify(log.paths[0])
