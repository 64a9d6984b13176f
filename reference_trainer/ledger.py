"""The ledger of one record's saved state: the pack/unpack hooks that keep, copy or stamp it (NOTE [Saved-state lifetime] in ``residency.py``)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from .errors import GradientCommitError
from .host_arena import HostArena, host_block_bytes
from .planner import Placement

__all__ = ["FLOAT8_DTYPES", "SavedStateLedger"]

FLOAT8_DTYPES = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)
_CPU = torch.device("cpu")  # torch.device is immutable: one instance serves every default


@dataclass(eq=False)
class _Packed:
    alias: torch.Tensor | None  # weights and retained tensors
    storage_key: tuple[int, int] | None  # offloaded: (address, version) of the copied storage
    offset: int = 0
    size: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    device: torch.device = _CPU
    stamp: int = 0


@dataclass(eq=False)
class SavedStateLedger:
    """Pack/unpack hooks for one record under one placement (NOTE [Saved-state lifetime])."""

    placement: Placement
    weight_storages: set[int]
    pin_memory: bool = False
    arena: HostArena | None = None  # one buffer for the record's copies (CUDA); None: a copy per storage
    unsupported: str | None = None
    device_bytes: int = 0
    host_bytes: int = 0  # what the host really holds for this record (pinned blocks, the arena)
    copied_bytes: int = 0  # the saved bytes copied to the host (what the planner learns from)
    _copies: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    _restored: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    _counted: set[int] = field(default_factory=set)
    # Originals of copied storages, held until the forward ends so that their
    # addresses (the dedup keys) cannot be reused by a new storage meanwhile.
    _originals: dict[int, torch.UntypedStorage] = field(default_factory=dict)
    # Weak: autograd owns a retained tensor, and frees it as soon as its node has run in
    # the backward (as without hooks); a strong list would keep every activation alive
    # until the record is released, raising the backward's peak and its allocations.
    _retained: list[weakref.ref[_Packed]] = field(default_factory=list)

    @property
    def host_copies(self) -> list[torch.Tensor]:
        """The host copies offload made (one per saved storage state), for inspection."""
        return list(self._copies.values())

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def note_unsupported(self, reason: str) -> None:
        if self.unsupported is None:
            self.unsupported = reason

    def _pack(self, tensor: torch.Tensor) -> _Packed:
        if tensor.dtype in FLOAT8_DTYPES:
            self.note_unsupported(f"a saved tensor of dtype {tensor.dtype}")
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.weight_storages or self.placement is Placement.RETAIN:
            packed = _Packed(tensor.detach(), None, stamp=tensor._version)
            if key not in self.weight_storages:
                self._retained.append(weakref.ref(packed))
                if key not in self._counted:
                    self._counted.add(key)
                    self.device_bytes += storage.nbytes()
            return packed
        packed = _Packed(None, None)
        self._offload(packed, tensor)
        return packed

    def _offload(self, packed: _Packed, tensor: torch.Tensor) -> None:
        """Point ``packed`` at a host copy of ``tensor``'s storage (made once per storage)."""
        storage = tensor.untyped_storage()
        # The version is part of the key: a storage written in place between two
        # saves (legal inside one forward) needs a copy of each state.
        key = (storage.data_ptr(), tensor._version)
        if key not in self._copies:
            self._copies[key] = self._copy_storage(tensor)
            self._originals[key[0]] = storage
            self.copied_bytes += storage.nbytes()
            if self.arena is None or not self.arena.holds(self._copies[key]):  # the arena's block is counted once
                self.host_bytes += host_block_bytes(storage.nbytes(), self.pin_memory)
        packed.alias, packed.storage_key = None, key
        packed.offset, packed.size, packed.stride = (
            int(tensor.storage_offset()),
            tuple(tensor.shape),
            tuple(tensor.stride()),
        )
        packed.dtype, packed.device, packed.stamp = tensor.dtype, tensor.device, self._copies[key]._version

    def demote(self) -> None:
        """Move a retained record's saved tensors to host copies (NOTE [Memory admission] Rule 6).

        A tensor already modified in place keeps its alias, so its backward
        still refuses (Rule 1).
        """
        for ref in self._retained:
            packed = ref()
            if packed is not None and packed.alias is not None and packed.alias._version == packed.stamp:
                self._offload(packed, packed.alias)
        self._retained.clear()
        self._originals.clear()
        self.device_bytes = 0
        self.placement = Placement.OFFLOAD

    def _copy_storage(self, tensor: torch.Tensor) -> torch.Tensor:
        raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
        host = self.arena.copy(raw) if self.arena is not None else None
        if host is not None:
            return host
        host = torch.empty(raw.shape, dtype=torch.uint8, pin_memory=self.pin_memory)
        host.copy_(raw)
        return host

    def _unpack(self, packed: _Packed) -> torch.Tensor:
        if packed.alias is not None:
            if packed.alias._version != packed.stamp:
                raise _tampered(packed.stamp, packed.alias._version)
            return packed.alias
        key = packed.storage_key
        assert key is not None, "a packed tensor without an alias was copied"
        copy = self._copies[key]
        if copy._version != packed.stamp:
            raise _tampered(packed.stamp, copy._version)
        restored = self._restored.get(key)
        if restored is None:
            restored = copy if packed.device.type == "cpu" else copy.to(packed.device, non_blocking=True)
            self._restored[key] = restored
        view = torch.empty(0, dtype=packed.dtype, device=restored.device)
        # An arena slice starts inside its buffer's storage (aligned for every dtype).
        offset = packed.offset + restored.storage_offset() // packed.dtype.itemsize
        return view.set_(restored.untyped_storage(), offset, packed.size, packed.stride)

    def end_backward(self) -> None:
        """A backward is over: drop the device copies restored for it (a retained graph restores again)."""
        self._restored.clear()

    def end_forward(self) -> None:
        """The forward is over: wait for the arena's copies, then let the copied originals go."""
        if self.arena is not None:
            self.arena.wait()
        self._originals.clear()

    def release(self) -> None:
        self.arena = None
        self._retained.clear()
        self._originals.clear()
        self._copies.clear()
        self._restored.clear()


def _tampered(stamp: int, found: int) -> GradientCommitError:
    return GradientCommitError(
        f"a tensor saved for backward was modified in place after the forward (version "
        f"{stamp} at forward, {found} now); expected saved state to stay untouched. "
        "Do not write in place to activations a pending forward saved; forward again"
    )
