"""Sensitivity suite: deliberately injected trainer bugs that the canaries must catch.

Each :class:`Mutation` monkeypatches the trainer in this process for the
duration of a ``with mutation.apply():`` block (``unittest.mock.patch``), so
nothing outside the block is affected. :func:`run_mutations` runs the
unmutated canary (it must pass), then the canary once per mutation (each must
fail), and writes evidence listing what ran, what was caught, and what did not
apply to the preset.

NOTE [Mutation verdicts]
  1. A mutation is caught when the canary named by ``caught_by`` fails under
     it. ``"derivative"`` mutations run the derivative canary's fixed
     scenarios and its logical-rank check (``profile="scenarios"``), judged by
     the same comparisons as every other run; ``"memory"`` mutations are
     applied by the memory canary itself (``canaries.memory.run(...,
     mutation=name)``), coordinated only through that entry point and the name.
  2. A mutation that passes fails the suite, and so does an unmutated canary
     that fails (it would "catch" every mutation vacuously).
  3. A mutation whose bug cannot show on the preset (replay without RNG
     restore needs dropout) is listed as inapplicable, never silently passed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from reference_trainer import corrections as corrections_module
from reference_trainer import residency as residency_module
from reference_trainer.checkpoints import Checkpoint, WeightCapture
from reference_trainer.commit import GradientTransaction
from reference_trainer.ranks import LogicalRank
from reference_trainer import staleness as staleness_module
from reference_trainer import testing
from validation.evidence import make_record, verify, write_once

from .presets import Preset, preset

__all__ = ["Mutation", "MUTATIONS", "mutation", "MutationOutcome", "judge_mutation", "run_mutations"]


@dataclass(frozen=True)
class Mutation:
    """A known bug: what it breaks, which canary must catch it, and how to inject it."""

    name: str
    description: str
    caught_by: str  # "derivative" or "memory"
    inject: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    needs_dropout: bool = False

    def apply(self) -> contextlib.AbstractContextManager[Any]:
        """The bug, active inside the returned context (derivative mutations only)."""
        if self.inject is None:
            raise ValueError(f"mutation {self.name!r} is injected by canaries.{self.caught_by}, not here")
        return self.inject()

    def applies_to(self, config: Preset) -> bool:
        return not self.needs_dropout or config.model.dropout > 0


# --- the bugs ----------------------------------------------------------------------------


@contextlib.contextmanager
def _stale_weights() -> Iterator[None]:
    """No copy-on-write and no ledger: an old graph silently sees the live weights an optimizer step wrote."""
    with mock.patch.object(Checkpoint, "_copy_on_write", lambda self: None), \
            mock.patch.object(WeightCapture, "check_ledger", lambda self: None):
        yield


@contextlib.contextmanager
def _replay_without_rng() -> Iterator[None]:
    """Replay re-runs the forward with whatever RNG state is current (other dropout masks)."""
    with mock.patch.object(residency_module, "restored_forward_state", lambda state, model: contextlib.nullcontext()):
        yield


def _publish_without_rollback(self: GradientTransaction) -> None:
    """``GradientTransaction.publish`` that leaves earlier assignments in place when a later one fails."""
    for index, staged in enumerate(self._staged.values()):
        old = self._sink.current(staged.checkpoint, staged.name)
        testing.maybe_fail("publish", index)
        self._sink.assign(staged.checkpoint, staged.name, staged.value if old is None else old + staged.value)
    self.agree(None)
    for name, origins in self._origins.items():
        self._sink.record_origins(self._checkpoints(name), origins)
    self.discard()


@contextlib.contextmanager
def _partial_commit() -> Iterator[None]:
    with mock.patch.object(GradientTransaction, "publish", _publish_without_rollback):
        yield


@contextlib.contextmanager
def _staleness_off_by_one() -> Iterator[None]:
    """Every module's ``check_age`` admits staleness ``bound + 1``."""
    original = staleness_module.check_age

    def check_age(checkpoint: Any, version: Any, bound: int) -> None:
        original(checkpoint, version, bound + 1)

    with contextlib.ExitStack() as stack:
        for name, module in list(sys.modules.items()):
            if name.startswith("reference_trainer") and getattr(module, "check_age", None) is original:
                stack.enter_context(mock.patch.object(module, "check_age", check_age))
        yield


@contextlib.contextmanager
def _correct_fresh_records() -> Iterator[None]:
    """The importance correction treats fresh records (staleness 0) as stale."""
    real_staleness = corrections_module.staleness
    with mock.patch.object(corrections_module, "staleness", lambda c, v: max(1, real_staleness(c, v))):
        yield


@contextlib.contextmanager
def _per_rank_normalisation() -> Iterator[None]:
    """``global_token_count`` returns the logical rank's own count: per-rank instead of global normalisation."""

    def local_count(self: LogicalRank, mask: torch.Tensor | Sequence[torch.Tensor]) -> int:
        masks = [mask] if isinstance(mask, torch.Tensor) else list(mask)
        return sum(int(torch.count_nonzero(m)) for m in masks)

    with mock.patch.object(LogicalRank, "global_token_count", local_count):
        yield


