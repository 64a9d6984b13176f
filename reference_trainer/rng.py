"""RNG streams, and the state of a forward captured once and restored for re-runs.

A re-run (replay, or the current-weight forward of an ``"always"`` correction)
must draw the same dropout masks as the forward, in the same train/eval mode
and autocast, and must leave the caller's RNG and the model's mode exactly as
it found them: fork, set the forward's state, run, restore. Logical ranks keep
one RNG stream each (NOTE [Logical ranks] Rule 2) through the helpers below.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "ForwardState",
    "RngState",
    "capture_forward_state",
    "draws_undone_on_failure",
    "restored_forward_state",
    "rng_state",
    "seeded_rng_state",
    "set_rng_state",
    "stream_seed",
]

RngState = tuple[torch.Tensor, "torch.Tensor | None"]  # (CPU generator state, CUDA generator state or None)


def rng_state(device: torch.device) -> RngState:
    """The state of the generators a forward on ``device`` draws from."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: RngState, device: torch.device) -> None:
    """Set the generators ``rng_state`` read; the CUDA one first, so that if it refuses the CPU one is unchanged."""
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
    torch.set_rng_state(state[0])


def seeded_rng_state(seed: int, device: torch.device) -> RngState:
    """The RNG state ``manual_seed(seed)`` would give, without touching the live generators."""
    cpu = torch.Generator().manual_seed(seed).get_state()
    if device.type != "cuda":
        return cpu, None
    return cpu, torch.Generator(device=device).manual_seed(seed).get_state()


def stream_seed(seed: int, logical_rank: int) -> int:
    """The seed of logical rank ``logical_rank``'s own stream in a job seeded with ``seed``."""
    digest = hashlib.sha256(f"{seed}/{logical_rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@contextmanager
def draws_undone_on_failure(device: torch.device) -> Iterator[None]:
    """If the block raises, the generators a forward on ``device`` draws from are set back to their state on entry."""
    state = rng_state(device)
    try:
        yield
    except BaseException:
        set_rng_state(state, device)
        raise


@dataclass(frozen=True)
class ForwardState:
    cpu_rng: torch.Tensor
    cuda_rng: torch.Tensor | None
    device: torch.device
    autocast_enabled: bool
    autocast_dtype: torch.dtype
    training: bool  # the model's train/eval mode (dropout on or off)


def capture_forward_state(model: nn.Module, device: torch.device) -> ForwardState:
    """The RNG streams a forward of ``model`` on ``device`` draws from, its mode and the ambient autocast."""
    cpu_rng, cuda_rng = rng_state(device)
    return ForwardState(
        cpu_rng=cpu_rng,
        cuda_rng=cuda_rng,
        device=device,
        autocast_enabled=torch.is_autocast_enabled(device.type),
        autocast_dtype=torch.get_autocast_dtype(device.type),
        training=model.training,
    )


@contextmanager
def restored_forward_state(state: ForwardState, model: nn.Module) -> Iterator[None]:
    """Run the block with ``state``'s RNG, mode and autocast; the caller's RNG and ``model``'s mode are restored after."""
    devices = [state.device] if state.device.type == "cuda" else []
    training = model.training
    with torch.random.fork_rng(devices=devices, device_type=state.device.type if devices else "cuda"):
        set_rng_state((state.cpu_rng, state.cuda_rng), state.device)
        model.train(state.training)
        try:
            with torch.autocast(state.device.type, dtype=state.autocast_dtype, enabled=state.autocast_enabled):
                yield
        finally:
            model.train(training)
