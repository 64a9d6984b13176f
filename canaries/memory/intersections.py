"""The memory canary's intersection checks: admission where two features meet.

NOTE [Admission intersections]
  1. Held <= admitted: after every admitted forward, what the pending records
     hold (their ``usage`` from the saved-state ledgers: device bytes with
     each version's weight snapshot once, host bytes) is within the limits
     the forward was admitted under (:func:`held_within_limits`), checked
     after each forward of ``canaries.memory.canary``'s admission run.
  2. Each scenario sets a limit one byte under what a forward really holds
     (measured on an unlimited twin), then makes that forward: a correct
     trainer refuses it (``MemoryAdmissionError``) or admits it within the
     limit; admitting it over the limit fails.
     - ``train after eval``: dropout on; an eval-mode forward teaches
       admission its scale, then a forced offload in train mode (masks saved
       too) under a host limit.
     - ``LoRA rank 256``: a first forced offload on LoRA rank 256 (``x·Aᵀ`` a
       large share of the saved bytes) under a host limit.
     - ``long after short``: BF16, dropout on, a 33-token forward then a
       forced offload of 64 in the same shape class under a host limit; the
       measured/analytic ratio grows ~12% across the class, beyond the
       estimate's 5% margin, so the 33-token forward must price the 64-token
       one at the most it allows there, not at its ratio.
  3. The checkpoints' state is in the budget (:func:`check_checkpoint_budget`):
     beside a stepped full checkpoint (parameters and AdamW moments, from its
     public ``state_dict``), a forced retain under a limit one byte under what
     both hold is refused, or admitted within what the checkpoint leaves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import reference_trainer as rt
from validation.trainers import trainer_with_policy

from ..presets import Preset

__all__ = ["held_within_limits", "SCENARIOS", "check_scenario", "checkpoint_state_bytes", "check_checkpoint_budget"]

_OFFLOAD = rt.ForwardOptions(backward_state="offload", corrections=())
_RETAIN = rt.ForwardOptions(backward_state="retain", corrections=())


def held_within_limits(trainer: rt.Trainer, device_limit: int | None, host_limit: int | None) -> tuple[bool, str]:
    """Rule 1: the pending records' held bytes within the limits; ``(ok, detail)``."""
    records = list(trainer.records)
    snapshots = {r.version: r.usage.snapshot_bytes for r in records}
    device = sum(r.usage.device_bytes - r.usage.snapshot_bytes for r in records) + sum(snapshots.values())
    host = sum(r.usage.host_bytes for r in records)
    ok = (device_limit is None or device <= device_limit) and (host_limit is None or host <= host_limit)
    return (
        ok,
        f"{len(records)} pending records hold {device} B on the device (limit {device_limit}), {host} B on the host (limit {host_limit})",
    )


def _inputs(preset: Preset, seed: int, length: int | None = None) -> list[rt.ForwardInput]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, preset.model.vocab_size, (preset.sequences, (length or preset.seq_len) + 1), generator=g)
    return [rt.ForwardInput(row[:-1].clone(), row[1:].clone()) for row in tokens]


def _trainer(model: rt.DecoderLM, lora_rank: int | None, **limits: int | None) -> rt.Trainer:
    return trainer_with_policy(model, lora=None if lora_rank is None else rt.LoRAConfig(rank=lora_rank), **limits)


def _train_after_eval(trainer: rt.Trainer, preset: Preset) -> list[rt.ForwardOutput]:
    trainer.model.eval()
    try:
        learned = trainer.forward(_inputs(preset, 900), options=_RETAIN)  # teaches admission its scale (eval)
        trainer.backward(-sum(o.target_logprobs.sum() for o in learned))
    finally:
        trainer.model.train()
    return trainer.forward(_inputs(preset, 901), options=_OFFLOAD)


def _long_after_short(trainer: rt.Trainer, preset: Preset) -> list[rt.ForwardOutput]:
    learned = trainer.forward(
        _inputs(preset, 904, 33), options=_RETAIN
    )  # one shape class: (length - 1).bit_length() == 6
    trainer.backward(-sum(o.target_logprobs.sum() for o in learned))
    return trainer.forward(_inputs(preset, 905, 64), options=_OFFLOAD)


def _first_offload(trainer: rt.Trainer, preset: Preset) -> list[rt.ForwardOutput]:
    return trainer.forward(_inputs(preset, 902), options=_OFFLOAD)


