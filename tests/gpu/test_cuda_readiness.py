"""What the CPU suite checks through substituted hooks, checked on a real CUDA device (skipped without one).

Logical-rank threads on the trainer's device and under the caller's CUDA
autocast; one host read per forward call for device inputs and one per
backward; forward timing from CUDA events; the sampler on the model's device;
pinned offload copies counted by their blocks; GPU presets' memory estimate
against the device; the logical-rank check over NCCL on two GPUs.
"""

from __future__ import annotations

import pytest
import torch

import reference_trainer as rt
from canaries.derivative.oracle_pair import TOLERANCES
from canaries.derivative.scenarios import check_logical_ranks
from canaries.preset_budget import check_fits
from canaries.presets import preset
from reference_trainer.host_arena import host_block_bytes
from reference_trainer.ranks import run_logical
from reference_trainer.sampling import sample
from reference_trainer.testing import observe_host_reads
from reference_trainer.timing import Stopwatch
from validation.trainers import trainer_with_policy

pytestmark = pytest.mark.gpu

LAST = torch.cuda.device_count() - 1 if torch.cuda.is_available() else 0


def _trainer(device: str = "cuda", dtype: torch.dtype = torch.float32) -> rt.Trainer:
    with torch.device(device):
        model = rt.DecoderLM(rt.ModelConfig.small(dtype=dtype, dropout=0.0), seed=0)
    trainer = trainer_with_policy(model, lora=rt.LoRAConfig(rank=8), options=rt.ForwardOptions(corrections=()))
    return trainer


def test_fibers_run_on_the_trainers_device_not_cuda_0() -> None:
    trainer = _trainer(f"cuda:{LAST}")
    seen = run_logical(lambda view: torch.cuda.current_device(), trainer, logical_dp=2)
    assert seen == [LAST, LAST]


def test_fibers_run_under_the_callers_cuda_autocast() -> None:
    trainer = _trainer()

    def body(view: object) -> tuple[bool, torch.dtype]:
        product = torch.ones(4, 4, device="cuda") @ torch.ones(4, 4, device="cuda")
        return torch.is_autocast_enabled("cuda"), product.dtype

    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert run_logical(body, trainer, logical_dp=2) == [(True, torch.bfloat16)] * 2


def test_device_inputs_cost_one_host_read_per_forward_call_and_one_per_backward() -> None:
    trainer = _trainer()
    inputs = [rt.ForwardInput(torch.randint(0, 4096, (n,), device="cuda")) for n in (17, 33, 25)]
    with observe_host_reads() as reads:
        outputs = trainer.forward(inputs)
    assert [why for why, _ in reads] == ["token range"]
    with observe_host_reads() as reads:
        trainer.backward(sum(o.target_logprobs.sum() for o in outputs))
    assert [why for why, _ in reads] == ["finite gradients"]


def test_a_cuda_stopwatch_measures_kernels_not_launches() -> None:
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    stopwatch = Stopwatch(torch.device("cuda"))
    for _ in range(20):
        a = a @ a / 64.0
    stopwatch.stop()
    torch.cuda.synchronize()
    seconds = stopwatch.seconds()
    assert seconds is not None and seconds > 1e-3  # 20 4K matmuls; a wall clock around launches reads microseconds


def test_the_sampler_draws_on_the_models_device() -> None:
    trainer = _trainer()
    prompts = torch.randint(0, 4096, (2, 5), device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    samples = sample(trainer.model, prompts, max_new_tokens=3, generator=generator)
    assert all(s.completion.device.type == "cuda" and s.completion.numel() == 3 for s in samples)


def test_an_offloaded_cuda_forward_copies_into_one_pinned_buffer_counted_by_its_block() -> None:
    trainer = _trainer()
    ids = torch.randint(0, 4096, (50,), device="cuda")
    retained = trainer.forward(rt.ForwardInput(ids), options=rt.ForwardOptions(backward_state="retain", corrections=()))
    out = trainer.forward(rt.ForwardInput(ids), options=rt.ForwardOptions(backward_state="offload", corrections=()))
    ledger = trainer.records.get(out.record_id).ledger
    arena = ledger.arena.buffer.untyped_storage().data_ptr()
    assert all(copy.is_pinned() for copy in ledger.host_copies)
    inside = [c for c in ledger.host_copies if c.untyped_storage().data_ptr() == arena]
    outside = [c for c in ledger.host_copies if c.untyped_storage().data_ptr() != arena]
    assert inside, "no copy went to the record's pinned buffer"
    assert ledger.host_bytes == ledger.arena.held_bytes + sum(host_block_bytes(c.numel(), pinned=True) for c in outside)
    trainer.backward(out.target_logprobs.sum() + retained.target_logprobs.sum())


@pytest.mark.parametrize("name", ["gpu", "gpu-8b"])
def test_gpu_presets_fit_this_device_by_their_estimate(name: str) -> None:
    check_fits(preset(name), oracle=True, echo=lambda line: None)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs for NCCL")
def test_the_logical_rank_check_runs_over_nccl_on_two_gpus() -> None:
    config = preset("gpu", processes=2)
    assert check_logical_ranks(config, 2) < TOLERANCES[config.model.dtype].gradient_global
