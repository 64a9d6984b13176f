"""LoRA adapters for the decoder's attention and MLP projections.

An adapter lives outside the base model (so the model keeps exactly the
``Qwen3ForCausalLM`` parameter names) and is attached for the duration of a
forward by :func:`attach_lora`. For a target projection with weight ``W``:
``y = x W^T + (alpha / rank) * (x A^T) B^T`` with ``A: (rank, in)`` initialised
like PEFT (Kaiming-uniform) and ``B: (out, rank)`` zero, so a fresh adapter
reproduces the base model exactly. Parameter names follow PEFT:
``model.layers.0.self_attn.q_proj.lora_A.weight``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from .errors import ConfigError, int_at_least, is_number
from .model import DecoderLM, Projection

__all__ = ["LoRAConfig", "LoRAAdapter", "adapter_shapes", "attach_lora", "freeze", "ALL_PROJECTIONS"]

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_M = TypeVar("_M", bound=nn.Module)


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """``rank`` > 0, ``alpha`` > 0 (scaling is ``alpha / rank``), projection names to adapt."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ALL_PROJECTIONS

    def __post_init__(self) -> None:
        if not int_at_least(self.rank, 1):
            raise ConfigError("LoRAConfig.rank", self.rank, "a positive int")
        if not (is_number(self.alpha) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ConfigError("LoRAConfig.alpha", self.alpha, "a finite positive number")
        targets = tuple(self.targets)
        unknown = sorted(set(targets) - set(ALL_PROJECTIONS))
        if not targets or unknown:
            raise ConfigError("LoRAConfig.targets", self.targets, f"a non-empty subset of {ALL_PROJECTIONS}")
        object.__setattr__(self, "targets", targets)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def _target_projections(model: DecoderLM, targets: tuple[str, ...]) -> Iterator[tuple[str, Projection]]:
    for path, module in model.named_modules():
        if isinstance(module, Projection) and path.rsplit(".", 1)[-1] in targets:
            yield path, module


def adapter_shapes(model: DecoderLM, config: LoRAConfig) -> dict[str, tuple[int, ...]]:
    """The name and shape of every factor a :class:`LoRAAdapter` of ``config`` has for ``model``, in model order."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path, proj in _target_projections(model, config.targets):
        shapes[f"{path}.lora_A.weight"] = (config.rank, proj.in_features)
        shapes[f"{path}.lora_B.weight"] = (proj.out_features, config.rank)
    return shapes


class LoRAAdapter:
    """The trainable low-rank factors for one model; the base stays untouched.

    ``named_parameters()`` yields ``(name, nn.Parameter)`` in model order.
    """

    def __init__(self, model: DecoderLM, config: LoRAConfig, *, seed: int | None = None) -> None:
        self.config = config
        weight = model.lm_head.weight
        generator = torch.Generator(device=weight.device).manual_seed(seed) if seed is not None else None
        self._params: dict[str, nn.Parameter] = {}
        for path, proj in _target_projections(model, config.targets):
            a = torch.empty(config.rank, proj.in_features, dtype=weight.dtype, device=weight.device)
            # PEFT's default: kaiming_uniform_(a=sqrt(5)) == U(-1/sqrt(in), 1/sqrt(in)).
            bound = 1.0 / math.sqrt(proj.in_features)
            a.uniform_(-bound, bound, generator=generator)
            b = torch.zeros(proj.out_features, config.rank, dtype=weight.dtype, device=weight.device)
            self._params[f"{path}.lora_A.weight"] = nn.Parameter(a)
            self._params[f"{path}.lora_B.weight"] = nn.Parameter(b)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        yield from self._params.items()

    def parameters(self) -> Iterator[nn.Parameter]:
        yield from self._params.values()

    @contextmanager
    def attached(self, model: DecoderLM) -> Iterator[DecoderLM]:
        """Run ``model`` with this adapter's live parameters inside the block."""
        with attach_lora(model, self.config, self._params):
            yield model

    def merged_state_dict(self, model: DecoderLM) -> dict[str, torch.Tensor]:
        """The base state dict with ``W + scaling * B A`` folded into each target (for export and tests)."""
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for path, _ in _target_projections(model, self.config.targets):
                a = self._params[f"{path}.lora_A.weight"]
                b = self._params[f"{path}.lora_B.weight"]
                key = f"{path}.weight"
                state[key] = (state[key].float() + self.config.scaling * (b.float() @ a.float())).to(state[key].dtype)
        return state


@contextmanager
def attach_lora(model: DecoderLM, config: LoRAConfig, tensors: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Attach the factors in ``tensors`` (adapter names) to ``model`` inside the block.

    The tensors may be live parameters or immutable snapshots of them; the
    autograd graph built inside the block references exactly these tensors.
    """
    attached: list[Projection] = []
    try:
        for path, proj in _target_projections(model, config.targets):
            proj.lora = (tensors[f"{path}.lora_A.weight"], tensors[f"{path}.lora_B.weight"], config.scaling)
            attached.append(proj)
        yield
    finally:
        for proj in attached:
            proj.lora = None


def freeze(model: _M) -> _M:
    """Make every parameter of ``model`` non-trainable; returns ``model``."""
    for param in model.parameters():
        param.requires_grad_(False)
    return model
