"""The planner's constants, default or fitted by the planner canary and loaded by a trainer.

NOTE [Planner calibration constants]
  1. Three constants price offload and replay (NOTE [Memory admission] Rule
     3): ``seconds_per_byte`` (one transfer of one saved byte; offload moves
     each byte twice), ``seconds_per_token`` (one forward, per token: a
     replay's price until the trainer has measured its own forwards, which
     then win) and ``seconds_per_record`` (an overhead of each offloaded or
     replayed record).
  2. Defaults: host copies at 4 GB/s, 2e-5 s per token, no per-record
     overhead. ``Trainer(..., planner_calibration=...)`` takes a
     :class:`PlannerCalibration`, or the path of a JSON file holding the three
     constants, either at its top level or where the planner canary's
     evidence writes them (``measurements.calibration.constants``), so one
     calibrated run's record is loaded as it is. The file is only read; its
     digest is the harness's to verify (``validation.evidence.verify``).
  3. A constant missing, not a finite number, or negative is a
     ``ConfigError``. Zero is a constant like any other (a fit on a CPU may
     find transfers free: ``seconds_per_byte`` 0).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields
from typing import Any

from .errors import ConfigError, is_number
from .planner import DEFAULT_SECONDS_PER_TOKEN

__all__ = ["PlannerCalibration", "resolve_calibration"]

_DEFAULT_TRANSFER_BYTES_PER_SECOND = 4e9  # host copies at a few GB/s (CPU memcpy or PCIe)


@dataclass(frozen=True)
class PlannerCalibration:
    """The planner's three constants (NOTE [Planner calibration constants])."""

    seconds_per_byte: float
    seconds_per_token: float
    seconds_per_record: float

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            valid = is_number(value) and math.isfinite(value) and value >= 0
            if not valid:
                raise ConfigError(f"planner_calibration.{f.name}", value, "a finite number >= 0")

    @property
    def transfer_bytes_per_second(self) -> float:
        """The transfer bandwidth ``seconds_per_byte`` stands for (infinite at 0: a fit that found transfers free)."""
        return 1.0 / self.seconds_per_byte if self.seconds_per_byte > 0 else math.inf

    @classmethod
    def defaults(cls) -> PlannerCalibration:
        return cls(1.0 / _DEFAULT_TRANSFER_BYTES_PER_SECOND, DEFAULT_SECONDS_PER_TOKEN, 0.0)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PlannerCalibration:
        """Rule 2: the constants of a JSON file, at its top level or under ``measurements.calibration.constants``."""
        try:
            with open(path, encoding="utf-8") as file:
                data: Any = json.load(file)
        except (OSError, ValueError) as error:
            raise ConfigError("planner_calibration", os.fspath(path), f"a readable JSON file ({error})") from error
        if isinstance(data, dict) and "measurements" in data:
            data = data["measurements"].get("calibration", {}).get("constants")
        names = [f.name for f in fields(cls)]
        if not isinstance(data, dict) or any(name not in data for name in names):
            raise ConfigError("planner_calibration", os.fspath(path), f"a JSON object with {', '.join(names)}")
        return cls(**{name: data[name] for name in names})


def resolve_calibration(value: PlannerCalibration | str | os.PathLike[str] | None) -> PlannerCalibration | None:
    """A trainer's ``planner_calibration`` argument as constants (``None``: the defaults, chosen by admission)."""
    if value is None or isinstance(value, PlannerCalibration):
        return value
    if isinstance(value, (str, os.PathLike)):
        return PlannerCalibration.load(value)
    raise ConfigError("planner_calibration", value, "None, a PlannerCalibration or the path of a JSON file")
