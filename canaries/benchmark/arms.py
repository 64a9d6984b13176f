"""Benchmark arms: one training step on one model and batch, done plainly or by the versioned trainer.

An arm is a zero-argument step (``validation.abba.compare`` times it) plus
what it records about itself: the seconds of its forward and of the rest of
the step (backward and optimizer) on every run, and the bytes the trainer
says it holds between forward and backward.

- ``plain``: ``model(ids)``, ``token_logprobs``, the loss, ``loss.backward()``,
  ``torch.optim.AdamW.step``, ``zero_grad(set_to_none=True)`` (on a LoRA
  workload the adapter is attached and only its parameters train).
- ``<placement>@s<k>``: the versioned trainer with ``backward_state=placement``
  (retain, offload, replay, auto). At staleness 0 each step is forward,
  backward, ``optim_step``, ``zero_grad``. At staleness 2 each step forwards
  a new batch and backpropagates the forward made two steps earlier (two
  older forwards stay pending across the optimizer steps), so every backward
  after the first two steps is two revisions stale.

On CUDA a call returns once its kernels are queued: every clock reading of an
arm (and of ``compare``'s blocks, ``benchmark.py``) goes through
:func:`device_clock`, which synchronises the device first.

Every arm starts from the same weights (``seed``) and sees the same batch
and loss, so their first losses agree (checked before timing). Arms that do
not train the base weights (every versioned arm, and plain on a LoRA
workload) may share one frozen base model (:func:`base_model`), so an 8B
benchmark holds its base weights once.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import reference_trainer as rt
from validation.trainers import trainer_with_policy

from ..presets import PLACEMENT_REQUESTS

__all__ = ["TimedWorkload", "TimedArm", "base_model", "device_clock", "plain_arm", "versioned_arm", "arm_name"]

LR = 1e-5  # small: many steps on one fixed batch must stay finite in every arm


@dataclass(frozen=True, kw_only=True)
class TimedWorkload:
    """``sequences`` x ``seq_len`` tokens on ``model`` (a ``ModelConfig`` factory name), full or LoRA."""

    model: str
    sequences: int
    seq_len: int
    lora: bool = False
    dtype: str = "float32"
    device: str = "cpu"

    @property
    def label(self) -> str:
        """e.g. ``small 4x64 full``; lengths of 1024 and up read ``4x1K``."""
        length = f"{self.seq_len // 1024}K" if self.seq_len >= 1024 and self.seq_len % 1024 == 0 else str(self.seq_len)
        return f"{self.model} {self.sequences}x{length} {'lora' if self.lora else 'full'}"

    @property
    def tokens(self) -> int:
        return self.sequences * self.seq_len

    def config(self) -> rt.ModelConfig:
        return getattr(rt.ModelConfig, self.model)(dtype=getattr(torch, self.dtype), dropout=0.0)

    def batch(self, vocab_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids, targets, advantages)``, each ``(sequences, seq_len)``, on the workload's device."""
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab_size, (self.sequences, self.seq_len + 1), generator=g)
        advantages = torch.randn(self.sequences, self.seq_len, generator=g)
        to = lambda t: t.to(self.device)  # noqa: E731
        return to(tokens[:, :-1].contiguous()), to(tokens[:, 1:].contiguous()), to(advantages)


@dataclass(kw_only=True)
class TimedArm:
    """A timed step and what it records: per-run forward and rest-of-step seconds, bytes held; the model it runs."""

    name: str
    step: Callable[[], float]
    model: rt.DecoderLM | None = None
    trainer: rt.Trainer | None = None  # a versioned arm's (``pauses`` saves and loads it)
    forward_seconds: list[float] = field(default_factory=list)
    rest_seconds: list[float] = field(default_factory=list)
    held: dict[str, int] = field(default_factory=dict)

    def __call__(self) -> float:
        return self.step()


def device_clock(
    device: str | torch.device,
    clock: Callable[[], float] = time.perf_counter,
    synchronize: Callable[[torch.device], None] = torch.cuda.synchronize,
) -> Callable[[], float]:
    """``clock`` for work on ``device``: on CUDA each reading waits for the device's queued work first."""
    device = torch.device(device)
    if device.type != "cuda":
        return clock

    def synced() -> float:
        synchronize(device)
        return clock()

    return synced


def arm_name(placement: str, staleness: int) -> str:
    return f"{placement}@s{staleness}"


