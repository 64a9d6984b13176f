"""The plain-autograd reference: a loss's gradient recomputed from scratch at a version's weights.

Deliberately simple: a fresh ``DecoderLM`` built in the requested dtype, the
weights of the forward's version loaded into it, the forward's RNG state set,
one plain autograd pass. It shares only the model definition (and the
documented log-prob formula) with the trainer, so it can judge it.

``snapshot_weights`` records what defines a version's weights;
``plain_gradients`` recomputes a loss's gradient at those weights in FP32
(bitwise reference on CPU) or FP64 (accuracy reference). The whole-sequence
FP64 model of a trainer is ``validation.oracle``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from reference_trainer import DecoderLM, LoRAConfig, ModelConfig, Trainer, token_logprobs
from reference_trainer.lora import attach_lora

__all__ = ["WeightsAt", "snapshot_weights", "plain_gradients", "token_batch", "relative_error"]


@dataclass(frozen=True)
class WeightsAt:
    """The base weights, one checkpoint's trainable weights and its LoRA shape (None: full)."""

    base_state: dict[str, torch.Tensor]
    trainable: dict[str, torch.Tensor]
    lora: LoRAConfig | None


def snapshot_weights(trainer: Trainer, checkpoint: str) -> WeightsAt:
    """Copy the current weights of ``checkpoint`` (call it right before the forward under test)."""
    ckpt = trainer.checkpoint(checkpoint)
    return WeightsAt(
        base_state={k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        trainable={n: p.detach().clone() for n, p in ckpt.named_parameters()},
        lora=ckpt.lora_config,
    )


def plain_gradients(
    model_config: ModelConfig,
    weights: WeightsAt,
    sequences: Sequence[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[list[torch.Tensor]], torch.Tensor],
    rng_state: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Gradient of ``loss_fn(target_logprobs per sequence)`` w.r.t. the trainable weights.

    ``sequences`` run as one right-padded batch, like one trainer record.
    ``rng_state`` is the CPU RNG state at the start of the forward (dropout
    masks); the caller's RNG is left untouched. ``autocast_dtype`` runs the
    forward under CPU autocast.
    """
    model = DecoderLM(model_config.replace(dtype=dtype))
    model.load_state_dict({k: v.to(dtype) for k, v in weights.base_state.items()})
    model.requires_grad_(False)
    trainable = {n: t.detach().to(dtype).clone().requires_grad_(True) for n, t in weights.trainable.items()}
    ids, mask, targets, lengths = token_batch(sequences)
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(rng_state)
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            if weights.lora is None:
                logits = torch.func.functional_call(model, trainable, (ids,), {"attention_mask": mask})
            else:
                with attach_lora(model, weights.lora, trainable):
                    logits = model(ids, attention_mask=mask)
    logprobs = token_logprobs(logits, targets)
    loss = loss_fn([logprobs[row, :length] for row, length in enumerate(lengths)])
    names = list(trainable)
    grads = torch.autograd.grad(loss, [trainable[n] for n in names], allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(trainable[n])) for n, g in zip(names, grads)}


def token_batch(
    sequences: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, list[int]]:
    """One right-padded batch: ``(ids, attention mask or None, targets (-1 on pads), lengths)``, each ``(B, T)``."""
    lengths = [int(ids.numel()) for ids, _ in sequences]
    width = max(lengths)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    targets = torch.full((len(sequences), width), -1, dtype=torch.long)
    for row, (seq, tgt) in enumerate(sequences):
        ids[row, : lengths[row]] = seq
        targets[row, : lengths[row]] = tgt
    mask = None
    if min(lengths) < width:
        mask = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    return ids, mask, targets, lengths


def relative_error(found: torch.Tensor, reference: torch.Tensor) -> float:
    """``||found - reference|| / ||reference||`` in FP64; refuses a zero reference."""
    ref = reference.detach().double()
    norm = float(ref.norm())
    if norm == 0.0:
        raise ValueError("relative_error: the reference is exactly zero, so the comparison would be vacuous")
    return float((found.detach().double() - ref).norm()) / norm
