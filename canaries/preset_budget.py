"""What a GPU preset needs on the device, estimated before anything is allocated, and the refusal when it cannot fit.

The estimate is arithmetic on shapes: parameter counts come from models built
on the ``meta`` device (no memory: one and two decoder layers, so the 36-layer
8B shape costs two small constructions) and activation bytes from the
trainer's own analytic model (``reference_trainer.planner.analytic_saved_bytes``,
which over-counts). For a canary with the FP64 oracle it adds the oracle's
FP64 model, its plain-autograd baseline model in the preset's dtype and their
activations (FP64 attention runs the math backend on CUDA, so its scores are
saved). Every GPU preset prints its estimate and raises ``SetupError`` when it
exceeds the device before it builds a model (:func:`check_fits`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from reference_trainer import DecoderLM, LoRAAdapter, ModelConfig
from reference_trainer.planner import analytic_saved_bytes, attention_saves_scores
from validation.errors import SetupError

from .presets import Preset

__all__ = ["PENDING_FORWARDS", "MemoryEstimate", "check_fits", "device_bytes", "estimate", "parameter_count"]

PENDING_FORWARDS = 4  # forwards a canary keeps pending at once, each with its saved activations
GB = 1e9


def parameter_count(config: ModelConfig) -> int:
    """Parameters of ``config``'s model, from meta constructions of one and two layers (nothing allocated)."""
    with torch.device("meta"):
        one = sum(p.numel() for p in DecoderLM(config.replace(num_hidden_layers=1)).parameters())
        two = sum(p.numel() for p in DecoderLM(config.replace(num_hidden_layers=2)).parameters())
    return one + (two - one) * (config.num_hidden_layers - 1)


def _adapter_count(config: ModelConfig, preset: Preset) -> int:
    if preset.lora is None:
        return 0
    with torch.device("meta"):
        model = DecoderLM(config.replace(num_hidden_layers=1))
        per_layer = sum(p.numel() for p in LoRAAdapter(model, preset.lora).parameters())
    return per_layer * config.num_hidden_layers


@dataclass(frozen=True)
class MemoryEstimate:
    """Device bytes by part; ``total`` is their sum."""

    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        lines = [f"  {name}: {value / GB:.1f} GB" for name, value in self.parts.items()]
        return "\n".join([f"memory estimate {self.total / GB:.1f} GB:", *lines])


def estimate(preset: Preset, *, oracle: bool) -> MemoryEstimate:
    """The device bytes ``preset`` needs: its trainer, and with ``oracle`` the FP64 oracle beside it."""
    config = preset.oracle_model if oracle else preset.model
    dtype_bytes = config.dtype.itemsize
    params, adapter = parameter_count(config), _adapter_count(config, preset)
    trainable = adapter if preset.lora is not None else params
    scores = attention_saves_scores(config.dtype, "cuda", config.dropout, fused_enabled=True)
    activations = analytic_saved_bytes(config, preset.sequences, preset.seq_len, scores_saved=scores)
    parts = {
        "trainer model": params * dtype_bytes,
        "trainable copies (snapshots, staging, FP32 masters and AdamW)": trainable * (3 * dtype_bytes + 4 * 4),
        f"trainer activations ({PENDING_FORWARDS} pending forwards)": PENDING_FORWARDS * activations,
    }
    if oracle:
        fp64 = config.replace(dtype=torch.float64)
        parts["oracle FP64 model"] = params * 8
        parts["oracle FP64 trainable versions and AdamW"] = trainable * 8 * 6
        parts["oracle FP64 activations"] = analytic_saved_bytes(fp64, preset.sequences, preset.seq_len)
        parts["oracle baseline model"] = params * dtype_bytes
        parts["oracle baseline activations"] = activations
    return MemoryEstimate(parts)


def device_bytes(device: str) -> int | None:
    """Total memory of ``device`` (``None`` off CUDA: nothing to check)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.device(device)).total_memory


def check_fits(
    preset: Preset, *, oracle: bool, capacity: int | None = None, echo: Callable[[str], None] = print
) -> MemoryEstimate:
    """Print ``preset``'s estimate; raise ``SetupError`` if it exceeds ``capacity`` (default: the device's memory)."""
    found = estimate(preset, oracle=oracle)
    capacity = device_bytes(preset.device) if capacity is None else capacity
    echo(f"preset {preset.name}: {found.describe()}")
    if capacity is not None and found.total > capacity:
        raise SetupError(
            f"preset {preset.name} needs about {found.total / GB:.1f} GB, the device has {capacity / GB:.1f} GB",
            fix="run it on a larger device, or lower the preset's sequences, seq_len or oracle_layers",
        )
    return found
