"""What the suite feeds an adapter, and the checked calls it makes: seeded batches, log-probs, gradients.

A :class:`ConformBatch` is ``(B, T)`` token ids, targets and FP64 per-token
advantages, made from the spec's seed and a step number only (never from
the adapter). Row ``r`` masks its last ``min(r, T - 1)`` targets
(``MASKED``), so rows hold different token counts: a per-micro-batch mean
then differs from the batch's mean. :class:`Driven` wraps an adapter's calls
with the shape and type checks whose failure makes the adapter broken
(:class:`~validation.conform.protocol.AdapterError`, exit 2), not a failed check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .oracle import MASKED, suite_loss, trainable
from .protocol import AdapterError, ConformSpec, adapter_name, require_protocol

__all__ = ["ConformBatch", "Driven", "make_batch", "started"]


@dataclass(frozen=True)
class ConformBatch:
    """``ids``, ``targets`` (``MASKED`` where masked) and FP64 ``advantages``, each ``(B, T)``."""

    ids: Tensor
    targets: Tensor
    advantages: Tensor

    @property
    def active(self) -> int:
        return int((self.targets >= 0).sum())

    def rows(self, rows: slice | list[int]) -> ConformBatch:
        return ConformBatch(self.ids[rows], self.targets[rows], self.advantages[rows])

    def oracle_batch(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.ids, self.targets, self.advantages


def make_batch(spec: ConformSpec, step: int) -> ConformBatch:
    """The batch of ``step``: a function of ``(spec.seed, step)`` and the spec's shape alone."""
    generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + step)
    shape = (spec.batch, spec.seq_len)
    ids = torch.randint(0, spec.vocab_size, shape, generator=generator)
    targets = torch.randint(0, spec.vocab_size, shape, generator=generator)
    for row in range(1, spec.batch):
        targets[row, spec.seq_len - min(row, spec.seq_len - 1) :] = MASKED
    advantages = torch.randn(shape, generator=generator, dtype=torch.float64)
    return ConformBatch(ids, targets, advantages)


class Driven:
    """An adapter's calls with the protocol's return checks (module docstring)."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.name = adapter_name(adapter)

    def module(self) -> torch.nn.Module:
        module = self.adapter.module()
        if not isinstance(module, torch.nn.Module) or not trainable(module):
            is_module = isinstance(module, torch.nn.Module)
            found = "a module with no trainable parameter" if is_module else type(module).__name__
            raise AdapterError(
                self.name,
                f"module() returned {found}; expected the live torch.nn.Module whose "
                "requires_grad parameters are the weights it trains",
                fix="return the trained model (or a view sharing its parameters) from module()",
            )
        return module

    def forward(self, batch: ConformBatch) -> Tensor:
        """The adapter's ``(B, T)`` differentiable target log-probs of ``batch``."""
        logprobs = self.adapter.forward(batch.ids, batch.targets)
        shape = tuple(batch.ids.shape)
        if not isinstance(logprobs, Tensor) or tuple(logprobs.shape) != shape or not logprobs.requires_grad:
            found = (
                f"a tensor of shape {tuple(logprobs.shape)}, requires_grad={logprobs.requires_grad}"
                if isinstance(logprobs, Tensor)
                else type(logprobs).__name__
            )
            raise AdapterError(
                self.name,
                f"forward(input_tokens {shape}, target_tokens {shape}) returned {found}; "
                f"expected differentiable target log-probs of shape {shape}",
                fix="return log_softmax(logits).gather(targets) per position, 0 where the target is "
                "-100, without detaching",
            )
        return logprobs

    def step_loss(self, batch: ConformBatch, active_total: int) -> Tensor:
        """Forward ``batch`` and return the suite's loss of it (normalised by the step's ``active_total``)."""
        return suite_loss(self.forward(batch), batch.advantages, active_total)

    def gradients(self) -> dict[str, Tensor | None]:
        return {
            name: None if p.grad is None else p.grad.detach().clone() for name, p in trainable(self.module()).items()
        }

    def train_step(self, batch: ConformBatch) -> None:
        """forward, backward, optim_step, zero_grad on ``batch`` (a step whose gradient another check judges)."""
        self.adapter.backward(self.step_loss(batch, batch.active))
        self.adapter.optim_step()
        self.adapter.zero_grad()


def started(factory: Callable[[], Any], spec: ConformSpec) -> Driven:
    """A fresh adapter from ``factory``, checked against the protocol and started from ``spec``."""
    adapter = factory()
    require_protocol(adapter)
    adapter.start(spec)
    driven = Driven(adapter)
    driven.module()
    return driven
