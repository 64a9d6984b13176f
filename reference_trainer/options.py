"""Forward options: validation at construction, per-field resolution, capture.

NOTE [Option resolution]
  1. Every ``ForwardOptions`` field defaults to ``UNSET``; a set field is
     validated when the object is built, so a bad value never reaches a forward.
  2. Each field resolves on its own: per-input > per-call > trainer > default.
  3. Cross-field conflicts (a forced placement that its ``allow_*`` flag
     forbids) are checked after resolution, so a higher level may override
     either side.
  4. Options are resolved when the forward is submitted; the result is frozen
     and stored with the record, so later edits have no effect.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

from .errors import ConfigError, int_at_least, is_number

__all__ = [
    "UNSET",
    "ImportanceCorrection",
    "ForwardOptions",
    "ResolvedOptions",
    "resolve_options",
    "BACKWARD_STATES",
    "CORRECTION_POLICIES",
    "CORRECTION_LEVELS",
    "MAX_LOG_RATIO",
]

BACKWARD_STATES = ("auto", "retain", "offload", "replay")
CORRECTION_POLICIES = ("when_available", "always")
CORRECTION_LEVELS = ("token", "sequence", "geometric", "average")
# The default bound on a level's log-ratio before ``exp`` (NOTE [Importance correction] Rule 2): verl clamps
# its log-ratio at 20 the same way; ``e**20`` (4.9e8) times any sane cotangent stays finite in FP32.
MAX_LOG_RATIO = 20.0
# The largest bound allowed: ``e**700`` is finite in FP64 (the statistics' dtype), ``e**710`` is not.
_LOG_RATIO_CEILING = 700.0


class _Unset:
    """The "not set at this level" marker; one instance, kept through copy and pickle."""

    _instance: _Unset | None = None

    def __new__(cls) -> _Unset:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNSET"

    def __reduce__(self) -> str:
        return "UNSET"

    def __copy__(self) -> _Unset:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> _Unset:
        return self


UNSET: Any = _Unset()


@dataclass(frozen=True, kw_only=True)
class ImportanceCorrection:
    """Reweight stale token cotangents by ``clip(p_current / p_forward, clip_low, clip_high)``.

    ``clip_low`` and ``clip_high`` are finite with ``0 <= clip_low <= clip_high``.
    ``policy``: ``"when_available"`` corrects only with current log-probs the
    trainer already has (never adds a forward); ``"always"`` runs one no-grad
    forward at the current weights to get them.
    ``level`` (NOTE [Importance correction] Rule 9): ``"token"`` weighs each
    token by its own ratio; ``"sequence"`` every token of a sequence by the
    product of its tokens' ratios, ``"geometric"`` by their geometric mean,
    ``"average"`` by their arithmetic mean (each then clipped).
    ``max_log_ratio``: the level's log-ratio is bounded above by it before
    ``exp``, so no ratio overflows; a number in ``[0, 700]`` (default 20).
    """

    clip_low: float = 0.0
    clip_high: float = 5.0
    policy: str = "when_available"
    level: str = "token"
    max_log_ratio: float = MAX_LOG_RATIO

    def __post_init__(self) -> None:
        for name in ("clip_low", "clip_high"):
            value = getattr(self, name)
            if not is_number(value) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"ImportanceCorrection.{name}", value, "a finite number >= 0")
        if self.clip_low > self.clip_high:
            raise ConfigError(
                "ImportanceCorrection.clip_low",
                self.clip_low,
                f"a number <= clip_high={self.clip_high}",
            )
        if self.policy not in CORRECTION_POLICIES:
            raise ConfigError("ImportanceCorrection.policy", self.policy, f"one of {CORRECTION_POLICIES}")
        if self.level not in CORRECTION_LEVELS:
            raise ConfigError("ImportanceCorrection.level", self.level, f"one of {CORRECTION_LEVELS}")
        bound = self.max_log_ratio
        if not is_number(bound) or not 0 <= bound <= _LOG_RATIO_CEILING:
            raise ConfigError(
                "ImportanceCorrection.max_log_ratio", bound, f"a number >= 0 and <= {_LOG_RATIO_CEILING:g}"
            )


@dataclass(frozen=True, kw_only=True)
class ForwardOptions:
    """Per-forward behaviour; every field defaults to ``UNSET`` (see NOTE [Option resolution]).

    ``max_gradient_staleness``: int >= 0 (default 2; 0 is strict).
    ``corrections``: at most one :class:`ImportanceCorrection` (default one
    ``ImportanceCorrection()``; an empty tuple disables correction).
    ``backward_state``: ``"auto" | "retain" | "offload" | "replay"`` (default ``"auto"``).
    ``allow_offload`` / ``allow_replay``: bool (default True).
    ``max_behaviour_staleness``: ``None`` (default, no bound) or an int >= 0:
    tokens whose behaviour lag exceeds it are masked (NOTE [Behaviour tokens]).
    ``behaviour_corrections``: at most one :class:`ImportanceCorrection` of the
    behaviour-vs-forward ratio (default ``()``, none; its ``policy`` is unused).
    """

    max_gradient_staleness: int = UNSET
    corrections: tuple[ImportanceCorrection, ...] = UNSET
    backward_state: str = UNSET
    allow_offload: bool = UNSET
    allow_replay: bool = UNSET
    max_behaviour_staleness: int | None = UNSET
    behaviour_corrections: tuple[ImportanceCorrection, ...] = UNSET

    def __post_init__(self) -> None:
        staleness = self.max_gradient_staleness
        if staleness is not UNSET and not int_at_least(staleness, 0):
            raise ConfigError("max_gradient_staleness", staleness, "an int >= 0 (not bool or float)")
        behaviour = self.max_behaviour_staleness
        if behaviour is not UNSET and behaviour is not None and not int_at_least(behaviour, 0):
            raise ConfigError("max_behaviour_staleness", behaviour, "None or an int >= 0 (not bool or float)")
        for name in ("corrections", "behaviour_corrections"):
            if getattr(self, name) is not UNSET:
                object.__setattr__(self, name, _validate_corrections(getattr(self, name), name))
        if self.backward_state is not UNSET and self.backward_state not in BACKWARD_STATES:
            raise ConfigError("backward_state", self.backward_state, f"one of {BACKWARD_STATES}")
        for name in ("allow_offload", "allow_replay"):
            value = getattr(self, name)
            if value is not UNSET and not isinstance(value, bool):
                raise ConfigError(name, value, "a bool")


def _validate_corrections(value: object, field: str) -> tuple[ImportanceCorrection, ...]:
    if isinstance(value, ImportanceCorrection):
        value = (value,)
    if not isinstance(value, Iterable) or isinstance(value, (str, bytes)):
        raise ConfigError(field, value, "a tuple of at most one ImportanceCorrection")
    items = tuple(value)
    if len(items) > 1:
        raise ConfigError(field, items, "at most one ImportanceCorrection", "keep one, or pass () to disable")
    for item in items:
        if not isinstance(item, ImportanceCorrection):
            raise ConfigError(field, item, "ImportanceCorrection instances")
    return items


@dataclass(frozen=True)
class ResolvedOptions:
    """Fully resolved options, frozen into a forward record."""

    max_gradient_staleness: int = 2
    corrections: tuple[ImportanceCorrection, ...] = (ImportanceCorrection(),)
    backward_state: str = "auto"
    allow_offload: bool = True
    allow_replay: bool = True
    max_behaviour_staleness: int | None = None
    behaviour_corrections: tuple[ImportanceCorrection, ...] = ()

    @property
    def correction(self) -> ImportanceCorrection | None:
        return self.corrections[0] if self.corrections else None

    @property
    def behaviour_correction(self) -> ImportanceCorrection | None:
        return self.behaviour_corrections[0] if self.behaviour_corrections else None


def resolve_options(*levels: ForwardOptions | None) -> ResolvedOptions:
    """Resolve field by field; ``levels`` go from highest precedence (input) to lowest (trainer)."""
    resolved: dict[str, Any] = {}
    for field in fields(ForwardOptions):
        for level in levels:
            value = UNSET if level is None else getattr(level, field.name)
            if value is not UNSET:
                resolved[field.name] = value
                break
    result = ResolvedOptions(**resolved)
    if result.backward_state == "offload" and not result.allow_offload:
        raise ConfigError("backward_state", "offload", "a placement allowed by allow_offload=False")
    if result.backward_state == "replay" and not result.allow_replay:
        raise ConfigError("backward_state", "replay", "a placement allowed by allow_replay=False")
    return result
