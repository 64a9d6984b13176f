"""A CUDA job saved and loaded ends bitwise as the uninterrupted one: the CUDA generator is kept (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

import reference_trainer as rt
from tests.support import assert_nested_equal
from validation.trainers import trainer_with_policy

pytestmark = pytest.mark.gpu


def _model() -> rt.DecoderLM:
    with torch.device("cuda"):
        return rt.DecoderLM(rt.ModelConfig.tiny(dropout=0.1), seed=0)


def _job(path, save_at: int | None) -> dict:
    torch.manual_seed(0)
    torch.cuda.manual_seed(0)
    trainer = trainer_with_policy(_model(), lora=rt.LoRAConfig(rank=4))
    for step in range(3):
        if step == save_at:
            trainer.save(path)
            torch.cuda.manual_seed(99)  # the restarted process's own CUDA generator: the load must replace it
            trainer = rt.Trainer.load(path, _model())
        tokens = torch.randint(0, 64, (17,), generator=torch.Generator().manual_seed(step)).cuda()
        out = trainer.forward(rt.ForwardInput(tokens[:-1], tokens[1:]), options=rt.ForwardOptions(corrections=()))
        trainer.backward(-out.target_logprobs.sum())
        trainer.optim_step()
        trainer.zero_grad()
    return trainer.checkpoint("policy").state_dict()


def test_a_cuda_job_resumes_bitwise_with_its_cuda_dropout_stream(tmp_path) -> None:
    assert_nested_equal(_job(tmp_path / "save", 1), _job(tmp_path / "unused", None))


def _devices(state) -> dict[str, str]:
    return {
        f"{n}.{k}": str(v.device)
        for n, slots in state["optimizer"]["state"].items()
        for k, v in slots.items()
        if isinstance(v, torch.Tensor)
    }


def test_a_cuda_load_keeps_adamws_step_on_the_host_and_never_holds_the_state_twice(tmp_path) -> None:
    trainer = trainer_with_policy(_model())
    tokens = torch.randint(0, 64, (17,), generator=torch.Generator().manual_seed(0)).cuda()
    out = trainer.forward(rt.ForwardInput(tokens[:-1], tokens[1:]), options=rt.ForwardOptions(corrections=()))
    trainer.backward(-out.target_logprobs.sum())
    trainer.optim_step()
    trainer.save(tmp_path)
    never_stopped = trainer.checkpoint("policy").state_dict()
    model = _model()
    del trainer, out
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loaded = rt.Trainer.load(tmp_path, model)
    held = torch.cuda.memory_allocated() - base
    peak = torch.cuda.max_memory_allocated() - base
    assert _devices(loaded.checkpoint("policy").state_dict()) == _devices(never_stopped)
    assert peak <= 1.25 * held, f"the load peaked at {peak} bytes over {held} held: the state was on the device twice"
