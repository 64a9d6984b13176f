"""The weights of a checkpoint's state dict, checked before anything is loaded.

``Checkpoint.check_state_dict`` refuses a state that does not fit the
checkpoint exactly, so a refused ``load_checkpoint`` (or ``Trainer.load``)
changes nothing. :func:`check_weight_state` checks its weights: that the
state is a mapping with the keys ``parameters``, ``optimizer`` and
``revision``; that ``parameters`` names exactly the checkpoint's
parameters and ``master_parameters`` (optional: the FP32 masters of
parameters below FP32) a subset of them; that each is a floating-point
tensor of its parameter's shape (the dtype may differ: ``load`` copies it
in). The optimizer state is ``adamw.check_adamw_state``'s; the revision is
the checkpoint's own. Each refusal is a ``ConfigError`` naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from .errors import ConfigError

__all__ = ["check_weight_state"]


def check_weight_state(state: Any, params: Mapping[str, nn.Parameter]) -> None:
    """Raise ``ConfigError`` unless ``state`` is a state-dict mapping whose weights fit ``params`` (name -> live
    parameter) exactly."""
    if not isinstance(state, Mapping):
        raise ConfigError("state_dict", type(state).__name__, "a mapping from Checkpoint.state_dict()")
    missing = {"parameters", "optimizer", "revision"} - set(state)
    if missing:
        raise ConfigError(
            "state_dict", sorted(state), f"keys parameters, optimizer, revision (missing {sorted(missing)})"
        )
    parameters = state["parameters"]
    if not isinstance(parameters, Mapping) or set(parameters) != set(params):
        found = sorted(set(parameters) ^ set(params)) if isinstance(parameters, Mapping) else type(parameters).__name__
        raise ConfigError(
            "state_dict['parameters']",
            found,
            "exactly this checkpoint's parameter names (listed: the difference)",
        )
    _check_tensors("parameters", parameters, params)
    masters = state.get("master_parameters", {})
    if not isinstance(masters, Mapping) or not set(masters) <= set(params):
        found = sorted(set(masters) - set(params)) if isinstance(masters, Mapping) else type(masters).__name__
        raise ConfigError("state_dict['master_parameters']", found, "a subset of this checkpoint's parameter names")
    _check_tensors("master_parameters", masters, params)


def _check_tensors(key: str, tensors: Mapping[str, Any], params: Mapping[str, nn.Parameter]) -> None:
    for name, value in tensors.items():
        shape = tuple(params[name].shape)
        where = f"state_dict[{key!r}][{name!r}]"
        if not isinstance(value, Tensor) or not value.dtype.is_floating_point:
            found = (
                f"{type(value).__name__} of dtype {value.dtype}" if isinstance(value, Tensor) else type(value).__name__
            )
            raise ConfigError(where, found, "a floating-point tensor")
        if tuple(value.shape) != shape:
            raise ConfigError(where, tuple(value.shape), f"shape {shape}")
