"""The job the cross-process resume test saves and loads: L=4 logical ranks in rank mode, LoRA, dropout.

``segment`` runs steps ``start .. stop - 1`` on however many processes it is
called on (W=1 in the test process, W=2 spawned), from a fresh trainer
(``load_from=None``) or from a save, and saves at the end. Every process
builds the same base model, so a save made on one count loads on another.
"""

from __future__ import annotations

from typing import Any

import torch

import reference_trainer as rt
from validation.spawn import to_plain
from validation.trainers import trainer_with_policy

LOGICAL_DP = 4


def base_model() -> rt.DecoderLM:
    return rt.DecoderLM(rt.ModelConfig.tiny(dropout=0.1), seed=0)


def fresh_trainer() -> rt.Trainer:
    torch.manual_seed(11)
    trainer = trainer_with_policy(base_model(), adapter_seed=3, lora=rt.LoRAConfig(rank=4), optimizer=rt.AdamWConfig(lr=2e-2), options=rt.ForwardOptions(corrections=()))
    return trainer


def state(trainer: rt.Trainer) -> dict[str, Any]:
    """Everything a checkpoint keeps, as numpy (bitwise comparable across processes)."""
    checkpoint = trainer.checkpoint("policy")
    return to_plain({"state": checkpoint.state_dict(), "generation": checkpoint.generation})


def step(trainer: rt.Trainer, index: int) -> None:
    def body(view: Any) -> None:
        generator = torch.Generator().manual_seed(1000 * index + view.logical_rank)
        tokens = torch.randint(0, 64, (int(torch.randint(5, 10, (1,), generator=generator)),), generator=generator)
        out = view.forward(rt.ForwardInput(tokens))
        advantage = torch.randn(out.target_logprobs.shape, generator=generator)
        view.backward(-(out.target_logprobs * advantage).sum())

    rt.run_logical(body, trainer, logical_dp=LOGICAL_DP, timeout_s=20.0)
    trainer.optim_step(max_grad_norm=1.0)
    trainer.zero_grad()


def segment(load_from: str | None, save_to: str | None, start: int, stop: int, saves: dict[int, str] | None = None,
            unwritable: str | None = None) -> dict[str, Any]:
    """Steps ``start .. stop - 1``; the state just after the load, at the end, and saved to ``save_to``.

    ``saves``: ``{step: folder}`` to save at before that step too (the uninterrupted run's saves, to compare bytes).
    ``unwritable``: a path rank 0 cannot save to, tried last: ``"refused"`` names the error each process raised.
    """
    trainer = fresh_trainer() if load_from is None else rt.Trainer.load(load_from, base_model())
    loaded = state(trainer)
    refused_before_logical = _refusal(trainer, unwritable)  # a process group, no logical ranks yet
    for index in range(start, stop):
        if saves and index in saves:
            trainer.save(saves[index])
        step(trainer, index)
    if save_to is not None:
        trainer.save(save_to)
    return {"loaded": loaded, "final": state(trainer), "refused_before_logical": refused_before_logical,
            "refused": _refusal(trainer, unwritable)}


def _refusal(trainer: rt.Trainer, unwritable: str | None) -> str | None:
    """What saving to ``unwritable`` raised here: the ConfigError's field, or another error's type name."""
    if unwritable is None:
        return None
    try:
        trainer.save(unwritable)
    except rt.ConfigError as exc:
        return exc.field
    except Exception as exc:  # noqa: BLE001 - the test compares what each process raised
        return type(exc).__name__
    return "saved"
