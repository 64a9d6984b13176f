"""This project's trainer behind the protocol: every capability, resumes bitwise.

The trainer trains one full checkpoint (``add_checkpoint(full=True)``) over a
frozen base; ``module()`` is a copy of the base whose trainable parameters
*are* the checkpoint's live ``nn.Parameter`` objects, so the suite's
snapshots and ``.grad`` reads see exactly what the trainer holds (the
trainer swaps a parameter's storage on copy-on-write, never the object:
NOTE [Weight captures] Rule 2). A forward is one ``ForwardInput`` per row,
its ``target_logprobs`` stacked to ``(B, T)``; the staleness bound is the
spec's ``max_staleness``. With a process group of more than one process,
``optim_step`` first sums ``.grad`` over it (each process backpropagated
its own rows of the batch).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import Tensor

import reference_trainer as rt
from validation.trainers import POLICY, trainer_with_policy

from ..protocol import ConformSpec
from .models import decoder

__all__ = ["ReferenceAdapter"]

_CHECKPOINT = POLICY


def _module_view(trainer: rt.Trainer) -> torch.nn.Module:
    """A copy of the base whose parameters are the checkpoint's live ones (module docstring)."""
    view = copy.deepcopy(trainer.model)
    for name, param in trainer.checkpoint(_CHECKPOINT).named_parameters():
        owner, _, leaf = name.rpartition(".")
        setattr(view.get_submodule(owner), leaf, param)
    return view


class ReferenceAdapter:
    """``reference_trainer.Trainer`` with one full checkpoint stepping AdamW at the spec's settings."""

    name = "reference"
    capabilities = frozenset({"stale", "save", "processes"})
    bitwise_resume = True
    notes = "reference_trainer.Trainer, one full checkpoint, max_gradient_staleness = spec.max_staleness"

    def start(self, spec: ConformSpec) -> None:
        self._spec = spec
        options = rt.ForwardOptions(max_gradient_staleness=spec.max_staleness)
        optimizer = rt.AdamWConfig(lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
        self._trainer = trainer_with_policy(decoder(spec), optimizer=optimizer, options=options)
        self._view = _module_view(self._trainer)

    def module(self) -> torch.nn.Module:
        return self._view

    def forward(self, input_tokens: Tensor, target_tokens: Tensor) -> Tensor:
        rows = [
            rt.ForwardInput(input_tokens=ids, target_tokens=targets)
            for ids, targets in zip(input_tokens, target_tokens)
        ]
        return torch.stack([output.target_logprobs for output in self._trainer.forward(rows)])

    def backward(self, loss: Tensor) -> None:
        self._trainer.backward(loss)

    def optim_step(self) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            for _, param in self._trainer.checkpoint(_CHECKPOINT).named_parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad)
        self._trainer.optim_step()

    def zero_grad(self) -> None:
        self._trainer.zero_grad()

    def save(self, path: str) -> None:
        self._trainer.save(path)

    def load(self, path: str) -> None:
        self._trainer = rt.Trainer.load(path, decoder(self._spec))
        self._view = _module_view(self._trainer)
