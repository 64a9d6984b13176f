"""Memory accounting: an independent storage census, activation witnesses, CUDA allocator readings.

The trainer keeps its own books (``ForwardOutput.usage``, the saved-state
ledger); these tools count without asking it.

NOTE [Memory census]
  1. The census counts *storages* created since it began, each once, found
     through every tensor the garbage collector sees. The baseline is kept as
     storage weak references, so a storage freed and replaced at the same
     address counts as new.
  2. Two pools. On CUDA: what lives on a CUDA device, and CPU memory (the
     pinned offload copies). On CPU the device pool is modelled as the trainer
     models it (NOTE [Memory admission]): raw ``uint8`` storages are host
     copies, the rest device. A storage marked with
     :meth:`StorageCensus.mark_device` (an activation) stays in the device pool
     whatever dtype later views it, so a "copy" that only aliases an
     activation is counted where it lives.
  3. Peaks are the largest reading of any :meth:`StorageCensus.measure`: a
     sampled peak, so sample inside the work with hooks; on CUDA
     ``max_memory_allocated`` is the exact witness.
  4. Two witnesses (after PyTorch's CUDA leak check): a leak is reported only
     when two readings, each after a garbage collection, both show it, naming
     the baseline and both readings (on CUDA: the caching allocator and the
     driver's ``mem_get_info`` after emptying the cache).
  5. Held by one owner (:func:`reachable_bytes`): the storages an object
     reaches through plain Python references (never classes, modules,
     functions or weak references), each counted once and whole, so a view
     keeping a larger buffer alive counts the buffer. Used for the logical
     ranks' gradient sums (``trainer.rank_gradients``).
  6. Speed: a full collection walks every object Python holds (a few hundred
     thousand with torch). Inside :func:`frozen_heap` the objects alive at
     entry are frozen out of its sight, so a census costs only what the block
     made; frozen tensors are invisible to
     :func:`validation.lifetime.live_tensors` and their storages count as
     baseline.
"""

from __future__ import annotations

import gc
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from validation.lifetime import live_tensors

__all__ = [
    "PoolBytes",
    "StorageCensus",
    "frozen_heap",
    "ActivationWitness",
    "WitnessVerdict",
    "two_witnesses",
    "CudaReading",
    "cuda_reading",
    "cuda_leak_verdict",
    "SeenActivation",
    "reachable_bytes",
]


@dataclass(frozen=True)
class PoolBytes:
    """Bytes in the device pool and in the host pool."""

    device: int = 0
    host: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host

    def as_dict(self) -> dict[str, int]:
        return {"device": self.device, "host": self.host}


def _tensors_in(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)


# Storages of the objects frozen by each active frozen_heap() (Rule 6).
_frozen_storages: list[dict[int, StorageWeakRef]] = []


def _has_storage(tensor: torch.Tensor) -> bool:
    """Dense tensors with real memory (sparse and meta tensors have no storage to count)."""
    return tensor.layout is torch.strided and tensor.device.type != "meta"


_OPAQUE = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType, weakref.ref)


def reachable_bytes(root: object, keep: Callable[[torch.Tensor], bool] = torch.is_floating_point) -> int:
    """Bytes of the distinct storages of the tensors ``keep`` accepts that ``root`` reaches (Rule 5)."""
    seen_objects: set[int] = set()
    storages: dict[int, int] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects or isinstance(obj, _OPAQUE):
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if _has_storage(obj) and keep(obj):
                storage = obj.untyped_storage()
                storages[storage._cdata] = storage.nbytes()
        elif isinstance(obj, dict):
            stack += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += list(obj)
        elif hasattr(obj, "__dict__"):
            stack += list(vars(obj).values())
    return sum(storages.values())


def _live_storages(collect: bool) -> list[torch.UntypedStorage]:
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in live_tensors(collect=collect):
        if _has_storage(tensor):
            storage = tensor.untyped_storage()
            seen.setdefault(storage._cdata, storage)
    return list(seen.values())


