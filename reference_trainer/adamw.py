"""AdamW: the settings a checkpoint steps with, and the saved state it may load.

A checkpoint steps one fixed variant of ``torch.optim.AdamW``: one parameter
group, the four settings of :class:`AdamWConfig` and torch's defaults for
every other flag. :func:`check_adamw_state` refuses, before anything is
loaded, any state that this optimizer could not step exactly: a slot or
setting missing, of the wrong type or out of range, a non-finite moment, or
another variant's flags. Without it such a state loads silently and the next
``optim_step`` fails half-way (after clipping rewrote ``.grad``) or turns the
parameters into NaN.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from .errors import ConfigError, is_number

__all__ = ["AdamWConfig", "SLOTS", "check_adamw_state"]

SLOTS = ("step", "exp_avg", "exp_avg_sq")
"""The per-parameter state AdamW keeps once a parameter has stepped (``amsgrad=False``)."""


@dataclass(frozen=True, kw_only=True)
class AdamWConfig:
    """AdamW settings; defaults are ``torch.optim.AdamW``'s.

    ``lr``, ``eps``, ``weight_decay``: finite numbers >= 0; ``betas``: two numbers in [0, 1).
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2

    def __post_init__(self) -> None:
        for name in ("lr", "eps", "weight_decay"):
            value = getattr(self, name)
            if not is_number(value) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"AdamWConfig.{name}", value, "a finite number >= 0")
        betas = self.betas
        if (
            not isinstance(betas, Sequence)
            or isinstance(betas, str)
            or len(betas) != 2
            or not all(is_number(b) and 0.0 <= b < 1.0 for b in betas)
        ):
            raise ConfigError("AdamWConfig.betas", betas, "two numbers in [0, 1), e.g. (0.9, 0.999)")
        object.__setattr__(self, "betas", tuple(betas))


def check_adamw_state(state: Any, live: Mapping[str, Any], shapes: Sequence[tuple[int, ...]], where: str) -> None:
    """Raise ``ConfigError`` unless ``state`` is an AdamW state dict the optimizer ``live`` can step.

    ``live``: the optimizer's own ``state_dict()`` (its group's flags are the
    ones a loaded state must keep); ``shapes``: its parameters' shapes, in
    order; ``where``: the caller's name for ``state`` in messages.
    """
    if not isinstance(state, Mapping) or not {"state", "param_groups"} <= set(state):
        found = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise ConfigError(where, found, "an AdamW state dict with keys 'state' and 'param_groups'")
    ids = _check_group(state["param_groups"], live["param_groups"][0], len(shapes), f"{where}['param_groups']")
    slots = state["state"]
    if not isinstance(slots, Mapping) or not set(slots) <= set(ids):
        found = sorted(slots) if isinstance(slots, Mapping) else type(slots).__name__
        raise ConfigError(f"{where}['state']", found, f"a mapping keyed by the group's parameter ids {sorted(ids)}")
    by_id = dict(zip(ids, shapes))
    for key, entry in slots.items():
        _check_slots(entry, by_id[key], f"{where}['state'][{key!r}]")


def _check_group(groups: Any, live: Mapping[str, Any], count: int, where: str) -> list[Any]:
    """One group: ``count`` distinct ids, valid settings, every other flag as ``live`` has it; its ids."""
    if not isinstance(groups, (list, tuple)) or len(groups) != 1 or not isinstance(groups[0], Mapping):
        raise ConfigError(where, groups, "a list of one parameter group")
    group, where = groups[0], f"{where}[0]"
    if set(group) != set(live):
        raise ConfigError(
            where, sorted(group), f"exactly the keys {sorted(live)}", "save it with Checkpoint.state_dict()"
        )
    ids = group["params"]
    if not isinstance(ids, (list, tuple)) or len(ids) != count or len(set(ids)) != count:
        raise ConfigError(f"{where}['params']", ids, f"{count} distinct parameter ids")
    settings = {f.name: group[f.name] for f in fields(AdamWConfig)}
    try:
        AdamWConfig(**settings)
    except ConfigError as error:
        name = error.field.removeprefix("AdamWConfig.")
        raise ConfigError(f"{where}[{name!r}]", error.value, error.allowed) from None
    for key, value in live.items():
        if key not in settings and key != "params" and group[key] != value:
            raise ConfigError(
                f"{where}[{key!r}]", group[key], f"{value!r}, the flag this checkpoint's AdamW steps with"
            )
    return list(ids)


def _check_slots(entry: Any, shape: tuple[int, ...], where: str) -> None:
    """A stepped parameter's slots: a finite step >= 0, finite moments shaped like it, the second >= 0."""
    if not isinstance(entry, Mapping) or set(entry) != set(SLOTS):
        found = sorted(entry) if isinstance(entry, Mapping) else type(entry).__name__
        raise ConfigError(where, found, f"a mapping of exactly the AdamW slots {list(SLOTS)}")
    step = entry["step"]
    if not _is_float_tensor(step) or step.dim() != 0 or not math.isfinite(float(step)) or float(step) < 0:
        raise ConfigError(f"{where}['step']", _describe(step), "a finite floating-point 0-d tensor >= 0")
    for slot in ("exp_avg", "exp_avg_sq"):
        value = entry[slot]
        if not _is_float_tensor(value) or tuple(value.shape) != shape:
            raise ConfigError(f"{where}[{slot!r}]", _describe(value), f"a floating-point tensor of shape {shape}")
        if not bool(torch.isfinite(value).all()) or (slot == "exp_avg_sq" and bool((value < 0).any())):
            bound = " and >= 0" if slot == "exp_avg_sq" else ""
            raise ConfigError(f"{where}[{slot!r}]", "a non-finite or negative entry", f"finite entries{bound}")


def _is_float_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of dtype {value.dtype}, shape {tuple(value.shape)}" + (
            f", value {value.item()}" if value.numel() == 1 else ""
        )
    return repr(value)
