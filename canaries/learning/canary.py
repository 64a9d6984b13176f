"""Learning-comparison canary: do stale, corrected and relocated backwards learn as well as strict training?

Exact gradients are necessary, not sufficient. This canary trains the arms
of ``canaries.learning.arms.ARMS`` (all of them, or on ``quick`` the subset
below: a plain PyTorch loop, the versioned trainer strict, stale by 1 and 2 steps with and without importance
correction, retain / offload / replay, the other correction levels at
staleness 2 (shown, not enforced), and deliberately broken sensitivity
arms) on the two workloads of ``canaries.learning.workloads`` (next-byte
prediction on standard-library source, the synthetic RL task), on a matched
schedule, for several seeds each; then judges each arm against its baseline
with paired TOST verdicts across seeds (``validation.equivalence``) and
checks what must hold exactly (NOTE [Learning checks] in
``canaries.learning.summary``). A workload whose untrained model already
meets its criterion is not run: the canary fails with that reason.

Profiles (seeds per arm, arms per workload; both workloads always):
``quick`` 3 seeds x the 8 arms of :data:`QUICK_ARMS`, ``default`` 5 and
``nightly`` 10 seeds x all 13 arms (GPU preset: 3 / 8 / 16 seeds). What
``quick`` measures: every check of NOTE [Learning checks] that does not need
many seeds, at the largest staleness: ``strict`` bitwise equal to ``plain``,
offload and replay bitwise equal to retain at staleness 2, staleness-2
records as scheduled (corrected and uncorrected, each learning to its
criterion), and both broken arms caught (the mild one still judged worse).
Its 3-seed verdicts are shown as every profile's are, but with 2 degrees of
freedom only a large difference is decided; staleness 1 and the
correction-level arms (shown, never enforced) run from ``default`` on.
The arm-seed runs go to 2 worker processes (one torch thread each). Cost,
by design: a run takes about 1.1 s of CPU on this machine's cores (an RL
run about 1.5 s, a next-byte run about 0.9 s), so ``quick``'s 48 runs are
about 60 s of CPU with the two workers' start-up: about 30 s of wall time on
2 idle cores, half its 60 s budget (docs/harness.md#time-budgets); measured
on the shared machine (load average 12): 74 s of CPU (user + sys), 5.6 min
of wall time. ``default``'s 130 runs take about 75 s of wall time on 2 idle
cores. The evidence records what the profile ran and each run's wall time.

Presets: ``cpu`` (FP32, CPU shapes); ``gpu`` (a wider model in BF16 on CUDA,
more seeds; on a machine without CUDA it runs the CPU shapes and seeds and
says so); ``gpu-8b`` is refused (:class:`SetupError`): a matched-schedule
comparison of thirteen arms over several seeds does not fit an 8B model's budget.

Entry point: :func:`judge` (``canaries.registry``, which writes the record);
:func:`judge_plan` judges any :class:`LearningPlan` (the tests use tiny ones
and write them with ``canaries.registry.Canary.record``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed
from dataclasses import dataclass

import torch
from tqdm import tqdm

import reference_trainer as rt
from canaries.learning.arms import ARMS, Arm, ArmRun, initial_metric, run_arm
from canaries.learning.summary import summarize_workload
from canaries.learning.workloads import NextByteWorkload, PatternRLWorkload, Schedule, Workload
from validation.errors import SetupError
from validation.evidence import Checks

from ..presets import Preset
from ..registry import Judged
from ..request import CanaryRun, echo_line

__all__ = [
    "KIND",
    "QUICK_ARMS",
    "SEEDS",
    "LearningPlan",
    "cpu_workloads",
    "judge",
    "judge_plan",
    "plan",
    "profile_arms",
    "tiny_plan",
]

KIND = "learning"
SEEDS = {"cpu": {"quick": 3, "default": 5, "nightly": 10}, "gpu": {"quick": 3, "default": 8, "nightly": 16}}
# What ``quick`` trains (module docstring): every exact pair and both broken arms, at staleness 2.
QUICK_ARMS = (
    "plain",
    "strict",
    "stale2_corrected",
    "stale2_uncorrected",
    "stale2_corrected_offload",
    "stale2_corrected_replay",
    "broken_dropped_updates",
    "broken_flipped_layer",
)


def profile_arms(profile: str) -> tuple[Arm, ...]:
    """The arms ``profile`` trains: :data:`QUICK_ARMS` for ``quick``, every arm of ``ARMS`` otherwise (in its order)."""
    return tuple(a for a in ARMS if profile != "quick" or a.name in QUICK_ARMS)


@dataclass(frozen=True, kw_only=True)
class LearningPlan:
    """What one canary run trains: workloads x arms x seeds, and how it is judged.

    ``exact_enforced``: whether the bitwise pairs are checks (FP32 on CPU) or
    only reported. ``gate``: whether equivalence verdicts are enforced.
    ``notes``: sentences for the evidence (e.g. a preset swapped for CPU).
    ``workers``: processes that train arm-seed runs side by side (each with
    one torch thread; 1 runs them in this process with its thread count).
    """

    preset: str
    profile: str
    seeds: tuple[int, ...]
    workloads: tuple[Workload, ...]
    arms: tuple[Arm, ...] = ARMS
    exact_enforced: bool = True
    gate: bool = False
    notes: tuple[str, ...] = ()
    workers: int = 1

    def describe(self) -> dict:
        return {
            "preset": self.preset,
            "profile": self.profile,
            "seeds": list(self.seeds),
            "workloads": {w.name: w.describe() for w in self.workloads},
            "arms": [a.describe() for a in self.arms],
            "exact_enforced": self.exact_enforced,
            "gate": self.gate,
            "notes": list(self.notes),
            "runs": len(self.workloads) * len(self.arms) * len(self.seeds),
            "profiles": {
                preset: {
                    profile: f"{n} seeds x {len(profile_arms(profile))} arms x {len(self.workloads)} workloads"
                    for profile, n in seeds.items()
                }
                for preset, seeds in SEEDS.items()
            },
            "threads": 1 if self.workers > 1 else torch.get_num_threads(),
            "workers": self.workers,
        }


def cpu_workloads(*, model_changes: dict | None = None, device: str = "cpu") -> tuple[Workload, Workload]:
    """The CPU shapes of both workloads.

    The success criteria are deliberately loose "it learns" bars (next byte:
    5.55 nats/byte at init, about 3.1 after 50 strict steps; RL: about 0.2
    at init, 0.9 to 1.0 after 50 strict steps), the kind a golden-value test
    sets: the mild sensitivity arm (one update in three lost) still meets
    them, and only the paired comparison shows that it learns worse.
    """
    changes = model_changes or {}
    text = NextByteWorkload(
        name="next_byte",
        metric="held-out loss",
        unit="nats/byte",
        higher_is_better=False,
        success=3.75,
        floor_final=0.02,
        floor_auc=0.02,
        schedule=Schedule(steps=50, peak_lr=3e-3, warmup=5, eval_every=10),
        model=rt.ModelConfig.tiny(vocab_size=256, **changes),
        device=device,
        seq_len=64,
        batch_size=8,
        eval_windows=16,
    )
    rl = PatternRLWorkload(
        name="pattern_rl",
        metric="greedy reward",
        unit="fraction of tokens",
        higher_is_better=True,
        success=0.8,
        floor_final=0.03,
        floor_auc=0.03,
        schedule=Schedule(steps=50, peak_lr=1e-3, warmup=5, eval_every=5),
        model=rt.ModelConfig.tiny(vocab_size=8, **changes),
        device=device,
        prompt_len=3,
        completion_len=2,
        prompts=8,
        group=8,
        eval_prompts=32,
        pattern="repeat",
    )
    return text, rl


_GPU_MODEL = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=384,
    dtype=torch.bfloat16,
)


def plan(preset: Preset, profile: str, *, gate: bool = False) -> LearningPlan:
    """The plan ``rtv canary learning --preset PRESET --profile PROFILE`` runs on ``preset`` as it runs on this
    machine (module docstring)."""
    if preset.name == "gpu-8b":
        raise SetupError(
            "the learning canary has no gpu-8b preset: thirteen arms x several seeds of training do not fit an 8B model's budget",
            fix="use --preset gpu (a wider BF16 model on one GPU) or --preset cpu",
        )
    if preset.name == "gpu" and preset.device == "cuda":
        return LearningPlan(
            preset=preset.name,
            profile=profile,
            seeds=tuple(range(SEEDS["gpu"][profile])),
            arms=profile_arms(profile),
            workloads=cpu_workloads(model_changes=_GPU_MODEL, device="cuda"),
            exact_enforced=False,
            gate=gate,
            notes=("GPU preset: BF16 model on CUDA; bitwise pairs are reported, not enforced (owed for FP32 on CPU)",),
        )
    notes = ()
    if preset.name == "gpu":
        notes = ("GPU preset on a machine without CUDA: ran the CPU shapes, FP32 on CPU, with the CPU seeds",)
    return LearningPlan(
        preset=preset.name,
        profile=profile,
        seeds=tuple(range(SEEDS["cpu"][profile])),
        arms=profile_arms(profile),
        workloads=cpu_workloads(),
        gate=gate,
        notes=notes,
        workers=min(2, os.cpu_count() or 1),
    )


def tiny_plan(*, seeds: Sequence[int] = (0, 1), arms: Sequence[str] | None = None, **changes: object) -> LearningPlan:
    """The tiny configuration the test suite runs in seconds: next-byte only, short windows, 12 steps.

    ``arms`` (names) defaults to one of each kind: plain, strict, staleness 2
    corrected and uncorrected, replay, the sequence level, and both
    sensitivity arms.
    ``changes`` replace workload fields (e.g. ``success=10.0`` makes the
    precondition fail).
    """
    names = arms or (
        "plain",
        "strict",
        "stale2_corrected",
        "stale2_uncorrected",
        "stale2_corrected_replay",
        "stale2_sequence",
        "broken_dropped_updates",
        "broken_flipped_layer",
    )
    settings = {
        "schedule": Schedule(steps=12, peak_lr=1e-2, warmup=2, eval_every=4),
        "seq_len": 16,
        "batch_size": 4,
        "eval_windows": 4,
        "success": 4.5,
        **changes,
    }
    text = cpu_workloads()[0].replace(**settings)
    return LearningPlan(
        preset="cpu",
        profile="quick",
        seeds=tuple(seeds),
        workloads=(text,),
        arms=tuple(a for a in ARMS if a.name in names),
        notes=("tiny test configuration",),
    )


def judge(run: CanaryRun) -> Judged:
    """The registry's entry point: :func:`judge_plan` of :func:`plan` (``run.gate`` enforces its equivalence
    verdicts)."""
    run.runs_every_check("learning")
    return judge_plan(plan(run.preset, run.profile, gate=run.gate), echo=run.echo)


def _precondition(workload: Workload, seeds: Sequence[int]) -> dict:
    values = [initial_metric(workload, seed) for seed in seeds]
    solved = [seed for seed, value in zip(seeds, values) if workload.meets(value)]
    reason = None
    if solved:
        reason = (
            f"precondition failed: the untrained model already meets {workload.criterion()} "
            f"(seeds {solved}: {[round(v, 4) for s, v in zip(seeds, values) if s in solved]}); "
            "the workload cannot show learning"
        )
    return {"initial": values, "passed": not solved, "reason": reason}


def _one_thread() -> None:
    torch.set_num_threads(1)


@contextlib.contextmanager
def _pool(workers: int) -> Iterator[Executor | None]:
    """Worker processes for the arm-seed runs (spawned: no forked torch state), or None for in-process."""
    if workers <= 1:
        yield None
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_one_thread) as pool:
        yield pool


def _train_all(workload: Workload, plan_: LearningPlan, pool: Executor | None) -> dict[str, list[ArmRun]]:
    """Every arm on every seed, with a progress bar per arm and seed (stderr)."""
    jobs = [(arm, seed) for arm in _arms_on(workload, plan_) for seed in plan_.seeds]
    done: dict[tuple[str, int], ArmRun] = {}
    with tqdm(total=len(jobs), desc=f"learning {workload.name}", unit="run", file=sys.stderr, leave=False) as bar:
        if pool is None:
            for arm, seed in jobs:
                bar.set_postfix_str(f"{arm.name} seed {seed}")
                done[arm.name, seed] = run_arm(arm, workload, seed)
                bar.update()
        else:
            futures = {pool.submit(run_arm, arm, workload, seed): (arm.name, seed) for arm, seed in jobs}
            for future in as_completed(futures):
                done[futures[future]] = future.result()
                bar.set_postfix_str("{} seed {}".format(*futures[future]))
                bar.update()
    return {arm.name: [done[arm.name, seed] for seed in plan_.seeds] for arm in _arms_on(workload, plan_)}


def _arms_on(workload: Workload, plan_: LearningPlan) -> tuple[Arm, ...]:
    """The plan's arms that run on ``workload`` (NOTE [Arms] Rule 7: the rollout arms only on the RL task)."""
    return tuple(a for a in plan_.arms if a.only_on in (None, workload.name))


