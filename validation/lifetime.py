"""Weakref lifetime census: which tensors made by a forward are still alive.

``TensorCensus`` is a block around a forward (or any trainer call): on exit it
keeps a weak reference to every tensor object created inside the block and
still alive, found through the garbage collector, so it does not depend on
the trainer's own accounting or hooks (saved tensors, copies, snapshots and
graph roots are all Python tensor objects there). After a backward, or after
the caller drops an output, ``alive(ignore=...)`` must be empty apart from
what the caller itself keeps; a deliberately kept reference shows up (the
negative control).

``live_tensors_like(shape)`` counts every live tensor of a shape: a witness
for staging that must be freed after a failure.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

__all__ = ["TensorCensus", "CensusEntry", "live_tensors", "live_tensors_like"]


@dataclass
class CensusEntry:
    ref: weakref.ref[torch.Tensor]
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


def live_tensors(*, collect: bool = True) -> list[torch.Tensor]:
    """Every live tensor object the garbage collector can see (collected first unless told not to)."""
    if collect:
        gc.collect()
    return [obj for obj in gc.get_objects() if type(obj) in _TENSOR_TYPES]


_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


@dataclass
class TensorCensus:
    """Weak references to the tensors created inside the block and alive at its end."""

    entries: list[CensusEntry] = field(default_factory=list)

    def __enter__(self) -> TensorCensus:
        self._before = {id(t): weakref.ref(t) for t in live_tensors()}
        return self

    def __exit__(self, *exc: object) -> None:
        for tensor in live_tensors():
            known = self._before.get(id(tensor))
            if known is None or known() is not tensor:
                nbytes = tensor.untyped_storage().nbytes() if tensor.device.type != "meta" else 0
                self.entries.append(CensusEntry(weakref.ref(tensor), tuple(tensor.shape), tensor.dtype, nbytes))
        del self._before

    def alive(self, ignore: Iterable[torch.Tensor] = ()) -> list[CensusEntry]:
        """Entries still alive (after a garbage collection), except the ``ignore`` tensors."""
        gc.collect()
        ignored = {id(t) for t in ignore}
        return [e for e in self.entries if e.ref() is not None and id(e.ref()) not in ignored]


def live_tensors_like(shape: tuple[int, ...]) -> int:
    """How many live tensor objects have exactly ``shape`` (garbage collected first)."""
    return sum(1 for tensor in live_tensors() if tuple(tensor.shape) == shape)
