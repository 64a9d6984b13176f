"""What a forward takes and returns: inputs, their padded batch and the outputs a caller gets (NOTE [Forward records] in ``records.py``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .checkpoints import CheckpointVersion
from .errors import ConfigError
from .host_reads import read_on_host
from .options import ForwardOptions
from .planner import PlacementDecision, RecordUsage

__all__ = ["ForwardInput", "ForwardOutput", "PaddedBatch", "check_token_range", "flatten_inputs"]


@dataclass(frozen=True)
class ForwardInput:
    """One sequence: 1-D ``input_tokens`` and same-length ``target_tokens``.

    ``target_logprobs[t] = log p(target_tokens[t] | input_tokens[:t+1])``; a
    negative target masks position ``t`` (log-prob 0, no gradient). With
    ``target_tokens=None`` the targets are the inputs shifted left by one, the
    last position masked. ``options`` override the call's and trainer's.

    ``behaviour_logprobs`` (floating), ``behaviour_revisions`` and
    ``behaviour_generations`` (integer), each ``None`` or of
    ``input_tokens``' shape and aligned with ``target_logprobs``: the log-prob
    the sampler gave each target token and the revision and generation of the
    weights that drew it (-1: unknown); a rollout engine's
    ``Sample.aligned_behaviour_logprobs``, ``aligned_behaviour_revisions`` and
    ``aligned_behaviour_generations`` (NOTE [Behaviour tokens] in ``behaviour.py``).
    """

    input_tokens: torch.Tensor
    target_tokens: torch.Tensor | None = None
    options: ForwardOptions | None = None
    behaviour_logprobs: torch.Tensor | None = None
    behaviour_revisions: torch.Tensor | None = None
    behaviour_generations: torch.Tensor | None = None

    def __post_init__(self) -> None:
        tokens = self.input_tokens
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.numel() == 0:
            raise ConfigError("input_tokens", _describe(tokens), "a non-empty 1-D integer tensor")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise ConfigError("input_tokens", tokens.dtype, "an integer dtype")
        targets = self.target_tokens
        if targets is not None and (
            not isinstance(targets, torch.Tensor)
            or tuple(targets.shape) != tuple(tokens.shape)
            or targets.dtype.is_floating_point
            or targets.dtype == torch.bool
        ):
            raise ConfigError(
                "target_tokens", _describe(targets), f"None or an integer tensor of shape {tuple(tokens.shape)}"
            )
        if self.options is not None and not isinstance(self.options, ForwardOptions):
            raise ConfigError("options", self.options, "None or a ForwardOptions")
        for name, floating in (
            ("behaviour_logprobs", True),
            ("behaviour_revisions", False),
            ("behaviour_generations", False),
        ):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, torch.Tensor)
                or tuple(value.shape) != tuple(tokens.shape)
                or value.dtype.is_floating_point != floating
                or value.dtype == torch.bool
            ):
                kind = "a floating" if floating else "an integer"
                raise ConfigError(name, _describe(value), f"None or {kind} tensor of shape {tuple(tokens.shape)}")

    def targets(self) -> torch.Tensor:
        if self.target_tokens is not None:
            return self.target_tokens
        shifted = torch.full_like(self.input_tokens, -1)
        shifted[:-1] = self.input_tokens[1:]
        return shifted


def _describe(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return f"tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    return value


@dataclass(kw_only=True)
class ForwardOutput:
    """What a forward returns for one input.

    ``target_logprobs``: FP32 leaf with ``requires_grad=True`` (plain tensor for
    ``checkpoint=BASE``). ``version``: the weights used (``None`` for BASE).
    ``placement`` and ``decision``: the planner's choice for the record;
    ``usage``: the bytes the record holds (device, host) and needs at backward.
    """

    target_logprobs: torch.Tensor
    version: CheckpointVersion | None
    placement: str
    decision: PlacementDecision | None = None
    record_id: int | None = None
    usage: RecordUsage | None = None


@dataclass
class PaddedBatch:
    """Right-padded ``(B, T)`` ids, real-token mask and targets (pads target -1).

    ``behaviour_logprobs`` (FP32, NaN where not given), ``behaviour_revisions`` and
    ``behaviour_generations`` (-1 where not given): ``None`` unless an input carries them.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    targets: torch.Tensor
    lengths: list[int]
    behaviour_logprobs: torch.Tensor | None = None
    behaviour_revisions: torch.Tensor | None = None
    behaviour_generations: torch.Tensor | None = None

    @classmethod
    def build(cls, inputs: Sequence[ForwardInput], device: torch.device) -> PaddedBatch:
        lengths = [int(i.input_tokens.numel()) for i in inputs]
        width = max(lengths)
        ids = torch.zeros(len(inputs), width, dtype=torch.long, device=device)
        targets = torch.full((len(inputs), width), -1, dtype=torch.long, device=device)
        for row, item in enumerate(inputs):
            ids[row, : lengths[row]] = item.input_tokens
            targets[row, : lengths[row]] = item.targets()
        mask = None
        if min(lengths) < width:
            mask = torch.arange(width, device=device).unsqueeze(0) < torch.tensor(lengths, device=device).unsqueeze(1)
        logprobs = _padded(inputs, "behaviour_logprobs", width, math.nan, torch.float32, device)
        revisions = _padded(inputs, "behaviour_revisions", width, -1, torch.long, device)
        generations = _padded(inputs, "behaviour_generations", width, -1, torch.long, device)
        return cls(ids, mask, targets, lengths, logprobs, revisions, generations)


