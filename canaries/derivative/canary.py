"""The derivative canary: fixed scenarios and a steered exploration, every op judged against the FP64 oracle.

The judging is ``canaries.derivative.oracle_harness`` (Rules 1-6 below); the
fixed scenarios and the logical-rank check are ``canaries.derivative.scenarios``,
the intersection checks ``canaries.derivative.intersections`` (Rule 10),
the exploration ``canaries.derivative.machine``. :func:`judge` is the registry's
entry point (``canaries.registry``, which writes the record); :func:`examine`
judges a preset already resolved, with the negative control's ``bound_cap``.

NOTE [Derivative canary]
  1. Forward: outputs carry the current version; forced placements are honoured; log-probs match the oracle's FP64
     recomputation. The caller then overwrites its input tensors, which must not matter.
  2. Backward: the oracle predicts success or the exact error type and facts. On success every record's report
     (staleness, placement, correction present iff stale and a correction applies, weight statistics) and the
     gradient each backward adds match; on failure no ``.grad`` value or object changed. Either way the caller's RNG
     is untouched.
  3. Optimizer step: both start from the same point (the trainer's weights, AdamW state and gradients); the
     master-weight change must match the oracle's FP64 AdamW, then the oracle adopts the trainer's result, so errors
     never accumulate across steps.
  4. After every op (the invariant): revision, generation (renumbered: a new trainer generation exactly when the
     oracle's changes), live records, which parameters hold gradients and their values, and the live weights
     (exactly) agree.
  5. Tolerances are relative L2 against FP64, scaled by plain autograd's own error in the model's dtype
     (:data:`TOLERANCES`); every backward's reference must be non-zero (``validation.compare``).
  6. Coverage: every record whose gradient is judged is counted in its cell (staleness, placement, corrected,
     checkpoint kind, level); ``bound_cap`` lowers every forward's staleness bound (0: no stale backward can
     succeed), the negative control of the coverage check.
  7. Logical ranks (rank mode, W = 1, L = 2): the gradient buffers of a loss normalised by ``global_token_count``
     sum to the oracle's gradient of the globally normalised loss. The logical ranks' dropout streams derive from
     seed 0 (``run_logical`` seeds them from rank 0's initial seed), never from the process's own initial seed, so
     the measured error is a function of the code alone; the caller's RNG is restored.
  8. Profiles (``canaries.registry``): every profile runs the fixed scenarios and the logical check; the exploration
     follows ``validation.profiles.EXPLORATION[profile]`` (``quick``: seconds; ``default``; ``nightly``: minutes).
     The run stops at the first failed check: a failing scenario already names a short op sequence, and shrinking a
     second failure would cost minutes per injected bug in the mutation suite.
  9. Coverage is a check, made once the others passed: every cell of :func:`claimed_cells` (staleness 1 and 2 x
     retain/offload/replay x corrected at level ``"token"`` or not x each checkpoint kind, and staleness 1 and 2 x
     retain x levels ``"sequence"``, ``"geometric"``, ``"average"`` x each kind) holds at least one judged record,
     and when the exploration runs at least :data:`MIN_BACKPROPAGATING` of its examples backpropagate.
  10. Intersections (every profile, after the fixed scenarios): logical ranks at W = 1 and W = 2 with the default
     options, refused calls that must change nothing, FP64 checkpoints (NOTE [Intersection checks] in
     ``canaries.derivative.intersections``). The scenarios run first so a bug either catches keeps failing the check
     named for it.
  11. Focused runs (``checks=``, the mutation suite's NOTE [Mutation verdicts] Rule 4): only the named checks run,
     in the usual order, without the coverage checks (they judge a whole run); a name that is no check of the
     preset is a ``SetupError``.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from validation.errors import SetupError
from validation.evidence import Checks
from validation.hangs import HangDetected
from validation.profiles import EXPLORATION

from ..preset_budget import check_fits
from ..presets import Preset
from ..registry import Judged
from ..request import CanaryRun
from .intersections import INTERSECTIONS
from .machine import explore
from .oracle_harness import DerivativeHarness
from .oracle_pair import LR, TOLERANCES, Cell, Measurements, checkpoint_kinds
from .scenarios import LEVELS, SCENARIOS, check_logical_ranks, run_scenario

__all__ = [
    "KIND",
    "MIN_BACKPROPAGATING",
    "COVERAGE_CHECK",
    "BACKPROPAGATING_CHECK",
    "LOGICAL_CHECK",
    "EXPLORATION_CHECK",
    "check_names",
    "CanaryResult",
    "claimed_cells",
    "examine",
    "judge",
]

KIND = "derivative-canary"
MIN_BACKPROPAGATING = 0.9
COVERAGE_CHECK = "coverage: a judged record in every claimed cell"
LOGICAL_CHECK = "logical_global_normalisation"
EXPLORATION_CHECK = "state_machine"
BACKPROPAGATING_CHECK = f"coverage: >= {MIN_BACKPROPAGATING:.0%} of examples backpropagate"


def claimed_cells(config: Preset) -> list[Cell]:
    """The (staleness, placement, corrected, checkpoint kind, level) cells the canary claims on ``config`` (Rule 9)."""
    kinds = checkpoint_kinds(config)
    grid = itertools.product((1, 2), ("retain", "offload", "replay"), (False, True), kinds)
    levels = itertools.product((1, 2), kinds, LEVELS)
    return [(s, p, c, k, "token" if c else None) for s, p, c, k in grid] + [
        (s, "retain", True, k, level) for s, k, level in levels
    ]


@dataclass
class CanaryResult:
    """What one canary run found: its checks (``recorded``; failures say why, with op sequences), measurements."""

    recorded: Checks = field(default_factory=Checks)
    measured: Measurements = field(default_factory=Measurements)
    examples: int = 0
    examples_backpropagated: int = 0
    worst_logical_error: float = 0.0

    @property
    def checks(self) -> dict[str, bool]:
        """The verdicts of the checks that ran, by name."""
        return {c.name: c.ok for c in self.recorded if not c.skipped}

    @property
    def failures(self) -> dict[str, str]:
        """Why each failed check failed, by name."""
        return {c.name: c.detail for c in self.recorded if c.failed}

    @property
    def passed(self) -> bool:
        return self.recorded.passed

    def record_check(self, name: str, action: Callable[[], object]) -> object:
        """Run one check; a crash is a failure too (fail closed).

        A hang (``validation.hangs.HangDetected``) is recorded as the check's failure and then raised again: the
        run stops and ``rtv`` exits with the hang's code (NOTE [Hang reports] Rule 3).
        """
        try:
            value = action()
        except Exception as failure:
            self.recorded.check(name, False, f"{type(failure).__name__}: {failure}")
            if isinstance(failure, HangDetected):
                raise
            return None
        self.recorded.check(name, True, "agrees with the FP64 oracle")
        return value


def _fixed_checks(config: Preset) -> list[tuple[str, str, str]]:
    """(check name, scenario, checkpoint kind): every scenario on LoRA, the stale grid on every other kind."""
    kinds = checkpoint_kinds(config)
    return [(f"scenario:{n}", n, kinds[0]) for n in SCENARIOS] + [
        (f"scenario:stale_grid[{k}]", "stale_grid", k) for k in kinds[1:]
    ]


def check_names(config: Preset) -> list[str]:
    """Every check a whole run of ``config`` may make, in order (the coverage checks last)."""
    return [
        LOGICAL_CHECK,
        *(c for c, _, _ in _fixed_checks(config)),
        *INTERSECTIONS,
        EXPLORATION_CHECK,
        BACKPROPAGATING_CHECK,
        COVERAGE_CHECK,
    ]


def examine(
    config: Preset,
    *,
    profile: str = "quick",
    bound_cap: int = 2,
    progress: bool = False,
    checks: Collection[str] | None = None,
    echo: Callable[[str], None] | None = None,
) -> CanaryResult:
    """The scenarios, the logical-rank check, the exploration and the coverage checks (Rules 8-9); only
    ``checks`` when given (Rule 11); ``echo`` is shown each verdict as it is made (``None``: silent).

    ``bound_cap`` caps every forward's staleness bound (0: no stale backward
    succeeds, so the coverage check must fail: its negative control).
    """
    unknown = sorted(set(checks or ()) - set(check_names(config)))
    if unknown:
        raise SetupError(f"derivative canary: no checks named {unknown}", fix=f"use some of {check_names(config)}")
    wanted = (lambda name: True) if checks is None else checks.__contains__
    result = CanaryResult(recorded=Checks(echo=echo))
    if not config.cuda_checks:
        why = "preset swapped to CPU (no CUDA device)" if config.swapped else "CPU preset"
        result.recorded.skip("cuda_rng_unchanged_by_backward", why)
    fixed = [entry for entry in _fixed_checks(config) if wanted(entry[0])]
    intersections = {name: check for name, check in INTERSECTIONS.items() if wanted(name)}
    explored = EXPLORATION[profile].max_examples if wanted(EXPLORATION_CHECK) else 0
    bar = tqdm(
        total=len(fixed) + 1 + len(intersections) + explored,
        desc="derivative",
        unit="check",
        disable=not progress,
        leave=False,
    )
    if wanted(LOGICAL_CHECK):
        error = result.record_check(LOGICAL_CHECK, lambda: check_logical_ranks(config, max(2, config.logical_dp)))
        result.worst_logical_error = error or 0.0
    bar.update()
    for check, scenario, kind in fixed:
        if not all(result.checks.values()):
            break
        scenario_run = functools.partial(run_scenario, config, scenario, kind=kind, bound_cap=bound_cap)
        measured = result.record_check(check, scenario_run)
        bar.update()
        if measured is not None:
            result.measured.merge(measured)
    for check, intersection in intersections.items():  # Rule 10: after the scenarios, so older bugs fail there
        if not all(result.checks.values()):
            break
        result.record_check(check, functools.partial(intersection, config))
        bar.update()
    if explored and all(result.checks.values()):
        _explore(config, profile, result, bound_cap, bar)
    bar.close()
    if checks is None and result.passed:
        _check_coverage(config, result)
    return result


def _check_coverage(config: Preset, result: CanaryResult) -> None:
    empty = [cell for cell in claimed_cells(config) if not result.measured.cells[cell]]
    result.recorded.check(
        COVERAGE_CHECK,
        not empty,
        f"expected a judged record in each claimed cell, found none in {empty}"
        if empty
        else f"every one of the {len(claimed_cells(config))} claimed cells has a judged record",
    )


def _explore(config: Preset, profile: str, result: CanaryResult, bound_cap: int, bar: tqdm) -> None:
    shrinking = []

    def on_example(harness: DerivativeHarness) -> None:
        # After the first failure hypothesis replays variants of it (shrinking); those are not counted.
        if harness.failed:
            shrinking.append(True)
        if shrinking:
            return
        result.examples += 1
        result.examples_backpropagated += harness.measured.records_checked > 0
        result.measured.merge(harness.measured)
        bar.update()

    failure = explore(config, EXPLORATION[profile], on_example=on_example, bound_cap=bound_cap)
    result.recorded.check(EXPLORATION_CHECK, failure is None, failure or f"{result.examples} examples agree")
    if failure is not None:
        return
    share = result.examples_backpropagated / max(1, result.examples)
    result.recorded.check(
        BACKPROPAGATING_CHECK,
        share >= MIN_BACKPROPAGATING,
        f"expected >= {MIN_BACKPROPAGATING:.0%}, found {result.examples_backpropagated} of {result.examples}",
    )


def judge(run: CanaryRun) -> Judged:
    """The registry's entry point: the canary on ``run.preset``, only ``run.checks`` when given (Rule 11); on
    CUDA the preset's memory estimate with the FP64 oracle is checked first (``canaries.preset_budget``)."""
    if run.preset.device == "cuda":
        check_fits(run.preset, oracle=True, echo=run.echo)
    started = time.perf_counter()
    result = examine(run.preset, profile=run.profile, progress=True, checks=run.checks, echo=run.echo)
    return _judged(result, run.preset, run.profile, time.perf_counter() - started, run.checks)


