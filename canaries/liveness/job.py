"""The liveness canary's job: two steps of logical ranks on two or three processes, with one hang injected.

:func:`job` runs on each process of a ``validation.spawn.spawn_ranks`` group
with the collective watchdog installed (``validation.hangs.Watch``). Each
step is ``run_logical`` (a forward and a backward per logical rank) and then
``optim_step`` (one logical rank per process). The cases (:data:`CASES`),
on :data:`INJECTED_RANK` but where :func:`injected_rank` says otherwise:

- ``lag``: before the second step's ``run_logical`` it sleeps the deadline
  plus :data:`LAG_PAST_DEADLINE_S` (:func:`_lag`);
- ``kill``: inside the second step's ``fn``, before its backward, it
  SIGKILLs itself;
- ``skip``: it skips the first step's ``optim_step`` and goes on to the
  second ``run_logical``, a different collective from rank 0's;
- ``skip-0``: ``skip`` on rank 0 of :data:`CASE_PROCESSES` ``[case]`` = 3
  processes: the odd rank is the hub of the control messages and the lowest
  rank, so only the majority of the other two names it;
- ``none``: nothing is injected (the control: no dump, no error).

Every process writes its pid to ``pid_dir`` first, so the caller can check
that none is left running, and returns the error it ended with (``None``).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import reference_trainer as rt
from validation.trainers import trainer_with_policy

__all__ = ["CASES", "INJECTED_RANK", "LAG_PAST_DEADLINE_S", "CASE_PROCESSES", "injected_rank", "job"]

CASES = ("lag", "kill", "skip", "skip-0", "none")
INJECTED_RANK = 1
CASE_PROCESSES = {"skip-0": 3}  # each case's processes; 2 where not named


def injected_rank(case: str) -> int:
    """The rank ``case`` is injected on (module docstring)."""
    return 0 if case == "skip-0" else INJECTED_RANK


LAG_PAST_DEADLINE_S = 1.0


def _lag(seconds: float) -> None:
    """The injected lag; its name is what the lagging rank's stack must show."""
    time.sleep(seconds)


def _step_body(case: str, step: int, rank: int) -> Any:
    def body(view: Any) -> None:
        generator = torch.Generator().manual_seed(100 * step + view.logical_rank)
        tokens = torch.randint(0, 64, (6,), generator=generator)
        output = view.forward(rt.ForwardInput(tokens), checkpoint="policy")
        if case == "kill" and step == 1 and rank == INJECTED_RANK:
            os.kill(os.getpid(), signal.SIGKILL)
        view.backward(-output.target_logprobs.sum())

    return body


def job(case: str, deadline_s: float, pid_dir: str) -> dict[str, Any]:
    """Run the job on this process (module docstring); ``{"rank", "error"}``."""
    rank = dist.get_rank()
    Path(pid_dir, f"rank-{rank}.pid").write_text(str(os.getpid()))
    torch.manual_seed(0)
    trainer = trainer_with_policy(lora=rt.LoRAConfig(rank=2), optimizer=rt.AdamWConfig(lr=1e-2))
    injected = rank == injected_rank(case)
    try:
        for step in range(2):
            if case == "lag" and step == 1 and injected:
                _lag(deadline_s + LAG_PAST_DEADLINE_S)
            rt.run_logical(_step_body(case, step, rank), trainer, logical_dp=dist.get_world_size(), timeout_s=60.0)
            if not (case.startswith("skip") and step == 0 and injected):
                trainer.optim_step()
    except rt.PeerError as error:
        return {"rank": rank, "error": f"{type(error).__name__}: {error}"}
    return {"rank": rank, "error": None}
