"""The *processes* check: the same job at 1 and 2 processes (gloo) ends with the same parameters.

The job is :data:`PROCESS_STEPS` steps; at W processes rank r feeds the
rows ``r, r + W, ...`` of each step's batch (its loss normalised by the
whole batch's token count, so the ranks' losses add up to the batch's) and
the adapter must combine the ranks' gradients before stepping (a sum over
the default process group, which the suite has initialised: gloo, with
torchrun's environment, ``validation.spawn.spawn_ranks``). The one-process
run is spawned too, in a gloo world of 1, so an adapter may call
``dist.all_reduce`` unconditionally. Every rank's final
parameters must equal the one-process run's within the tolerance (NOTE
[Conformance oracle] Rules 3-4): a sum over processes may add in another order.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from validation.spawn import to_plain
from validation.world import spawn_watched

from .checks import FAILED, PASSED, Verdict
from .jobs import make_batch, started
from .oracle import compare, snapshot, tolerance
from .protocol import ConformSpec

__all__ = ["PROCESS_STEPS", "WORLD", "load_factory", "rank_rows", "run_job", "judge_processes", "processes"]

PROCESS_STEPS = 2
WORLD = 2


def load_factory(path: str) -> Callable[[], Any]:
    """The factory ``package.module:name`` names (imported here; the caller turns errors into usage errors)."""
    module, _, name = path.partition(":")
    factory: Callable[[], Any] = getattr(importlib.import_module(module), name)
    return factory


def rank_rows(spec: ConformSpec, rank: int, world: int) -> list[int]:
    """The rows of each batch rank ``rank`` of ``world`` feeds: ``rank, rank + world, ...``."""
    return list(range(rank, spec.batch, world))


def run_job(factory: Callable[[], Any], spec: ConformSpec, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank ``rank`` of ``world``'s share of the job (module docstring); its parameters at the end, FP64."""
    driven = started(factory, spec)
    for step in range(PROCESS_STEPS):
        batch = make_batch(spec, step)
        driven.adapter.backward(driven.step_loss(batch.rows(rank_rows(spec, rank, world)), batch.active))
        driven.adapter.optim_step()
        driven.adapter.zero_grad()
    return snapshot(driven.module())


def _rank_job(path: str, spec: ConformSpec) -> dict[str, np.ndarray]:
    import torch.distributed as dist

    plain: dict[str, np.ndarray] = to_plain(run_job(load_factory(path), spec, dist.get_rank(), dist.get_world_size()))
    return plain


def judge_processes(one: dict[str, torch.Tensor], ranks: list[dict[str, Any]], tol: float) -> Verdict:
    """The verdict from the one-process parameters and each rank's (numpy or tensors)."""
    errors = []
    for rank, found in enumerate(ranks):
        comparison = compare({n: torch.as_tensor(v) for n, v in found.items()}, one, tol)
        if not comparison.ok:
            return Verdict(
                "processes",
                FAILED,
                f"at {len(ranks)} processes rank {rank}'s parameters differ from the "
                f"one-process run's: {comparison.worst()}",
                {"worst": comparison.evidence(), "rank": rank},
            )
        errors.append(comparison.error)
    return Verdict(
        "processes",
        PASSED,
        f"{PROCESS_STEPS} steps at 1 and {len(ranks)} processes: worst parameter "
        f"error {max(errors):.3g} (tolerance {tol:.3g})",
        {"errors": errors},
    )


def processes(path: str, spec: ConformSpec) -> Verdict:
    """The check, for the adapter whose factory ``path`` names (the ranks import it)."""
    (alone,) = spawn_watched(_rank_job, 1, path, spec, timeout_s=150.0)  # a gloo world of 1: the same calls succeed
    ranks = spawn_watched(_rank_job, WORLD, path, spec, timeout_s=150.0)
    return judge_processes(
        {name: torch.as_tensor(value) for name, value in alone.items()}, ranks, tolerance(spec.torch_dtype)
    )
