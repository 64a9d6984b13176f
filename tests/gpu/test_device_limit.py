"""On CUDA, ``memory_limit_bytes=None`` plans against the device's real capacity (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

import reference_trainer as rt
from reference_trainer.admission import DEVICE_MARGIN_FRACTION
from validation.trainers import trainer_with_policy

pytestmark = pytest.mark.gpu

HEADROOM = 192 << 20  # what a blocker leaves free for the trainer


def test_default_limit_is_the_capacity_less_the_margin_less_what_others_use() -> None:
    with torch.device("cuda"):
        trainer = rt.Trainer(rt.DecoderLM(rt.ModelConfig.small(), seed=0))
    free, total = torch.cuda.mem_get_info()
    expected = int(total * (1 - DEVICE_MARGIN_FRACTION)) - (total - free)
    assert abs(trainer.memory_limit_bytes - expected) <= 64 << 20, (trainer.memory_limit_bytes, expected)


def test_auto_offloads_replays_or_refuses_instead_of_running_out_of_memory() -> None:
    with torch.device("cuda"):
        model = rt.DecoderLM(rt.ModelConfig.small(), seed=0)
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    margin = int(DEVICE_MARGIN_FRACTION * torch.cuda.mem_get_info()[1])
    blocker = torch.empty(max(free - HEADROOM - margin, 0), dtype=torch.uint8, device="cuda")  # plannable: HEADROOM
    try:
        trainer = trainer_with_policy(model, lora=rt.LoRAConfig(rank=8))
        assert trainer.memory_limit_bytes < HEADROOM + (64 << 20)
        tokens = torch.randint(0, 4096, (8, 512), device="cuda")
        placements, refused = [], None
        outs = []
        for _ in range(12):  # keeps graphs pending until the budget is spent
            try:
                outs.append(
                    trainer.forward([rt.ForwardInput(row) for row in tokens], options=rt.ForwardOptions(corrections=()))
                )
            except rt.MemoryAdmissionError as error:
                refused = error
                break
            placements.append(outs[-1][0].placement)
        assert refused is not None or set(placements) & {"offload", "replay"}, placements
        for out in outs:  # everything admitted can be backpropagated within the limit
            trainer.backward(-sum(o.target_logprobs.sum() for o in out))
    finally:
        del blocker
        torch.cuda.empty_cache()
