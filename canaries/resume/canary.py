"""Resume canary: a job killed with SIGKILL at any call, or inside a save, restarts from disk and ends bitwise equal.

The job (``canaries.resume.job``: stale corrected backwards, dropout, LoRA
and full checkpoints, two logical ranks, a save per step) runs in spawned
gloo processes (``validation.spawn``). Hypothesis chooses the kill points
(:func:`kill_points`): half between two trainer calls (a quarter before
the first save, which resume from scratch, the rest after it), half
inside a save (before a chosen one of its ``fsync`` calls), each with the process count
of the killed run and of the resumed one (1 or 2 on ``default``). For each,
the job is killed there, restarted from its last save (or from scratch when
it had none), and its finished parameters, AdamW state and revisions must be
bitwise those of the run that never stopped.

Negative control: the same kill, resumed with the RNG state left out of the
save (the job's ``forget_rng``), must end elsewhere; if it does not, the
comparison cannot see a resume that lost the dropout streams and the canary
fails. The job always runs on the CPU (gloo), on every preset: it checks the
save format and resume logic, which do not depend on the device.

Kill points and outcomes are the record's ``kill_points`` measurement;
``reports.canaries`` shows them as a table.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from validation.evidence import Checks
from validation.spawn import RankOutcome, spawn_ranks

from ..registry import Judged
from ..request import CanaryRun
from .job import SAVE_OP, STEP_OPS, job, total_ops

__all__ = ["KIND", "KILLS", "KillPoint", "judge", "kill_points"]

KIND = "resume-canary"
KILLS = {"quick": 4, "default": 20, "nightly": 60}  # kill points per run, half of them inside a save
STEPS = {"quick": 2, "default": 3, "nightly": 4}
PROCESSES = {"quick": (1,), "default": (1, 2), "nightly": (1, 2)}
SAVE_FSYNCS = 9  # os.fsync calls in one save: 4 files, the manifest, the folder, the rename, LATEST, its rename
# (a first save, into a folder it creates, makes one more first: the parent; the kill points stay inside it)


@dataclass(frozen=True)
class KillPoint:
    """Kill before call ``call`` (or after ``fsync`` of the save's fsyncs at that call) on ``killed`` processes,
    resume on ``resumed``."""

    call: int
    fsync: int | None
    killed: int
    resumed: int

    def describe(self) -> str:
        where = f"before call {self.call} ({STEP_OPS[self.call % len(STEP_OPS)]})"
        if self.fsync is not None:
            where = f"inside the save at call {self.call}, before fsync {self.fsync} of {SAVE_FSYNCS}"
        return f"{where}; killed on W={self.killed}, resumed on W={self.resumed}"


def kill_points(profile: str) -> list[KillPoint]:
    """``KILLS[profile]`` distinct kill points chosen by hypothesis (derandomized except on nightly)."""
    calls, count, processes = total_ops(STEPS[profile]), KILLS[profile], PROCESSES[profile]
    saves = list(range(SAVE_OP, calls, len(STEP_OPS)))
    world = st.sampled_from(processes)
    before_a_save = st.builds(KillPoint, st.integers(0, SAVE_OP), st.none(), world, world)
    after_a_save = st.builds(KillPoint, st.integers(SAVE_OP + 1, calls - 1), st.none(), world, world)
    inside = st.builds(KillPoint, st.sampled_from(saves), st.integers(0, SAVE_FSYNCS - 1), world, world)
    sizes = (count // 4, count - count // 2 - count // 4, count // 2)  # before the first save, after it, inside one
    chosen: list[list[KillPoint]] = []

    @settings(
        max_examples=1,
        derandomize=profile != "nightly",
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        st.tuples(
            *(
                st.lists(s, min_size=n, max_size=n, unique=True)
                for s, n in zip((before_a_save, after_a_save, inside), sizes)
            )
        )
    )
    def draw(lists: tuple[list[KillPoint], ...]) -> None:
        chosen.append(
            sorted((p for part in lists for p in part), key=lambda p: (p.call, -1 if p.fsync is None else p.fsync))
        )

    draw()
    return chosen[-1]


def _run(run_dir: Path, steps: int, processes: int, kill: KillPoint | None = None, forget_rng: bool = False) -> Any:
    """One run of the job; rank 0's finished state, or ``None`` when it was killed (every rank by SIGKILL)."""
    args = (str(run_dir), steps, None if kill is None else kill.call, None if kill is None else kill.fsync, forget_rng)
    outcomes: list[RankOutcome] = spawn_ranks(job, processes, *args, check=False, timeout_s=120.0)
    if all(o.exitcode == -9 for o in outcomes):
        return None
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise RuntimeError(f"the job failed on rank {failed[0].rank}: exit {failed[0].exitcode}\n{failed[0].error}")
    return outcomes[0].value


def _differences(found: Any, expected: Any, where: str = "") -> list[str]:
    """Where two finished states (numpy, from ``validation.spawn.to_plain``) differ in a single bit."""
    if isinstance(expected, dict):
        if set(found) != set(expected):
            return [f"{where}: keys differ"]
        return [d for key in expected for d in _differences(found[key], expected[key], f"{where}/{key}")]
    if isinstance(expected, (list, tuple)):
        return [d for i, (f, e) in enumerate(zip(found, expected)) for d in _differences(f, e, f"{where}/{i}")]
    if isinstance(expected, np.ndarray):
        same = found.dtype == expected.dtype and found.shape == expected.shape and found.tobytes() == expected.tobytes()
        return [] if same else [where]
    return [] if found == expected else [f"{where}: {found!r} != {expected!r}"]


def _killed_and_resumed(base: Path, steps: int, kill: KillPoint, forget_rng: bool = False) -> dict[str, Any]:
    """Kill the job at ``kill``, resume it, and say whether it was killed and where it ended."""
    run_dir = Path(tempfile.mkdtemp(dir=base))
    killed = _run(run_dir, steps, kill.killed, kill, forget_rng) is None
    resumed_from_save = (run_dir / "save" / "LATEST").exists()
    return {
        "killed": killed,
        "resumed_from_save": resumed_from_save,
        "state": _run(run_dir, steps, kill.resumed, forget_rng=forget_rng),
    }


def judge(run: CanaryRun) -> Judged:
    """The registry's entry point (module docstring); the job runs on the CPU whatever the preset."""
    run.runs_every_check("resume")
    started, profile = time.perf_counter(), run.profile
    steps, checks, rows = STEPS[profile], Checks(echo=run.echo), []
    points = kill_points(profile)
    run.echo(f"resume canary: {len(points)} kill points over {total_ops(steps)} trainer calls")
    with tempfile.TemporaryDirectory(prefix="rtv-resume-") as scratch:
        base = Path(scratch)
        expected = _run(Path(tempfile.mkdtemp(dir=base)), steps, 1)
        for point in points:
            outcome = _killed_and_resumed(base, steps, point)
            differ = _differences(outcome["state"], expected)
            rows.append(
                {
                    **asdict(point),
                    "where": point.describe(),
                    "killed": outcome["killed"],
                    "resumed_from_save": outcome["resumed_from_save"],
                    "bitwise_equal": not differ,
                    "first_difference": differ[0] if differ else None,
                }
            )
            run.echo(
                f"  kill point {point.describe()}: {'killed' if outcome['killed'] else 'NOT killed'}, "
                f"{'bitwise equal' if not differ else 'differs at ' + differ[0]}"
            )
        failed = [r["where"] for r in rows if not (r["killed"] and r["bitwise_equal"])]
        checks.check(
            "every killed job resumed bitwise equal",
            not failed,
            f"{len(rows) - len(failed)} of {len(rows)} kill points"
            + (f"; first failure {failed[0]}" if failed else ""),
        )
        mid_save = sum(r["fsync"] is not None for r in rows)
        checks.check("kills inside a save among the kill points", mid_save > 0, f"{mid_save} of {len(rows)}")
        from_save = sum(r["resumed_from_save"] for r in rows)
        checks.check(
            "killed jobs resumed from a save (not only from scratch)", from_save > 0, f"{from_save} of {len(rows)}"
        )
        control = KillPoint(SAVE_OP + 1, None, 1, 1)  # right after the first save: everything after it draws dropout
        forgot = _killed_and_resumed(base, steps, control, forget_rng=True)
        control_differs = bool(forgot["resumed_from_save"] and _differences(forgot["state"], expected))
        checks.check(
            "negative control: a save without the RNG state fails the comparison",
            control_differs,
            f"{control.describe()}: the resumed state {'differs' if control_differs else 'is equal (blind)'}",
        )
    measurements = {
        "kill_points": rows,
        "kills": len(rows),
        "kills_inside_a_save": mid_save,
        "resumed_from_a_save": from_save,
        "negative_control_differs": control_differs,
        "seconds": time.perf_counter() - started,
    }
    config = {
        "preset": run.preset.name,
        "profile": profile,
        "device": "cpu",
        "steps": steps,
        "trainer_calls": total_ops(steps),
        "processes": list(PROCESSES[profile]),
        "calls_per_step": STEP_OPS,
    }
    return Judged(KIND, config, checks, measurements)
