"""The one builder of "a trainer with one ``policy`` checkpoint", for canaries, tests and examples.

It lives in ``validation``, the lowest layer that may build a ``Trainer``:
``reference_trainer.testing`` is a core trainer module, which never imports
``reference_trainer.trainer`` or the package's boundary (tests/test_architecture.py,
rules ``callback`` and ``climb``), and ``validation`` is below ``canaries``
(which import it) and above the trainer (which never imports it). Tests
import it like any harness module. tests/test_architecture.py (rule
``one-builder``) refuses a copy of the pattern elsewhere.

Seeding is always explicit: a model built here is initialised from ``seed``;
a LoRA adapter from ``adapter_seed``, which defaults to ``seed + 1`` (the
convention every seeded call site used: model 0, adapter 1). A full
checkpoint copies the base and draws nothing. Nothing reads the global RNG,
so the trainer is the same whatever ran before it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

import reference_trainer as rt

__all__ = ["POLICY", "trainer_with_policy"]

POLICY = "policy"
"""The name of the builder's one checkpoint."""


def trainer_with_policy(
    model: rt.ModelConfig | rt.DecoderLM | None = None,
    *,
    lora: rt.LoRAConfig | None = None,
    optimizer: rt.AdamWConfig | None = None,
    seed: int = 0,
    adapter_seed: int | None = None,
    device: torch.device | str | None = None,
    **trainer_options: Any,
) -> rt.Trainer:
    """A ``Trainer`` over ``model`` with one checkpoint :data:`POLICY`: LoRA ``lora``, or full when ``lora`` is None.

    ``model``: a ``ModelConfig`` (built here as ``DecoderLM(model, seed=seed)``,
    in place on ``device`` when given, so a large model never passes through
    host memory), ``None`` (``ModelConfig.tiny()``), or a built ``DecoderLM``
    used as it is (its weights are already drawn; ``seed`` then only derives
    the adapter's, and ``device`` must be ``None``). ``optimizer``: the
    checkpoint's (``None``: the trainer's default ``AdamWConfig()``).
    ``adapter_seed``: the LoRA adapter's (``None``: ``seed + 1``).
    ``trainer_options`` go to ``rt.Trainer`` as they are (``options``,
    ``memory_limit_bytes``, ``host_memory_limit_bytes``,
    ``planner_calibration``). Add more checkpoints to the result with
    ``add_checkpoint``. Bad arguments raise the trainer's ``ConfigError``.
    """
    if isinstance(model, rt.DecoderLM):
        if device is not None:
            raise rt.ConfigError("device", device, "None with a built DecoderLM (it already lives on its device)")
        built = model
    else:
        config = model if model is not None else rt.ModelConfig.tiny()
        if not isinstance(config, rt.ModelConfig):
            raise rt.ConfigError("model", type(model).__name__, "None, a ModelConfig or a DecoderLM")
        with torch.device(device) if device is not None else contextlib.nullcontext():
            built = rt.DecoderLM(config, seed=seed)
    trainer = rt.Trainer(built, **trainer_options)
    adapter = adapter_seed if adapter_seed is not None else seed + 1
    trainer.add_checkpoint(POLICY, lora=lora, full=lora is None, optimizer=optimizer, seed=adapter)
    return trainer