@contextmanager
def frozen_heap(*, collect: bool = True) -> Iterator[None]:
    """Freeze every object alive now out of the garbage collector's sight until the block ends (Rule 6).

    Use it after building what the measurements treat as baseline (model,
    trainer, inputs). ``collect=False`` skips the first full collection
    (garbage is then frozen too). The heap is left as found: unfrozen at the
    end if nothing was frozen before (then that garbage is freed after the
    block), still frozen if a caller had frozen it (the test suite freezes
    every older object before each test; ``gc.unfreeze`` would hand the
    whole heap back to the next collection, about 0.3 s each time here).
    """
    if collect:
        gc.collect()
    was_frozen = gc.get_freeze_count() > 0
    storages = {s._cdata: StorageWeakRef(s) for s in _live_storages(collect=False)}
    _frozen_storages.append(storages)
    gc.freeze()
    try:
        yield
    finally:
        if not was_frozen:
            gc.unfreeze()
        _frozen_storages.remove(storages)


class StorageCensus:
    """Bytes of live storages created since construction, split into two pools (NOTE [Memory census]).

    ``device``: the device whose pool is measured (``"cpu"`` models it, Rule 2).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._baseline = {s._cdata: StorageWeakRef(s) for s in _live_storages(collect=True)}
        self._marked: dict[int, StorageWeakRef] = {}
        self.peak = PoolBytes()
        self.last = PoolBytes()

    @property
    def peak_device(self) -> int:
        return self.peak.device

    @property
    def peak_host(self) -> int:
        return self.peak.host

    def _is_new(self, storage: torch.UntypedStorage) -> bool:
        for known in (self._baseline, *_frozen_storages):
            ref = known.get(storage._cdata)
            if ref is not None and not ref.expired():
                return False
        return True

    def mark_device(self, refs: Iterable[StorageWeakRef]) -> None:
        """Keep these storages in the device pool whatever dtype views them (Rule 2)."""
        for ref in refs:
            if not ref.expired():
                self._marked[ref.cdata] = ref

    def pool_of(self, tensor: torch.Tensor) -> str:
        """``"device"`` or ``"host"`` for ``tensor``'s storage (Rule 2)."""
        storage = tensor.untyped_storage()
        if self.device.type == "cuda":
            return "device" if storage.device.type == "cuda" else "host"
        marked = self._marked.get(storage._cdata)
        if marked is not None and not marked.expired():
            return "device"
        return "host" if tensor.dtype == torch.uint8 else "device"

    def measure(self, *, collect: bool = True, ignore: Iterable[torch.Tensor] = ()) -> PoolBytes:
        """Bytes now (updating the peak); storages of ``ignore`` (what the caller keeps) are left out.

        ``collect=False`` skips the garbage collection. From a module hook use
        :meth:`sample_hook`: a forward hook's return value replaces the output.
        """
        skipped = {t.untyped_storage()._cdata for t in ignore if t is not None and _has_storage(t)}
        pools: dict[str, dict[int, int]] = {"device": {}, "host": {}}
        for tensor in live_tensors(collect=collect):
            if not _has_storage(tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in skipped or not self._is_new(storage) or storage.nbytes() == 0:
                continue
            pool = self.pool_of(tensor)
            # A storage seen through several dtypes counts in the device pool if any view puts it there.
            if key in pools["device"]:
                continue
            if pool == "device":
                pools["host"].pop(key, None)
            pools[pool][key] = storage.nbytes()
        self.last = PoolBytes(sum(pools["device"].values()), sum(pools["host"].values()))
        self.peak = PoolBytes(max(self.peak.device, self.last.device), max(self.peak.host, self.last.host))
        return self.last

    def sample_hook(self, ignore: Callable[[], Iterable[torch.Tensor]] | None = None) -> Callable[..., None]:
        """A hook (module or tensor) that takes a reading without collecting, for in-flight peaks.

        ``ignore()`` is called at each reading for the tensors to leave out.
        """

        def hook(*_: object) -> None:
            self.measure(collect=False, ignore=ignore() if ignore is not None else ())

        return hook


@dataclass
class SeenActivation:
    """One module output: the module's name, a weak reference to its storage, shape and bytes."""

    name: str
    ref: StorageWeakRef
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class ActivationWitness:
    """Storage weak references to every tensor a module tree outputs inside the block.

    Forward hooks on every submodule of ``model`` (the root's own output
    excluded, with ``include_root=False``). After the block, :meth:`alive`
    lists the activations whose storage is still allocated, by anything:
    the witness itself holds no strong reference.
    """

    model: nn.Module
    include_root: bool = False
    seen: list[SeenActivation] = field(default_factory=list)

    def __enter__(self) -> ActivationWitness:
        self._handles = []
        for name, module in self.model.named_modules():
            if module is self.model and not self.include_root:
                continue
            self._handles.append(module.register_forward_hook(self._hook(name or "<root>")))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        del self._handles

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: object, output: object) -> None:
            for tensor in _tensors_in(output):
                if not _has_storage(tensor):
                    continue
                storage = tensor.untyped_storage()
                if storage.nbytes():
                    self.seen.append(
                        SeenActivation(name, StorageWeakRef(storage), tuple(tensor.shape), storage.nbytes())
                    )

        return hook

    @property
    def refs(self) -> list[StorageWeakRef]:
        return [s.ref for s in self.seen]

    def alive(self, *, collect: bool = True) -> list[SeenActivation]:
        """Activations whose storage is still allocated, one entry per storage.

        A storage several modules returned (a block's output is its last
        layer's) is named by all of them, innermost first: ``"a.b.c = a.b"``.
        """
        if collect:
            gc.collect()
        unique: dict[int, SeenActivation] = {}
        for seen in self.seen:
            if seen.ref.expired():
                continue
            first = unique.get(seen.ref.cdata)
            if first is None:
                unique[seen.ref.cdata] = SeenActivation(seen.name, seen.ref, seen.shape, seen.nbytes)
            elif seen.name not in first.name.split(" = "):
                first.name += f" = {seen.name}"
        return list(unique.values())


