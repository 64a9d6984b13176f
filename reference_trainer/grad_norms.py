"""The gradient norm: one pass per backward, shared by the commit and the optimizer step.

NOTE [Gradient norm]
  1. A backward's commit proves the gradients it will publish (staged, plus
     what they accumulate onto) finite with one fused norm per checkpoint
     (:func:`total_norm`, NOTE [Gradient commit] Rule 2).
  2. When that commit publishes a checkpoint's gradients into ``.grad``, the
     new ``.grad`` tensors are exactly the ones it measured: it
     remembers the norm as a :class:`KnownNorm` (the value, read on the host
     in the commit's one host read; weak references to those tensors, in
     order, and their version counters).
  3. ``Checkpoint.step`` needs the same norm (it reports it, refuses a
     non-finite one, clips by it). It reuses the known norm only when its
     gradient list is the same tensor objects, in the same order, at the same
     versions: :func:`total_norm` of the same tensors in the same order gives
     the same bits, so the reuse is exact. Anything else recomputes: a
     logical-rank flush, low-precision parameters (the step measures FP32
     master copies), a ``.grad`` written or modified in place (the version
     counter moves), a gradient the commit did not write. Not seen: a write
     through ``.grad.data``, which has a version counter of its own (writing
     ``.grad`` by hand is not supported: docs/semantics.md#transactions).
  4. Every write of a live ``.grad`` through the trainer forgets the known
     norm first (``LiveGradSink.assign``, ``Checkpoint.clear_gradients``), so
     a stale norm is never even compared.

Measured on the ``small`` CPU benchmark (5.2 M parameters), one norm pass is
about 1 ms of a 95 ms step; before this note the step paid it twice.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

__all__ = ["KnownNorm", "total_norm"]


def total_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all of ``grads`` together, as ``clip_grad_norm_`` computes it (a 0-d tensor)."""
    return torch.nn.utils.get_total_norm(list(grads))


class KnownNorm:
    """``total_norm(grads)`` remembered with what it was computed from (Rule 2).

    Holds the norm as a host number (read in the commit's one host read, so
    no device tensor outlives the backward) and only weak references to the
    gradients: remembering a norm never keeps a gradient alive.
    """

    def __init__(self, grads: Sequence[torch.Tensor], norm: float, dtype: torch.dtype, device: torch.device) -> None:
        """``norm``: the value of ``total_norm(grads)``, a 0-d tensor of ``dtype`` on ``device``."""
        self._refs = [weakref.ref(g) for g in grads]
        self._versions = [g._version for g in grads]
        self.norm = norm
        self._dtype, self._device = dtype, device

    def matches(self, grads: Sequence[torch.Tensor]) -> bool:
        """True iff ``grads`` are the measured tensors, in order, none modified since (Rule 3)."""
        return self._same_count(grads) and all(
            ref() is grad and grad._version == version for ref, grad, version in zip(self._refs, grads, self._versions)
        )

    def _same_count(self, grads: Sequence[torch.Tensor]) -> bool:
        """As many tensors as were measured: a set that shrank (a ``.grad`` dropped) is measured again."""
        return len(grads) == len(self._refs)

    def tensor(self) -> torch.Tensor:
        """The norm as ``total_norm`` returned it (a float holds an FP32 or BF16 value exactly)."""
        return torch.tensor(self.norm, dtype=self._dtype, device=self._device)
