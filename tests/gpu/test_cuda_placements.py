"""CUDA paths of the trainer: placements, pinned host copies, CUDA RNG restore (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import reference_trainer as rt
from validation.trainers import trainer_with_policy

pytestmark = pytest.mark.gpu


def _grads(placement: str, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], rt.ForwardOutput]:
    with torch.device("cuda"):
        model = rt.DecoderLM(rt.ModelConfig.small(dtype=dtype, dropout=0.1), seed=0)
    trainer = trainer_with_policy(model, lora=rt.LoRAConfig(rank=8))
    tokens = torch.randint(0, 4096, (3, 65), generator=torch.Generator().manual_seed(0))
    inputs = [rt.ForwardInput(row[:-1].cuda(), row[1:].cuda()) for row in tokens]
    torch.manual_seed(0)
    torch.cuda.manual_seed(0)
    outs = trainer.forward(inputs, options=rt.ForwardOptions(backward_state=placement, corrections=()))
    trainer.optim_step()  # nothing committed yet: skipped, revision unchanged
    trainer.backward(-sum(o.target_logprobs.sum() for o in outs))
    return {n: p.grad.clone() for n, p in trainer.checkpoint("policy").named_parameters()}, outs[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_placements_agree_on_cuda(dtype: torch.dtype) -> None:
    # Fused attention backwards accumulate with atomics: bitwise gradients need the math backend.
    with sdpa_kernel([SDPBackend.MATH]):
        retain, _ = _grads("retain", dtype)
        for placement in ("offload", "replay"):
            grads, out = _grads(placement, dtype)
            assert out.placement == placement
            for name, expected in retain.items():
                assert torch.equal(grads[name], expected), f"{placement}: {name}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_reproduces_its_forward_with_the_default_attention_backend(dtype: torch.dtype) -> None:
    """The replay check is bitwise: the forward and its replay must pick the same kernels (same grad mode)."""
    grads, out = _grads("replay", dtype)  # raises GradientCommitError if the replay differs in any bit
    retain, _ = _grads("retain", dtype)
    for name, expected in retain.items():
        torch.testing.assert_close(grads[name], expected, msg=f"replay vs retain: {name}")


def test_offload_moves_saved_bytes_to_pinned_host_memory() -> None:
    trainer = trainer_with_policy(rt.ModelConfig.small(), lora=rt.LoRAConfig(rank=8), device="cuda")
    ids = torch.randint(0, 4096, (64,), device="cuda")
    out = trainer.forward(rt.ForwardInput(ids), options=rt.ForwardOptions(backward_state="offload"))
    ledger = trainer.records.get(out.record_id).ledger
    assert ledger.host_bytes > 0 and all(copy.is_pinned() for copy in ledger.host_copies)
    before = torch.cuda.get_rng_state()
    trainer.backward(out.target_logprobs.sum())
    assert torch.equal(torch.cuda.get_rng_state(), before)