@dataclass(frozen=True)
class WitnessVerdict:
    """Two readings against a baseline; ``leaked`` only when both exceed it by more than ``tolerance``."""

    what: str
    baseline: int
    first: int
    second: int
    tolerance: int = 0

    @property
    def leaked(self) -> bool:
        return self.first - self.baseline > self.tolerance and self.second - self.baseline > self.tolerance

    def describe(self) -> str:
        state = "LEAK (both readings agree)" if self.leaked else "ok"
        return (
            f"{self.what}: before {self.baseline} B, after {self.first} B, after again {self.second} B "
            f"(tolerance {self.tolerance} B): {state}"
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "what": self.what,
            "baseline": self.baseline,
            "first": self.first,
            "second": self.second,
            "tolerance": self.tolerance,
            "leaked": self.leaked,
        }


def two_witnesses(what: str, read: Callable[[], int], *, baseline: int, tolerance: int = 0) -> WitnessVerdict:
    """Read twice, collecting garbage before each reading (NOTE [Memory census] Rule 4)."""
    gc.collect()
    first = read()
    gc.collect()
    second = read()
    return WitnessVerdict(what, baseline, first, second, tolerance)


# --- CUDA -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CudaReading:
    """Caching-allocator bytes in use and driver bytes in use (after emptying the cache)."""

    allocated: int
    driver_used: int

    def as_dict(self) -> dict[str, int]:
        return {"allocated": self.allocated, "driver_used": self.driver_used}


def cuda_reading(device: torch.device | str) -> CudaReading:
    """Collect garbage, synchronise, empty the cache, then read both witnesses."""
    device = torch.device(device)
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return CudaReading(torch.cuda.memory_allocated(device), total - free)


def cuda_leak_verdict(
    what: str, device: torch.device | str, before: CudaReading, *, tolerance: int = 0
) -> tuple[bool, dict[str, object]]:
    """``(leaked, values)``: leaked only when the allocator and the driver both grew, twice.

    The driver reading also sees other processes on the GPU, so alone it
    never fails a check; the allocator alone may be fooled by garbage not
    yet collected, so it is read twice.
    """
    first = cuda_reading(device)
    second = cuda_reading(device)
    allocator = WitnessVerdict(f"{what} (allocator)", before.allocated, first.allocated, second.allocated, tolerance)
    driver = WitnessVerdict(f"{what} (driver)", before.driver_used, first.driver_used, second.driver_used, tolerance)
    leaked = allocator.leaked and driver.leaked
    return leaked, {"allocator": allocator.as_dict(), "driver": driver.as_dict(), "leaked": leaked}