def _padded(
    inputs: Sequence[ForwardInput], name: str, width: int, fill: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """The inputs' ``name`` tensors as one right-padded ``(B, width)`` copy (``fill`` elsewhere); ``None`` if none has one."""
    if all(getattr(item, name) is None for item in inputs):
        return None
    out = torch.full((len(inputs), width), fill, dtype=dtype, device=device)
    for row, item in enumerate(inputs):
        value = getattr(item, name)
        if value is not None:
            out[row, : value.shape[0]] = value
    return out


def flatten_inputs(inputs: object) -> tuple[list[ForwardInput], Callable[[list[Any]], Any]]:
    """Flatten a (nested) list of ``ForwardInput`` and return a function that rebuilds the shape."""
    flat, rebuild = _flatten(inputs)
    if not flat:
        raise ConfigError("inputs", inputs, "at least one ForwardInput")
    return flat, rebuild


def _flatten(inputs: object) -> tuple[list[ForwardInput], Callable[[list[Any]], Any]]:
    if isinstance(inputs, ForwardInput):
        return [inputs], lambda flat: flat[0]
    if not isinstance(inputs, (list, tuple)):
        raise ConfigError("inputs", type(inputs).__name__, "a ForwardInput or a (nested) list of them")
    flat: list[ForwardInput] = []
    parts = []
    for item in inputs:
        sub, rebuild = _flatten(item)
        parts.append((len(flat), len(sub), rebuild))
        flat.extend(sub)

    def rebuild_all(values: list[Any]) -> list[Any]:
        return [rebuild(values[start : start + count]) for start, count, rebuild in parts]

    return flat, rebuild_all


def check_token_range(flat: list[ForwardInput], vocab: int) -> None:
    """Raise ``ConfigError`` unless every input id is in ``[0, vocab)`` and every target id below ``vocab``.

    Inputs on the CPU are checked there; those on a device in one host read
    per device for the whole call (NOTE [Host syncs] in ``host_reads.py``).
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for item in flat:
        tokens, targets = item.input_tokens, item.targets()
        extremes = torch.stack((tokens.min(), tokens.max(), targets.max())).long()
        by_device.setdefault(tokens.device, []).append(extremes)
    for device, parts in by_device.items():
        stacked = torch.stack(parts)  # (inputs, 3)
        rows = stacked.tolist() if device.type == "cpu" else read_on_host(stacked, "token range")
        for low, high, target_high in rows:
            if low < 0 or high >= vocab or target_high >= vocab:
                raise ConfigError(
                    "input_tokens/target_tokens",
                    (low, high, target_high),
                    f"input ids in [0, {vocab}) and target ids < {vocab} (negative targets mask)",
                )
