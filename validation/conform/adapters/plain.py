"""Plain PyTorch loops behind the protocol: ``sync``, the ``naive-async`` negative control, ``snapshot-async``.

All three train a ``DecoderLM`` (``models.decoder``) with ``torch.optim.AdamW``.
They differ only in what a forward's backward differentiates when it comes
after optimizer steps:

- ``sync`` claims no staleness (a stale backward through its graph raises
  autograd's in-place error, so it does not claim "stale");
- ``naive-async`` steps the weights through ``.data`` aliases, so autograd's
  version counter does not see the update and a stale backward silently runs
  through weights updated in place: the common bug, and the suite's negative
  control (it must fail *stale* and only it);
- ``snapshot-async`` runs each forward on a deep copy of the module and adds
  the copy's gradients to the live ones at backward: exact, at one copy of
  the weights per pending forward (``measurements()`` reports the peak).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

import reference_trainer as rt

from ..protocol import ConformSpec
from .models import decoder

__all__ = ["SyncAdapter", "NaiveAsyncAdapter", "SnapshotAsyncAdapter"]


class SyncAdapter:
    """A plain loop: forward, backward, ``AdamW.step``, ``zero_grad``; staleness 0 only."""

    name = "sync"
    capabilities: frozenset[str] = frozenset()
    notes = "plain PyTorch: DecoderLM + torch.optim.AdamW"

    def start(self, spec: ConformSpec) -> None:
        self._model = decoder(spec)
        self._optimizer = torch.optim.AdamW(
            self._optimized(), lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay
        )

    def _optimized(self) -> list[Tensor]:
        return list(self._model.parameters())

    def module(self) -> torch.nn.Module:
        return self._model

    def forward(self, input_tokens: Tensor, target_tokens: Tensor) -> Tensor:
        return rt.token_logprobs(self._model(input_tokens), target_tokens)

    def backward(self, loss: Tensor) -> None:
        loss.backward()

    def optim_step(self) -> None:
        self._optimizer.step()

    def zero_grad(self) -> None:
        self._optimizer.zero_grad(set_to_none=True)
        self._model.zero_grad(set_to_none=True)


class NaiveAsyncAdapter(SyncAdapter):
    """The negative control: AdamW steps ``.data`` aliases of the weights, invisible to autograd's version counter."""

    name = "naive-async"
    capabilities = frozenset({"stale"})
    notes = "steps p.data in place; a stale backward reads the updated weights (the bug the stale check catches)"

    def _optimized(self) -> list[Tensor]:
        self._aliases = [p.data for p in self._model.parameters()]  # same storage, own version counter
        return self._aliases

    def optim_step(self) -> None:
        for alias, param in zip(self._aliases, self._model.parameters()):
            alias.grad = param.grad
        self._optimizer.step()


class SnapshotAsyncAdapter(SyncAdapter):
    """Each forward runs on a deep copy of the module; its backward adds the copy's gradients to the live ``.grad``."""

    name = "snapshot-async"
    capabilities = frozenset({"stale"})
    notes = "one deep copy of the weights per pending forward (peak bytes in measurements)"

    def start(self, spec: ConformSpec) -> None:
        super().start(spec)
        self._pending: list[torch.nn.Module] = []
        self._peak_bytes = 0

    def forward(self, input_tokens: Tensor, target_tokens: Tensor) -> Tensor:
        frozen = copy.deepcopy(self._model)
        frozen.zero_grad(set_to_none=True)
        self._pending.append(frozen)
        held = sum(p.numel() * p.element_size() for copy_ in self._pending for p in copy_.parameters())
        self._peak_bytes = max(self._peak_bytes, held)
        return rt.token_logprobs(frozen(input_tokens), target_tokens)

    def backward(self, loss: Tensor) -> None:
        loss.backward()
        for frozen in [m for m in self._pending if any(p.grad is not None for p in m.parameters())]:
            for live, used in zip(self._model.parameters(), frozen.parameters()):
                if used.grad is not None:
                    live.grad = used.grad.clone() if live.grad is None else live.grad + used.grad
            self._pending.remove(frozen)

    def measurements(self) -> dict[str, int]:
        """Peak bytes of weight copies held at once, and the live weights' bytes, for the record."""
        live = sum(p.numel() * p.element_size() for p in self._model.parameters())
        return {"peak_snapshot_bytes": self._peak_bytes, "live_parameter_bytes": live}