def _judged(result: CanaryResult, config: Preset, profile: str, seconds: float, checks: Sequence[str] | None) -> Judged:
    m = result.measured
    stale = sum(n for (staleness, *_), n in m.cells.items() if staleness > 0)
    return Judged(
        KIND,
        {
            "preset": config.describe(),
            "profile": profile,
            "checkpoint_kinds": list(checkpoint_kinds(config)),
            "tolerances": TOLERANCES[config.model.dtype].__dict__,
            "learning_rate": LR,
            "checks": None if checks is None else list(checks),
        },
        result.recorded,
        {
            "examples": result.examples,
            "examples_backpropagated": result.examples_backpropagated,
            "ops": m.ops,
            "backwards": m.backwards,
            "optimizer_steps": m.steps,
            "errors_predicted_and_matched": m.errors_predicted,
            "records_checked": m.records_checked,
            "stale_records_backpropagated": m.stale_records,
            "stale_share_of_checked": stale / max(1, m.records_checked),
            "corrected_records": m.corrected_records,
            "cells": [
                {
                    "staleness": s,
                    "placement": p,
                    "corrected": c,
                    "checkpoint": k,
                    "level": level,
                    "records": m.cells[(s, p, c, k, level)],
                }
                for (s, p, c, k, level) in sorted(m.cells, key=str)
            ],
            "claimed_cells_empty": [list(cell) for cell in claimed_cells(config) if not m.cells[cell]],
            "worst_gradient_relative_l2": m.worst_gradient_error,
            "worst_gradient_error_over_threshold": m.worst_gradient_margin,
            "worst_logprob_relative_l2": m.worst_logprob_error,
            "worst_step_relative_l2": m.worst_step_error,
            "worst_logical_relative_l2": result.worst_logical_error,
            "min_reference_norm": None if math.isinf(m.min_reference_norm) else m.min_reference_norm,
            "seconds": round(seconds, 3),
        },
    )