# name -> (ModelConfig changes, LoRA rank or None for full, the forwards; the last one is judged)
SCENARIOS: dict[str, tuple[dict[str, Any], int | None, Callable[[rt.Trainer, Preset], list[rt.ForwardOutput]]]] = {
    "train-mode forward after an eval-mode one (dropout on)": ({"dropout": 0.1}, None, _train_after_eval),
    "first forward of LoRA rank 256": ({"dropout": 0.0}, 256, _first_offload),
    "long forward after a shorter one of its shape class (dropout on)": (
        {"dropout": 0.1, "dtype": torch.bfloat16},
        None,
        _long_after_short,
    ),
}


def checkpoint_state_bytes(trainer: rt.Trainer) -> int:
    """Rule 3: what the checkpoints hold, from their public state: parameters, masters, AdamW's moment
    tensors and ``.grad``."""
    total = 0
    for checkpoint in trainer.checkpoints.values():
        state = checkpoint.state_dict()
        moments = [
            t
            for slots in state["optimizer"]["state"].values()
            for t in slots.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        ]  # not the 0-d step counters
        grads = [p.grad for p in checkpoint.parameters() if p.grad is not None]
        tensors = [*state["parameters"].values(), *state.get("master_parameters", {}).values(), *moments, *grads]
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def check_checkpoint_budget(preset: Preset) -> tuple[bool, str, dict]:
    """Rule 3: a forced retain beside a stepped checkpoint (AdamW moments) under a device limit one byte under
    what the checkpoint and the forward hold together: refused, or admitted within it."""
    with torch.device(preset.device):
        model = rt.DecoderLM(preset.model.replace(dropout=0.0), seed=0)
    twin = _trainer(model, None)
    twin.backward(-sum(o.target_logprobs.sum() for o in twin.forward(_inputs(preset, 906))))
    twin.optim_step()
    twin.zero_grad()
    state = twin.checkpoint("policy").state_dict()
    outputs = twin.forward(_inputs(preset, 907), options=_RETAIN)
    limit = outputs[0].usage.device_bytes + checkpoint_state_bytes(twin) - 1
    del outputs, twin
    trainer = _trainer(model, None, memory_limit_bytes=limit)
    trainer.load_checkpoint("policy", state)  # the moments, without a forward under the limit first
    values: dict = {"limit_bytes": limit, "checkpoint_state_bytes": checkpoint_state_bytes(trainer)}
    try:
        outputs = trainer.forward(_inputs(preset, 907), options=_RETAIN)
    except rt.MemoryAdmissionError as error:
        values["refused"] = str(error)
        return True, f"refused under device limit {limit} B: {error}", values
    ok, detail = held_within_limits(trainer, limit - values["checkpoint_state_bytes"], None)
    values["predicted_bytes"] = outputs[0].decision.predicted_bytes
    return (
        ok,
        (
            f"admitted ({outputs[0].decision.reason}) under {limit} B beside {values['checkpoint_state_bytes']} B "
            f"of checkpoint state; the records may hold the rest: {detail}"
        ),
        values,
    )


def check_scenario(preset: Preset, name: str) -> tuple[bool, str, dict]:
    """Rule 2 for one scenario: ``(passed, detail, values)``; runs in eval/train as the scenario says and
    leaves the model in train mode."""
    changes, rank, forwards = SCENARIOS[name]
    with torch.device(preset.device):  # built in place, as ``canaries.memory.lifecycle.CensusWorkload`` does
        model = rt.DecoderLM(preset.model.replace(**changes), seed=0)
    twin = forwards(_trainer(model, rank), preset)
    held = twin[0].usage.host_bytes  # what the judged forward really holds (one record for the whole call)
    limit = held - 1
    del twin
    trainer = _trainer(model, rank, host_memory_limit_bytes=limit)
    values: dict = {"host_limit_bytes": limit, "held_unlimited_bytes": held}
    try:
        outputs = forwards(trainer, preset)
    except rt.MemoryAdmissionError as error:
        values["refused"] = str(error)
        return True, f"refused under host limit {limit} B (it holds {held} B): {error}", values
    ok, detail = held_within_limits(trainer, None, limit)
    values["predicted_bytes"] = outputs[0].decision.predicted_bytes
    return ok, f"admitted ({outputs[0].decision.reason}); {detail}", values
