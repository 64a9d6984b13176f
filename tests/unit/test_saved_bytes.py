"""The saved-bytes estimate at every dtype x autocast x dropout x LoRA combination, against autograd's own count.

The oracle is PyTorch's own: the same forward run again outside the trainer
under ``torch.autograd.graph.saved_tensors_hooks``, counting each packed
storage once (``untyped_storage().nbytes()``), weights excluded (the trainer
keeps them itself). What a forward saves must never exceed what admission
admitted for it (NOTE [Memory admission] Rule 5), under autocast the weight
copies it casts included, and for a longer forward of a length bucket whose
scale a shorter one taught; and the estimate must not be grossly over either
(it would keep ``retain`` out): at most ``OVER`` times what is saved.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import reference_trainer as rt
from reference_trainer.model import token_logprobs
from reference_trainer.running import model_logits
from reference_trainer.saved_bytes import autocast_weight_bytes
from validation.memory import StorageCensus
from validation.trainers import trainer_with_policy

OVER = 3.0  # the most the admitted saved bytes may exceed what is saved, first forward of a class included
# A short first forward (the weight casts weigh most), then two of one bucket (shape_class: (T - 1).bit_length()
# == 5): the shorter teaches the class's scale, the longer saves a larger share of dropout's T² terms.
FIRST, SHORT, LONG = 3, 17, 32
GRID = list(itertools.product((torch.float32, torch.bfloat16), (None, torch.bfloat16), (0.0, 0.1), (None, 4)))
IDS = [f"{str(d)[6:]}-autocast_{a and 'bf16'}-dropout_{p}-{'lora' if r else 'full'}" for d, a, p, r in GRID]
# The refusal's fast run: where autocast casts weights (an FP32 model); the other combinations nightly.
REFUSAL_GRID = [
    pytest.param(*c, id=i, marks=() if c[0] == torch.float32 and c[1] else pytest.mark.slow) for c, i in zip(GRID, IDS)
]


def _trainer(dtype: torch.dtype, dropout: float, rank: int | None, **limits: int) -> rt.Trainer:
    lora = None if rank is None else rt.LoRAConfig(rank=rank)
    return trainer_with_policy(rt.ModelConfig.tiny(dtype=dtype, dropout=dropout), lora=lora, **limits)


def _tokens(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, length + 1), generator=torch.Generator().manual_seed(seed))


def _forward(
    trainer: rt.Trainer, tokens: torch.Tensor, autocast: torch.dtype | None, placement: str
) -> rt.ForwardOutput:
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        inputs = [rt.ForwardInput(row[:-1], row[1:]) for row in tokens]
        return trainer.forward(inputs, options=rt.ForwardOptions(backward_state=placement, corrections=()))[0]


def _saved_by_autograd(trainer: rt.Trainer, tokens: torch.Tensor, autocast: torch.dtype | None) -> int:
    """The oracle: bytes of the storages autograd packs for the same forward, outside the trainer, weights excluded."""
    checkpoint = trainer.checkpoint("policy")
    weights = {p.untyped_storage().data_ptr() for p in (*trainer.model.parameters(), *checkpoint.parameters())}
    packed: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            packed[storage.data_ptr()] = storage.nbytes()
        return tensor

    with (
        torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
    ):
        logits = model_logits(trainer.model, checkpoint, dict(checkpoint.named_parameters()), tokens[:, :-1])
        token_logprobs(logits, tokens[:, 1:])
    return sum(packed.values())


@pytest.mark.parametrize(("dtype", "autocast", "dropout", "rank"), GRID, ids=IDS)
def test_admitted_saved_bytes_cover_what_autograd_saves_and_are_not_grossly_over(
    dtype, autocast, dropout, rank
) -> None:
    trainer = _trainer(dtype, dropout, rank)
    for seed, length in enumerate((FIRST, SHORT, LONG)):
        tokens = _tokens(length, seed)
        out = _forward(trainer, tokens, autocast, "retain")
        saved, admitted = _saved_by_autograd(trainer, tokens, autocast), out.decision.saved_bytes
        assert out.usage.saved_bytes <= admitted, f"length {length}: the ledger holds {out.usage.saved_bytes} B"
        assert saved <= admitted <= OVER * saved, f"length {length}: autograd saves {saved} B, admitted {admitted} B"
        trainer.backward(-out.target_logprobs.sum())


@pytest.mark.parametrize(("dtype", "autocast", "dropout", "rank"), REFUSAL_GRID)
def test_a_forced_offload_one_byte_over_the_host_limit_is_refused(dtype, autocast, dropout, rank) -> None:
    """NOTE [Admission intersections] Rule 2: the host limit one byte under what a first forward saves (measured on a
    twin); admitting it would exceed the host limit."""
    tokens = _tokens(FIRST, 1)
    saved = _saved_by_autograd(_trainer(dtype, dropout, rank), tokens, autocast)
    trainer = _trainer(dtype, dropout, rank, host_memory_limit_bytes=saved - 1)
    census = StorageCensus()
    try:
        out = _forward(trainer, tokens, autocast, "offload")
    except rt.MemoryAdmissionError:
        return
    held = census.measure().host
    assert held <= saved - 1, f"admitted ({out.decision.saved_bytes} B); the host holds {held} B over {saved - 1} B"


class _WeightCasts(TorchDispatchMode):
    """Records the storages ``_to_copy`` makes from ``weights`` (autocast's casts), by data pointer and bytes.

    Every cast is kept alive until the recorder goes: a cast nothing saves is freed at once, and the allocator may
    hand its address to the next cast of its size, which would then overwrite its entry (a LoRA model's first-layer
    k and v projections are one such pair).
    """

    def __init__(self, weights: set[int], dtype: torch.dtype) -> None:
        super().__init__()
        self.weights, self.dtype, self.casts = weights, dtype, {}
        self.kept: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (
            func is torch.ops.aten._to_copy.default
            and out.dtype == self.dtype
            and args[0].untyped_storage().data_ptr() in self.weights
        ):
            self.casts[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
            self.kept.append(out)
        return out


@pytest.mark.parametrize("rank", [None, 4], ids=["full", "lora"])
def test_autocast_weight_bytes_are_the_weight_casts_a_real_forward_makes(rank) -> None:
    """The oracle: the BF16 copies of parameters autocast makes in a real forward (every projection, the LM head and
    each LoRA factor), seen at the dispatcher, and those of them autograd saves. A full fine-tune saves every cast
    (every projection's input needs a gradient); LoRA's first layer's q/k/v inputs need none, so it saves fewer."""
    trainer = _trainer(torch.float32, 0.0, rank)
    checkpoint = trainer.checkpoint("policy")
    weights = {p.untyped_storage().data_ptr() for p in (*trainer.model.parameters(), *checkpoint.parameters())}
    tokens, packed = _tokens(5, 0), set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.add(tensor.untyped_storage().data_ptr())
        return tensor

    recorder = _WeightCasts(weights, torch.bfloat16)
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        recorder,
    ):
        logits = model_logits(trainer.model, checkpoint, dict(checkpoint.named_parameters()), tokens[:, :-1])
        token_logprobs(logits, tokens[:, 1:])
    cast = sum(recorder.casts.values())
    saved = sum(n for ptr, n in recorder.casts.items() if ptr in packed)
    lora = None if rank is None else rt.LoRAConfig(rank=rank)
    config = trainer.model.config
    assert autocast_weight_bytes(config, lora, torch.bfloat16) == cast, f"autocast cast {cast} B of weights"
    assert saved == cast if rank is None else 0 < saved <= cast, f"autograd saved {saved} B of {cast} B cast"
    assert autocast_weight_bytes(config, lora, torch.float32) == 0  # weights already in FP32: nothing cast
