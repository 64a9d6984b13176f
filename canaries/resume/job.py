"""The resume canary's training job: a fixed list of trainer calls, killable before any call and inside any save.

:data:`OPS` is one step of the job, one trainer call each (``STEP_OPS``
names them): two LoRA forwards; the newer backpropagated; two logical ranks
(dropout from their own streams) backpropagating into their buffers; the
step that sums them with the newer; the older backpropagated one revision
old with an ``"always"`` importance correction; a save (the committed stale
gradient and the logical ranks' streams go with it); a full checkpoint's
forward, backward and step; the step of the stale gradient. The model draws
dropout throughout.

:func:`job` runs on every process of a ``validation.spawn.spawn_ranks`` group
(W = 1 or 2). It starts from the last save under ``run_dir`` when there is
one (the policy's revision says which step saved it: :func:`resume_index`),
else from scratch. ``kill_before`` is a call index at which physical rank 0
SIGKILLs every process of the job before making the call; ``kill_in_save``
a count of ``os.fsync`` calls after which, inside the save at that index, it
does so. ``forget_rng`` is the negative control: after the load the process
RNG and the logical ranks' streams are those of a fresh start, as if the save
had not kept them. Rank 0 returns the finished state (``finished_state``).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import reference_trainer as rt
from validation.trainers import trainer_with_policy

__all__ = ["LOGICAL_DP", "OPS", "STEP_OPS", "finished_state", "job", "resume_index", "total_ops"]

SEED = 2026
LOGICAL_DP = 2
STALE = rt.ForwardOptions(max_gradient_staleness=1, corrections=(rt.ImportanceCorrection(policy="always"),))


def _inputs(index: int, salt: int) -> tuple[rt.ForwardInput, torch.Tensor]:
    """Deterministic tokens and advantages for call ``index`` (never drawn from the RNG the trainer saves)."""
    generator = torch.Generator().manual_seed(10_000 * index + salt)
    length = int(torch.randint(5, 10, (1,), generator=generator))
    return rt.ForwardInput(torch.randint(0, 64, (length,), generator=generator)), torch.randn(
        length, generator=generator
    )


def _loss(output: rt.ForwardOutput, advantages: torch.Tensor) -> torch.Tensor:
    return -(output.target_logprobs * advantages).sum()


def _forward(name: str, slot: str, options: rt.ForwardOptions | None = None) -> Callable[..., None]:
    def call(trainer: rt.Trainer, held: dict[str, Any], index: int, run_dir: Path) -> None:
        item, advantages = _inputs(index, len(slot))
        held[slot] = (trainer.forward(item, checkpoint=name, options=options), advantages)

    return call


def _backward(slot: str) -> Callable[..., None]:
    def call(trainer: rt.Trainer, held: dict[str, Any], index: int, run_dir: Path) -> None:
        trainer.backward(_loss(*held.pop(slot)))

    return call


def _logical(trainer: rt.Trainer, held: dict[str, Any], index: int, run_dir: Path) -> None:
    def body(view: Any) -> None:
        item, advantages = _inputs(index, 100 + view.logical_rank)
        view.backward(_loss(view.forward(item, checkpoint="policy"), advantages))

    rt.run_logical(body, trainer, logical_dp=LOGICAL_DP, timeout_s=30.0)


def _save(trainer: rt.Trainer, held: dict[str, Any], index: int, run_dir: Path) -> None:
    trainer.save(run_dir / "save")


OPS: list[tuple[str, Callable[..., None]]] = [
    ("forward policy (old)", _forward("policy", "old", STALE)),
    ("forward policy (new)", _forward("policy", "new", STALE)),
    ("backward new", _backward("new")),
    ("run_logical (2 logical ranks)", _logical),
    ("optim_step policy (new + buffers)", lambda t, h, i, d: t.optim_step(max_grad_norm=1.0, checkpoints=["policy"])),
    ("zero_grad policy", lambda t, h, i, d: t.zero_grad(checkpoints=["policy"])),
    ("backward old (one revision stale, corrected)", _backward("old")),
    ("save", _save),
    ("forward critic", _forward("critic", "critic")),
    ("backward critic", _backward("critic")),
    ("optim_step critic", lambda t, h, i, d: t.optim_step(checkpoints=["critic"])),
    (
        "optim_step policy (the stale gradient)",
        lambda t, h, i, d: t.optim_step(max_grad_norm=1.0, checkpoints=["policy"]),
    ),
    ("zero_grad", lambda t, h, i, d: t.zero_grad()),
]
STEP_OPS = [name for name, _ in OPS]
SAVE_OP = STEP_OPS.index("save")


def total_ops(steps: int) -> int:
    return steps * len(OPS)


def resume_index(trainer: rt.Trainer) -> int:
    """The call after the save ``trainer`` was loaded from: policy revision 2s + 1 is step s's save (two steps a step)."""
    step = (trainer.checkpoint("policy").revision - 1) // 2
    return step * len(OPS) + SAVE_OP + 1


def _model() -> rt.DecoderLM:
    return rt.DecoderLM(rt.ModelConfig.tiny(dropout=0.1), seed=0)


def _fresh() -> rt.Trainer:
    trainer = trainer_with_policy(_model(), lora=rt.LoRAConfig(rank=4), optimizer=rt.AdamWConfig(lr=3e-2))
    trainer.add_checkpoint("critic", full=True, optimizer=rt.AdamWConfig(lr=1e-2))
    return trainer


def finished_state(trainer: rt.Trainer) -> dict[str, Any]:
    """Each checkpoint's parameters, AdamW state (masters included) and revision."""
    return {name: checkpoint.state_dict() for name, checkpoint in trainer.checkpoints.items()}


def _kill_everyone(pids: list[int]) -> None:
    for pid in pids[1:] + pids[:1]:  # the others first, this process last
        os.kill(pid, signal.SIGKILL)


def _arm_fsync_kill(count: int, pids: list[int]) -> Callable[[], None]:
    """From now on, the ``count``-th ``os.fsync`` (0-based) kills the job before it runs; returns the disarm."""
    real, calls = os.fsync, [0]

    def fsync(fd: int) -> None:
        if calls[0] == count:
            _kill_everyone(pids)
        calls[0] += 1
        real(fd)

    os.fsync = fsync
    return lambda: setattr(os, "fsync", real)


def job(run_dir: str, steps: int, kill_before: int | None, kill_in_save: int | None, forget_rng: bool) -> Any:
    """Run (or resume) the job on this process of the group; rank 0 returns the finished state."""
    folder = Path(run_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    pids: list[int] = [os.getpid()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        pids = [None] * dist.get_world_size()
        dist.all_gather_object(pids, os.getpid())
    torch.manual_seed(SEED)
    start = 0
    if (folder / "save" / "LATEST").exists():
        trainer = rt.Trainer.load(folder / "save", _model())
        start = resume_index(trainer)
        if forget_rng:  # the negative control: a save that kept no RNG
            torch.manual_seed(SEED)
            trainer.rank_gradients.resumed = None
    else:
        trainer = _fresh()
    held: dict[str, Any] = {}
    for index in range(start, total_ops(steps)):
        name, call = OPS[index % len(OPS)]
        disarm = None
        if rank == 0 and index == kill_before:
            if kill_in_save is None:
                _kill_everyone(pids)
            disarm = _arm_fsync_kill(kill_in_save, pids)
        call(trainer, held, index, folder)
        if disarm is not None:
            disarm()
    return finished_state(trainer) if rank == 0 else None
