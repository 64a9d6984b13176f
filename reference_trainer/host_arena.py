"""One host buffer per offloaded record, filled by asynchronous copies.

Offloading each saved storage into its own pinned allocation costs a
synchronous copy and a power-of-two pinned block apiece (the caching host
allocator's rounding). On CUDA a record's offload instead takes slices of one
pinned buffer sized by the planner's predicted saved bytes, each filled with
a ``non_blocking`` copy; the forward ends by recording one CUDA event and
waiting for it (:meth:`HostArena.wait`), after which the device originals may
go. What does not fit the buffer falls back to a copy of its own. On the CPU
the trainer keeps plain copies (no arena).
"""

from __future__ import annotations

import torch

__all__ = ["ALIGNMENT", "HostArena", "host_block_bytes"]

ALIGNMENT = 64  # bytes: every slice starts aligned for any dtype


def host_block_bytes(nbytes: int, pinned: bool) -> int:
    """Host bytes an allocation of ``nbytes`` really holds: pinned blocks round up to a power of two."""
    if not pinned or nbytes <= 1:
        return nbytes
    return 1 << (nbytes - 1).bit_length()


class HostArena:
    """A host buffer of ``capacity`` bytes handed out in aligned slices; ``held_bytes`` is its real block."""

    def __init__(self, capacity: int, *, pinned: bool) -> None:
        self.buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=pinned)
        self.pinned = pinned
        self.held_bytes = host_block_bytes(capacity, pinned)
        self._used = 0
        self._pending: list[torch.Tensor] = []  # device sources of copies in flight

    def copy(self, source: torch.Tensor) -> torch.Tensor | None:
        """A slice holding ``source``'s bytes (``uint8``, 1-D), copied asynchronously; ``None`` if it does not fit."""
        start = -(-self._used // ALIGNMENT) * ALIGNMENT
        end = start + source.numel()
        if end > self.buffer.numel():
            return None
        self._used = end
        # Its own tensor over the buffer's storage, not a view: views share one version counter, and
        # the ledger stamps each copy's counter to catch in-place writes (NOTE [Saved-state lifetime] 1).
        target = torch.empty(0, dtype=torch.uint8).set_(self.buffer.untyped_storage(), start, (end - start,), (1,))
        target.copy_(source, non_blocking=source.device.type == "cuda" and self.pinned)
        if source.device.type == "cuda":
            self._pending.append(source)
        return target

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in this arena's buffer."""
        return tensor.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr()

    def wait(self) -> None:
        """Block until every copy made so far has landed (one event on the current stream), then drop the sources."""
        if self._pending:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._pending[0].device))
            event.synchronize()
        self._pending.clear()
