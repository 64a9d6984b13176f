"""Liveness canary: injected hangs on gloo processes are reported within the deadline plus a stated margin.

The job (``canaries.liveness.job``) runs each case of :data:`CASES` in its
own spawn of two processes (three for ``skip-0``), watched with a :data:`DEADLINE_S` deadline (NOTE
[Collective watchdog], NOTE [Hang reports]). For each case the watchdog's
dumps are diagnosed and must name, independently of the code under test,
what the injection did (:data:`EXPECTED`):

- ``lag`` (rank 1 sleeps past the deadline before a ``run_logical``): rank 1
  never reached rank 0's ``run_logical`` exchange, and rank 1's own stack
  at detection time shows the injected sleep (``_lag``);
- ``kill`` (rank 1 SIGKILLed inside ``fn``): rank 1 left no trace (dead),
  at the collective rank 0 was in, the backward agreement of ``run_logical``;
- ``skip`` (rank 1 skips ``optim_step``): rank 1 issued ``run_logical`` where
  rank 0 issued ``optim_step``;
- ``skip-0`` (rank 0 of three skips it): rank 0 is named, by the majority
  of ranks 1 and 2 (with two ranks the lowest rank is the reference: an
  injection on rank 1 alone could never name the wrong rank).

In each: rank 0 reported it (its dump) within ``DEADLINE_S + MARGIN_S`` of
entering the collective (a clock check: ``inconclusive (loaded)`` on a busy
machine, NOTE [Machine load]); the run itself ends later (the closing
``monitored_barrier`` and the peers' own waits take up to a deadline each),
measured as ``run_ended_s`` and not judged; every process the job started is gone (by pid); every
process that was not killed left its dump. The control case ``none`` (no
injection) must leave no dump and no error: a watchdog that always fired
would fail it. The job runs on the CPU (gloo) on every preset.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from validation.evidence import Checks
from validation.hangs import Watch, diagnose
from validation.load import Meter, inconclusive
from validation.spawn import spawn_ranks

from ..registry import Judged
from ..request import CanaryRun
from .job import CASE_PROCESSES, CASES, injected_rank, job

__all__ = ["DEADLINE_S", "EXPECTED", "KIND", "MARGIN_S", "judge"]

KIND = "liveness-canary"
DEADLINE_S = 2.0
MARGIN_S = 1.5  # detection past the deadline: a listener's poll, a dump's write, a loaded machine's scheduling
EXPECTED = {  # case -> (how the injected rank differs, the collective named: its call's prefix on the others)
    "lag": ("never reached", "run_logical(mode='rank')"),
    "kill": ("dead", "run_logical(mode='rank')"),
    "skip": ("issued run_logical(mode='rank')", "optim_step"),
    "skip-0": ("issued run_logical(mode='rank')", "optim_step"),
}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _run_case(case: str, scratch: Path) -> dict[str, Any]:
    """One spawn of the job with ``case`` injected; what the watchdog left and what became of the processes."""
    dumps, pids = scratch / case / "dumps", scratch / case / "pids"
    pids.mkdir(parents=True)
    processes = CASE_PROCESSES.get(case, 2)
    meter = Meter()
    outcomes = spawn_ranks(
        job,
        processes,
        case,
        DEADLINE_S,
        str(pids),
        check=False,
        timeout_s=60.0,
        dist_timeout_s=30.0,
        watch=Watch(DEADLINE_S, str(dumps)),
    )
    load = meter.stop()
    ended = time.time()  # the dumps' clock
    bodies = {p.name: json.loads(p.read_text()) for p in sorted(dumps.glob("rank-*.json"))}
    started = [int(p.read_text()) for p in sorted(pids.glob("rank-*.pid"))]
    return {
        "diagnosis": diagnose(dumps, processes),
        "processes": processes,
        "dumps": bodies,
        "exitcodes": [o.exitcode for o in outcomes],
        "errors": [o.value["error"] if o.ok else o.error for o in outcomes],
        "pids": started,
        "alive": [pid for pid in started if _alive(pid)],
        "load": load,
        "ended": ended,
    }


def _named(case: str, diagnosis: dict[str, Any] | None) -> tuple[bool, str]:
    """Whether the diagnosis names the injected rank the way ``EXPECTED[case]`` says, at the collective it says."""
    how, call = EXPECTED[case]
    if diagnosis is None:
        return False, "no dump: the watchdog did not fire"
    injected = injected_rank(case)
    rank = str(injected)
    if how == "dead":
        ok = diagnosis["dead_ranks"] == [injected]
    elif how == "never reached":
        ok = diagnosis["odd_ranks"] == [injected] and diagnosis["by_rank"][rank] is None
    else:
        found = diagnosis["by_rank"].get(rank) or ""
        ok = diagnosis["odd_ranks"] == [injected] and how.removeprefix("issued ") in found
    ok = ok and (diagnosis["call"] or "").startswith(call)
    return ok, f"expected rank {rank} {how} at {call}...; found: {diagnosis['text']}"


def _latency(result: dict[str, Any]) -> float | None:
    """Seconds from rank 0 entering the failed collective to its dump (None: rank 0 did not dump)."""
    body = result["dumps"].get("rank-0-failed.json")
    if body is None or body["in_flight"] is None:
        return None
    return body["dumped_at"] - body["in_flight"]["started"]


def _run_ended(result: dict[str, Any]) -> float | None:
    """Seconds from rank 0 entering the failed collective to the end of the run (None: rank 0 did not dump)."""
    body = result["dumps"].get("rank-0-failed.json")
    if body is None or body["in_flight"] is None:
        return None
    return result["ended"] - body["in_flight"]["started"]


def _judge_case(checks: Checks, case: str, result: dict[str, Any]) -> None:
    checks.check(f"{case}: rank {injected_rank(case)} and the collective named", *_named(case, result["diagnosis"]))
    latency, bound = _latency(result), DEADLINE_S + MARGIN_S
    detail = f"rank 0 dumped {latency} s after entering it; bound {bound:g} s (deadline {DEADLINE_S:g} + {MARGIN_S:g})"
    if latency is not None and latency > bound and result["load"].loaded:
        checks.skip(f"{case}: reported within the bound", inconclusive(result["load"]))
    else:
        checks.check(f"{case}: reported within the bound", latency is not None and latency <= bound, detail)
    checks.check(
        f"{case}: no process left running",
        not result["alive"] and len(result["pids"]) == result["processes"],
        f"started {result['pids']}, still alive {result['alive']}",
    )
    live = [rank for rank, code in enumerate(result["exitcodes"]) if code != -9]
    dumped = {body["rank"] for body in result["dumps"].values()}
    kept = set(live) <= dumped and (
        case != "lag" or "_lag" in result["dumps"].get(f"rank-{injected_rank(case)}-asked.json", {}).get("stack", "")
    )
    checks.check(
        f"{case}: every live process's dump kept",
        kept,
        f"live ranks {live}, dumps {sorted(result['dumps'])}"
        + (" (rank 1's stack at detection must show _lag)" if case == "lag" else ""),
    )


def judge(run: CanaryRun) -> Judged:
    """The registry's entry point (module docstring); the same cases on every preset and profile."""
    run.runs_every_check("liveness")
    checks, rows = Checks(echo=run.echo), {}
    with tempfile.TemporaryDirectory(prefix="rtv-liveness-") as scratch:
        for case in CASES:
            run.echo(f"liveness canary: case {case}")
            result = _run_case(case, Path(scratch))
            rows[case] = {
                "diagnosis": result["diagnosis"],
                "exitcodes": result["exitcodes"],
                "errors": result["errors"],
                "latency_s": _latency(result),
                "run_ended_s": _run_ended(result),
                "load": str(result["load"]),
                "dumps": sorted(result["dumps"]),
            }
            if case == "none":
                checks.check(
                    "none: a clean run leaves no dump and no error",
                    not result["dumps"] and result["errors"] == [None, None],
                    f"dumps {sorted(result['dumps'])}, errors {result['errors']}",
                )
                continue
            _judge_case(checks, case, result)
    config = {
        "preset": run.preset.name,
        "profile": run.profile,
        "deadline_s": DEADLINE_S,
        "margin_s": MARGIN_S,
        "processes": {case: CASE_PROCESSES.get(case, 2) for case in CASES},
        "backend": "gloo",
        "cases": list(CASES),
    }
    named = {case: (row["diagnosis"] or {}).get("text", "no dump") for case, row in rows.items() if case != "none"}
    return Judged(KIND, config, checks, {"deadline_s": DEADLINE_S, "margin_s": MARGIN_S, **named, "cases": rows})
