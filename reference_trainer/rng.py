"""RNG and autocast state of a forward, captured once and restored for re-runs.

A re-run (replay, or the current-weight forward of an ``"always"`` correction)
must draw the same dropout masks as the forward and must leave the caller's RNG
exactly as it found it: fork, set the forward's state, run, restore.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["ForwardState", "capture_forward_state", "restored_forward_state"]


@dataclass(frozen=True)
class ForwardState:
    cpu_rng: torch.Tensor
    cuda_rng: torch.Tensor | None
    device: torch.device
    autocast_enabled: bool
    autocast_dtype: torch.dtype


def capture_forward_state(device: torch.device) -> ForwardState:
    """The RNG streams a forward on ``device`` draws from, and the ambient autocast."""
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return ForwardState(
        cpu_rng=torch.get_rng_state(),
        cuda_rng=cuda_rng,
        device=device,
        autocast_enabled=torch.is_autocast_enabled(device.type),
        autocast_dtype=torch.get_autocast_dtype(device.type),
    )


@contextmanager
def restored_forward_state(state: ForwardState) -> Iterator[None]:
    """Run the block with ``state``'s RNG and autocast; the caller's RNG is restored after."""
    devices = [state.device] if state.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=state.device.type if devices else "cuda"):
        torch.set_rng_state(state.cpu_rng)
        if state.cuda_rng is not None:
            torch.cuda.set_rng_state(state.cuda_rng, state.device)
        with torch.autocast(state.device.type, dtype=state.autocast_dtype, enabled=state.autocast_enabled):
            yield
