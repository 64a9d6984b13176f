"""Weakref lifetime census: which saved tensors and graphs are still alive.

``SavedTensorCensus`` is installed by a test or canary *around a forward*: its
own saved-tensor hooks keep a weak reference to every tensor autograd saves
(weights excluded), independently of the trainer's accounting. After a
backward, or after the caller drops an output, ``alive()`` must be empty. A
deliberately kept reference shows up (the negative control).

Note: while the census is installed, the forward's saved tensors pass through
a hook that stores a detached alias (same storage, same version counter); the
trainer's own offload/replay hooks, when used, nest inside and win.

``live_tensors_like(shape)`` counts every live tensor of a shape through the
garbage collector: a witness for staging that must be freed after a failure.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

__all__ = ["SavedTensorCensus", "live_tensors_like", "CensusEntry"]


@dataclass
class CensusEntry:
    ref: weakref.ref
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


@dataclass
class SavedTensorCensus(AbstractContextManager):
    """Weak references to every non-weight tensor saved for backward inside the block."""

    exclude: Iterable[torch.Tensor] = ()
    entries: list[CensusEntry] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in self.exclude}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # A detached alias, not the tensor itself: packing a node's own output
        # strongly would make a reference cycle (output -> node -> output) that
        # keeps the graph alive and fools the census.
        packed = tensor.detach()
        if tensor.untyped_storage().data_ptr() not in self._excluded:
            self.entries.append(
                CensusEntry(weakref.ref(packed), tuple(tensor.shape), tensor.dtype, tensor.untyped_storage().nbytes())
            )
        return packed

    def __enter__(self) -> SavedTensorCensus:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def alive(self) -> list[CensusEntry]:
        """Entries whose tensor is still alive (after a garbage collection)."""
        gc.collect()
        return [e for e in self.entries if e.ref() is not None]


def live_tensors_like(shape: tuple[int, ...]) -> int:
    """How many live tensor objects have exactly ``shape`` (garbage collected first)."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on some lazy torch objects warns
        warnings.simplefilter("ignore")
        return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and tuple(obj.shape) == shape)