def _judge_workload(
    workload: Workload, plan_: LearningPlan, pool: Executor | None, checks: Checks, echo: Callable[[str], None]
) -> dict:
    """The workload's evidence (its checks go to ``checks``); its arms train only if its precondition holds."""
    precondition = _precondition(workload, plan_.seeds)
    checks.check(
        f"{workload.name}: precondition (untrained model misses {workload.criterion()})",
        precondition["passed"],
        precondition["reason"] or f"untrained values {precondition['initial']}",
    )
    entry = {
        "precondition": precondition,
        "metric": workload.metric,
        "unit": workload.unit,
        "higher_is_better": workload.higher_is_better,
        "success": workload.success,
        "criterion": workload.criterion(),
    }
    if not precondition["passed"]:
        echo(f"learning: {workload.name}: {precondition['reason']}")
        return entry
    entry.update(
        summarize_workload(
            workload,
            _arms_on(workload, plan_),
            _train_all(workload, plan_, pool),
            exact_enforced=plan_.exact_enforced,
            gate=plan_.gate,
            checks=checks,
        )
    )
    return entry


def judge_plan(plan_: LearningPlan, *, echo: Callable[[str], None] = echo_line) -> Judged:
    """Train and judge every workload of ``plan_``; shows its checks and verdicts through ``echo``."""
    start = time.perf_counter()
    checks = Checks(echo=echo)
    with _pool(plan_.workers) as pool:
        workloads = {w.name: _judge_workload(w, plan_, pool, checks, echo) for w in plan_.workloads}
    sensitivity = [s for w in workloads.values() for s in w.get("sensitivity", [])]
    if sensitivity:
        shown = [s["arm"] for s in sensitivity if s["meets_and_worse"]]
        checks.check(
            "sensitivity: a broken arm meets its criterion and is still judged worse",
            bool(shown),
            f"shown by {shown}" if shown else "no broken arm both meets its criterion and is judged worse",
        )
    judged = Judged(KIND, plan_.describe(), checks, {"workloads": workloads, "wall_s": time.perf_counter() - start})
    _show_summary(judged, echo)
    return judged


def _show_summary(judged: Judged, echo: Callable[[str], None]) -> None:
    for name, workload in judged.measurements["workloads"].items():
        for verdict in workload.get("verdicts", []):
            if verdict["metric"] == "final":
                echo(
                    f"learning: {name}: {verdict['arm']} vs {verdict['baseline']}: {verdict['verdict']} "
                    f"(final, mean difference {verdict['mean_difference']:+.4f}, 90% CI "
                    f"[{verdict['ci_low']:+.4f}, {verdict['ci_high']:+.4f}], margin {verdict['margin']:.4f})"
                )
    echo(f"learning: {'passed' if judged.checks.passed else 'FAILED'} in {judged.measurements['wall_s']:.1f} s")
