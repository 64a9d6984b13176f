"""Peak bytes a piece of work allocates: the CUDA allocator's peak, or on CPU a dispatch-level tally.

On CUDA the allocator keeps an exact peak (``reset_peak_memory_stats`` then
``max_memory_allocated``). The CPU allocator keeps none, and process RSS is
shared by everything the process does (interleaved benchmark arms, the
allocator's own caching), so on CPU :class:`AllocationPeak` counts instead:
a ``TorchDispatchMode`` that sees every op's outputs (forward, backward and
optimizer ops alike: autograd carries the mode into backward), remembers
each new storage with a weak reference, and keeps a running total of the
storages still alive. Its ``peak`` is the largest total seen at any op:
bytes allocated by the work and alive at once, not counting what existed
before. It slows the work down, so measure outside timed runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["AllocationPeak", "peak_bytes"]


class AllocationPeak(TorchDispatchMode):
    """Within the ``with`` block: ``live`` bytes of storages made inside it, and their ``peak``."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves TorchDispatchMode.__init__ unannotated
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.live = 0
        self.peak = 0

    def __torch_dispatch__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for key in [key for key, (ref, _) in self.storages.items() if ref.expired()]:
            self.live -= self.storages.pop(key)[1]
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                storage = tensor.untyped_storage()
                if storage._cdata not in self.storages:
                    self.storages[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                    self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        return out


def peak_bytes(work: Callable[[], object], device: torch.device | str) -> int:
    """Peak bytes allocated while ``work()`` runs: the CUDA allocator's on CUDA, :class:`AllocationPeak` elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        work()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - baseline
    with AllocationPeak() as tally:
        work()
    return int(tally.peak)