def _loss(logprobs: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """The same policy-gradient loss in every arm: ``logprobs`` and ``advantages`` are ``(B, T)``."""
    return -(logprobs.float() * advantages).sum() / advantages.numel()


def base_model(workload: TimedWorkload, seed: int) -> rt.DecoderLM:
    """The workload's model, built directly on its device from ``seed`` (random init, no download)."""
    with torch.device(workload.device):
        return rt.DecoderLM(workload.config(), seed=seed)


def plain_arm(
    workload: TimedWorkload, *, seed: int = 0, model: rt.DecoderLM | None = None, optimizer_step: bool = True
) -> TimedArm:
    """The baseline: a plain PyTorch step (module docstring). ``model`` (LoRA only): a shared base.

    ``optimizer_step=False``: forward and backward only, the gradients dropped
    (``profiling`` times saved-tensor hooks on it, without the optimizer's noise).
    """
    if model is not None and not workload.lora:
        raise ValueError("a plain full-weight arm trains its model: it cannot share a base model")
    model = model if model is not None else base_model(workload, seed)
    ids, targets, advantages = workload.batch(model.config.vocab_size, seed)
    if workload.lora:
        adapter = rt.LoRAAdapter(model, rt.LoRAConfig(), seed=seed)
        for p in model.parameters():
            p.requires_grad_(False)
        params, attached = list(adapter.parameters()), lambda: adapter.attached(model)
    else:
        params, attached = list(model.parameters()), None
    optimizer = torch.optim.AdamW(params, lr=LR)
    arm = TimedArm(name="plain", step=lambda: 0.0, model=model)
    clock = device_clock(workload.device)

    def step() -> float:
        start = clock()
        if attached is None:
            logits = model(ids)
        else:
            with attached():
                logits = model(ids)
        loss = _loss(rt.token_logprobs(logits, targets), advantages)
        middle = clock()
        loss.backward()
        if optimizer_step:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        arm.forward_seconds.append(middle - start)
        arm.rest_seconds.append(clock() - middle)
        return loss.item()

    arm.step = step
    return arm


def versioned_arm(
    workload: TimedWorkload, placement: str, staleness: int, *, seed: int = 0, model: rt.DecoderLM | None = None
) -> TimedArm:
    """The versioned trainer's step with ``placement`` at staleness 0 or 2 (module docstring)."""
    if placement not in PLACEMENT_REQUESTS or staleness not in (0, 2):
        raise ValueError(
            f"expected a placement in {PLACEMENT_REQUESTS} and staleness 0 or 2, found {placement!r}, {staleness}"
        )
    trainer = trainer_with_policy(
        model if model is not None else base_model(workload, seed),
        lora=rt.LoRAConfig() if workload.lora else None,
        optimizer=rt.AdamWConfig(lr=LR),
        adapter_seed=seed,
    )
    ids, targets, advantages = workload.batch(trainer.model.config.vocab_size, seed)
    inputs = [rt.ForwardInput(ids[row], targets[row]) for row in range(workload.sequences)]
    options = rt.ForwardOptions(backward_state=placement, corrections=())
    pending: deque[list[rt.ForwardOutput]] = deque()
    arm = TimedArm(name=arm_name(placement, staleness), step=lambda: 0.0, model=trainer.model, trainer=trainer)
    clock = device_clock(workload.device)

    def step() -> float:
        start = clock()
        pending.append(trainer.forward(inputs, options=options))
        records = {out.record_id: out.usage for outs in pending for out in outs}
        arm.held = {
            "device": sum(u.device_bytes for u in records.values()),
            "host": sum(u.host_bytes for u in records.values()),
        }
        middle = clock()
        if len(pending) <= staleness:  # filling the pipeline (warm-up only)
            arm.forward_seconds.append(middle - start)
            arm.rest_seconds.append(0.0)
            return float("nan")
        outputs = pending.popleft()
        loss = _loss(torch.stack([o.target_logprobs for o in outputs]), advantages)
        trainer.backward(loss)
        if not trainer.optim_step()["policy"].stepped:
            raise RuntimeError(f"{arm.name}: the optimizer step was skipped; the timing would not be comparable")
        trainer.zero_grad()
        arm.forward_seconds.append(middle - start)
        arm.rest_seconds.append(clock() - middle)
        return loss.item()

    arm.step = step
    return arm
