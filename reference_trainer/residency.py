"""Saved-tensor hooks that keep, copy or drop a forward's saved state, with a ledger.

NOTE [Saved-state lifetime]
  1. Any saved-tensors hook switches off autograd's own in-place check, so
     every packed tensor carries a stamp (its version counter at pack time,
     and through its record the checkpoint version); unpacking a tensor whose
     counter moved raises instead of computing a wrong gradient.
  2. Weights (the capture's leaves, the frozen base parameters) are never
     copied: they are kept as detached aliases and stamped like the rest.
  3. ``retain`` keeps a detached alias of each saved tensor (packing a node's
     own output strongly would make a cycle that keeps the graph alive).
     Autograd owns the alias and the ledger points at it weakly (for
     demotion, NOTE [Memory admission] Rule 6), so each is freed once its node
     ran in the backward and the backward peaks where plain autograd's does.
  4. ``offload`` copies each saved storage once (shared storages once;
     recognised by address and version) to host memory and unpacks views of
     the copy, restored once per storage per backward. On CUDA the copies are
     asynchronous slices of one pinned buffer per record (``host_arena.py``),
     waited for as the forward ends, and the host budget counts the caching
     allocator's power-of-two blocks (``host_arena.host_block_bytes``). The
     originals are held until the forward ends, so an address cannot be
     reused meanwhile; the copies are freed with the graph.
  5. ``replay`` saves nothing: the forward is re-run at backward on its own
     weight snapshot with its RNG, mode and autocast restored, and must
     reproduce the outputs bitwise (:func:`record_backward`). Both runs are in
     grad mode because CUDA attention kernels choose by grad mode, so a
     no-grad forward may differ in the last bit; the price is autograd's
     bookkeeping, no activation kept. Bitwise equality also needs
     deterministic kernels (as ``tests/gpu/conftest.py`` sets).
  6. Saved state that cannot be kept or restored exactly (float8, modules
     marked with :func:`mark_quantized_saved_state`) is noted when packed;
     the backward refuses such a record before any destructive step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .checkpoints import Checkpoint, WeightCapture
from .errors import ConfigError, GradientCommitError, UnsupportedSavedStateError
from .host_arena import HostArena
from .inputs import PaddedBatch
from .ledger import SavedStateLedger
from .misses import allocation_failures_reported
from .model import DecoderLM
from .planner import Placement
from .records import ForwardRecord
from .rng import restored_forward_state
from .running import run_model

__all__ = [
    "check_recordable",
    "check_restorable",
    "has_quantized_module",
    "mark_quantized_saved_state",
    "record_backward",
    "record_forward",
    "weight_storages",
]


_QUANTIZED_ATTR = "_rt_quantized_saved_state"  # an attribute, so copies of a marked module stay marked
_marked_any = False  # set by the first mark in this process; until then no forward walks the model


def mark_quantized_saved_state(module: nn.Module) -> nn.Module:
    """Mark ``module`` as saving state the trainer cannot keep exactly (like TE FP8 layers)."""
    global _marked_any
    setattr(module, _QUANTIZED_ATTR, True)
    _marked_any = True
    return module


def has_quantized_module(model: nn.Module) -> bool:
    """True iff some submodule of ``model`` is marked (no walk before the first mark in this process)."""
    return _marked_any and any(getattr(m, _QUANTIZED_ATTR, False) for m in model.modules())


def weight_storages(tensors: Iterable[torch.Tensor]) -> set[int]:
    """Storage keys of tensors that must never be copied (Rule 2)."""
    return {t.untyped_storage().data_ptr() for t in tensors}


def check_recordable() -> None:
    """Raise unless a forward can record its graph here: not under ``torch.inference_mode()``.

    Inference tensors cannot be saved for backward, so such a forward would
    leave a record with no graph. ``no_grad`` is no obstacle: the forward
    records under ``enable_grad`` (the caller's grad mode is for its own autograd).
    """
    if torch.is_inference_mode_enabled():
        raise ConfigError(
            "forward",
            "a call under torch.inference_mode()",
            "a forward outside inference_mode (it records the graph its backward needs)",
            "for reference log-probs pass checkpoint=rt.BASE, which inference_mode allows; otherwise leave inference_mode",
        )


def record_forward(
    model: DecoderLM,
    checkpoint: Checkpoint,
    capture: WeightCapture,
    batch: PaddedBatch,
    placement: Placement,
    *,
    frozen_storages: set[int],
    quantized: bool,
    host_reserve_bytes: int = 0,
) -> tuple[torch.Tensor, SavedStateLedger | None]:
    """Run a forward under ``placement``: its padded log-probs (the graph root) and its ledger (``None``: replay).

    ``host_reserve_bytes``: the predicted saved bytes; an offloaded CUDA forward copies into one pinned
    buffer of that size (NOTE [Saved-state lifetime] Rule 4)."""
    if placement is Placement.REPLAY:  # Rule 5: the replay's grad mode, nothing saved
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_discard, _discarded):
            return run_model(model, checkpoint, capture, batch).detach(), None
    weights = frozen_storages | weight_storages(capture.tensors.values())
    cuda = batch.input_ids.device.type == "cuda"
    arena = None
    if cuda and placement is Placement.OFFLOAD and host_reserve_bytes > 0:
        arena = HostArena(host_reserve_bytes, pinned=True)
    ledger = SavedStateLedger(placement, weights, pin_memory=cuda, arena=arena)
    if arena is not None:
        ledger.host_bytes += arena.held_bytes
    if quantized:
        ledger.note_unsupported("a module marked with mark_quantized_saved_state")
    with torch.enable_grad(), ledger.hooks():
        root = run_model(model, checkpoint, capture, batch)
    ledger.end_forward()
    return root, ledger


def _discard(tensor: torch.Tensor) -> None:
    return None


def _discarded(packed: None) -> torch.Tensor:
    raise RuntimeError("a replay-placed forward keeps no saved state; its backward replays it")


def check_restorable(record: ForwardRecord) -> None:
    """Raise ``UnsupportedSavedStateError`` if the record saved state it cannot restore exactly (Rule 6)."""
    if record.ledger is not None and record.ledger.unsupported is not None:
        raise UnsupportedSavedStateError(
            f"forward record {record.id} ({record.placement}) saved state the trainer "
            f"cannot keep or restore exactly: {record.ledger.unsupported}; expected "
            "unquantized saved tensors. Use backward_state='replay' (exact re-run) or run "
            "these layers unquantized; the record was released and nothing was committed"
        )


def record_backward(
    model: DecoderLM, record: ForwardRecord, cotangent: torch.Tensor, retain_graph: bool
) -> dict[str, torch.Tensor]:
    """Gradients of the record's capture leaves for ``cotangent`` on its root, by parameter name."""
    capture = record.capture
    capture.check_ledger()
    # A replay record keeps nothing between backwards, even with retain_graph: it replays again.
    root = record.root if record.root is not None else _replay(model, record)
    names = list(capture.tensors)
    grads = torch.autograd.grad(
        root, [capture.tensors[n] for n in names], cotangent, retain_graph=retain_graph, allow_unused=True
    )
    if record.ledger is not None:
        record.ledger.end_backward()
    return {n: g for n, g in zip(names, grads) if g is not None}


def _replay(model: DecoderLM, record: ForwardRecord) -> torch.Tensor:
    """Re-run a replay record's forward on its own weight snapshot, its forward state restored (Rule 5)."""
    reported = allocation_failures_reported(model.config, record.estimator, record.decision.saved_bytes)
    with reported, torch.enable_grad(), restored_forward_state(record.rng_state, model):
        root = run_model(model, record.checkpoint, record.capture, record.batch)
    if not torch.equal(root.detach(), record.logprobs()):
        worst = float((root.detach() - record.logprobs()).abs().max())
        raise GradientCommitError(
            f"replay of forward record {record.id} did not reproduce the outputs the caller saw "
            f"(max abs difference {worst:.3e}); expected bitwise-equal log-probs. The model or its "
            "inputs changed outside the trainer, or a kernel is not deterministic: use retain or offload"
        )
    return root
