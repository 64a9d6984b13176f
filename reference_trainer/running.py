"""Running the model for a checkpoint: the one base/full/LoRA dispatch, a record's graph root, the base's reference log-probs."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.func import functional_call

from .checkpoints import Checkpoint, WeightCapture
from .host_reads import trusted_padding
from .inputs import ForwardInput, ForwardOutput, PaddedBatch
from .lora import attach_lora
from .model import DecoderLM, token_logprobs

__all__ = ["base_logprobs", "model_logits", "run_model"]


def model_logits(
    model: DecoderLM,
    checkpoint: Checkpoint | None,
    tensors: Mapping[str, torch.Tensor] | None,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(B, T, V)`` logits of ``model`` with ``checkpoint``'s weights taken from ``tensors`` (the frozen base if None).

    The one place that runs the model for a checkpoint: a full checkpoint's
    ``tensors`` replace the model's parameters (``functional_call``); a LoRA
    checkpoint's are its adapter factors, attached for the call. ``tensors``
    may be live parameters or a capture's snapshot of them.
    """
    args, kwargs = (input_ids,), {"attention_mask": attention_mask}
    if checkpoint is None:
        return model(*args, **kwargs)
    assert tensors is not None, "a checkpoint's call passes its tensors"
    if checkpoint.is_full:
        logits: torch.Tensor = functional_call(model, dict(tensors), args, kwargs)
        return logits
    assert checkpoint.lora_config is not None, "a checkpoint that is not full is a LoRA one"
    with attach_lora(model, checkpoint.lora_config, tensors):
        return model(*args, **kwargs)


def run_model(
    model: DecoderLM, checkpoint: Checkpoint | None, capture: WeightCapture | None, batch: PaddedBatch
) -> torch.Tensor:
    """Padded ``(B, T)`` FP32 target log-probs of ``batch`` under ``capture``'s weights (base if None)."""
    tensors = None if capture is None else capture.tensors
    with trusted_padding():  # PaddedBatch.build made the mask right-padded: no host read per call
        logits = model_logits(model, checkpoint, tensors, batch.input_ids, batch.attention_mask)
    return token_logprobs(logits, batch.targets)


def base_logprobs(model: DecoderLM, flat: list[ForwardInput], device: torch.device) -> list[ForwardOutput]:
    """Reference log-probs of the frozen base: no grad, eval mode (no dropout, no RNG drawn), no record."""
    batch = PaddedBatch.build(flat, device)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logprobs = run_model(model, None, None, batch)
    finally:
        model.train(training)
    return [
        ForwardOutput(target_logprobs=logprobs[row, :length].clone(), version=None, placement="none")
        for row, length in enumerate(batch.lengths)
    ]
