"""Planner misses on record: an observer that writes each miss as write-once, verified evidence.

:class:`MissLog` is passed to ``reference_trainer.observe_planner_misses``
(NOTE [Planner misses]). Each miss becomes one record of kind
``planner-miss`` (``validation.evidence.make_record``: the source digest and
environment included) at ``evidence_path(folder, "planner-miss")``, written
once; its one check is that the estimator's plain inputs replay to the same
estimate (``reference_trainer.replay_estimate``), so a record that cannot be
replayed on a CPU says so.
"""

from __future__ import annotations

from pathlib import Path

from reference_trainer import PlannerMiss, replay_estimate

from .evidence import Checks, evidence_path, make_record, write_once

__all__ = ["MISS_KIND", "MissLog"]

MISS_KIND = "planner-miss"


class MissLog:
    """Writes every miss it is given under ``folder``; ``paths`` lists what it wrote, in order."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.paths: list[Path] = []

    def __call__(self, miss: PlannerMiss) -> None:
        checks = Checks()
        replayed = replay_estimate(miss.inputs)
        checks.check(
            "the estimator's inputs replay to the estimate",
            replayed == miss.estimate,
            f"replayed {replayed} B, estimated {miss.estimate} B",
        )
        record = make_record(MISS_KIND, config={"kind": miss.kind}, checks=checks, measurements=miss.as_dict())
        self.paths.append(write_once(evidence_path(self.folder, MISS_KIND), record))