MUTATIONS: dict[str, Mutation] = {
    m.name: m
    for m in (
        Mutation("stale_weights", "backward differentiates the live weights, not the forward's (no copy-on-write, "
                 "no ledger)", "derivative", _stale_weights),
        Mutation("replay_without_rng", "replay re-runs the forward without restoring its RNG state (other dropout "
                 "masks)", "derivative", _replay_without_rng, needs_dropout=True),
        Mutation("partial_commit", "a failure during publication keeps the gradients already published (no "
                 "rollback)", "derivative", _partial_commit),
        Mutation("staleness_off_by_one", "the staleness check admits bound + 1", "derivative", _staleness_off_by_one),
        Mutation("correct_fresh_records", "the importance correction is applied to fresh records", "derivative",
                 _correct_fresh_records),
        Mutation("offload_alias", "offload keeps an alias of the saved storage instead of a host copy", "memory"),
        Mutation("per_rank_normalisation", "each logical rank normalises its loss by its own token count",
                 "derivative", _per_rank_normalisation),
    )
}


def mutation(name: str) -> Mutation:
    try:
        return MUTATIONS[name]
    except KeyError:
        raise ValueError(f"unknown mutation {name!r}; expected one of {sorted(MUTATIONS)}") from None


# --- the suite (NOTE Rules 1-3) --------------------------------------------------------------


@dataclass(frozen=True)
class MutationOutcome:
    name: str
    caught_by: str
    applicable: bool
    caught: bool
    failed_checks: tuple[str, ...]
    first_failure: str
    seconds: float


def judge_mutation(mutation_: Mutation, preset_name: str, *, out_dir: Path) -> MutationOutcome:
    """Run the canary that must catch ``mutation_`` with the bug injected (NOTE Rule 1)."""
    from . import derivative

    config = preset(preset_name).on_this_machine()
    started = time.perf_counter()
    if not mutation_.applies_to(config):
        return MutationOutcome(mutation_.name, mutation_.caught_by, False, False, (), "", 0.0)
    if mutation_.caught_by == "memory":
        from . import memory

        record = verify(memory.run(preset_name, out_dir=out_dir, mutation=mutation_.name))
        failed = tuple(name for name, ok in record["checks"].items() if not ok)
        first = failed[0] if failed else ""
    else:
        with mutation_.apply():
            result = derivative.judge(config, profile="scenarios", stop_early=True)
        failed = tuple(name for name, ok in result.checks.items() if not ok)
        first = next(iter(result.failures.values()), "")
    return MutationOutcome(mutation_.name, mutation_.caught_by, True, bool(failed), failed, first[:2000],
                           time.perf_counter() - started)


def run_mutations(preset_name: str = "cpu", *, out_dir: Path, names: Sequence[str] | None = None) -> Path:
    """Unmutated canaries (must pass), then every mutation (each must be caught); returns the evidence path."""
    from . import derivative

    out_dir = Path(out_dir)
    config = preset(preset_name).on_this_machine()
    selected = [mutation(n) for n in (names if names is not None else MUTATIONS)]
    checks: dict[str, bool] = {}
    baseline = derivative.judge(config, profile="scenarios")
    checks["unmutated:derivative passes"] = baseline.passed
    print(f"unmutated derivative canary: {'PASS' if baseline.passed else 'FAIL'}", flush=True)
    if any(m.caught_by == "memory" for m in selected):
        from . import memory

        passed = verify(memory.run(preset_name, out_dir=out_dir))["passed"]
        checks["unmutated:memory passes"] = passed
        print(f"unmutated memory canary: {'PASS' if passed else 'FAIL'}", flush=True)
    outcomes = []
    for m in selected:
        outcome = judge_mutation(m, preset_name, out_dir=out_dir)
        outcomes.append(outcome)
        if outcome.applicable:
            checks[f"caught:{m.name}"] = outcome.caught
        verdict = "inapplicable" if not outcome.applicable else "caught" if outcome.caught else "NOT CAUGHT"
        print(f"mutation {m.name:24} [{m.caught_by}] {verdict} {', '.join(outcome.failed_checks)}", flush=True)
    record = make_record(
        "mutation-suite",
        config={"preset": config.describe(), "mutations": [m.name for m in selected]},
        checks=checks,
        measurements={
            "mutations": {
                o.name: {
                    "description": MUTATIONS[o.name].description,
                    "caught_by": o.caught_by,
                    "applicable": o.applicable,
                    "caught": o.caught,
                    "failed_checks": list(o.failed_checks),
                    "first_failure": o.first_failure,
                    "seconds": round(o.seconds, 3),
                }
                for o in outcomes
            },
            "run": [o.name for o in outcomes if o.applicable],
            "caught": [o.name for o in outcomes if o.caught],
            "inapplicable": [o.name for o in outcomes if not o.applicable],
            "unmutated_failures": baseline.failures,
        },
    )
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    path = write_once(out_dir / f"mutations-{config.name}-{stamp}-{os.getpid()}.json", record)
    print(f"mutation suite {'PASSED' if record['passed'] else 'FAILED'}: {path}", flush=True)
    return path


if __name__ == "__main__":  # python -m canaries.mutations [preset]
    run_mutations(sys.argv[1] if len(sys.argv) > 1 else "cpu", out_dir=Path("rtv-out"))
