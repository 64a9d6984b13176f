"""Sensitivity suite: deliberately injected trainer bugs that the canaries must catch.

Every injected bug is declared AND implemented here: each :class:`Mutation`
monkeypatches the trainer in this process for the duration of a
``with mutation.apply():`` block (``unittest.mock.patch``), so nothing outside
the block is affected. :func:`run` (the registry's entry point) runs each
catching canary unmutated (it must pass), then, through the registry, the
catching canary once per mutation (it must fail), and writes evidence listing
what ran, what was caught, and what did not apply to the preset.

NOTE [Mutation verdicts]
  1. A mutation is caught when the canary named by ``caught_by`` (a name in
     ``canaries.registry.CANARIES``) writes a failed record while the bug is
     active. The mutated canaries run on the ``quick`` profile whatever the
     suite's profile, and their records go to a scratch folder: they are
     failures by design, summarised in the suite's own record.
  2. A mutation that passes fails the suite, and so does an unmutated canary
     that fails (it would "catch" every mutation vacuously).
  3. A mutation whose bug cannot show on the preset (replay without RNG
     restore needs dropout) is listed as inapplicable, never silently passed.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from tqdm import tqdm

from reference_trainer import commit as commit_module
from reference_trainer import corrections as corrections_module
from reference_trainer import residency as residency_module
from reference_trainer import staleness as staleness_module
from reference_trainer import testing
from reference_trainer.checkpoints import Checkpoint, WeightCapture
from reference_trainer.commit import GradientTransaction
from reference_trainer.ranks import LogicalRank
from reference_trainer.residency import SavedStateLedger
from validation.errors import SetupError
from validation.evidence import evidence_path, make_record, verify, write_once

from . import presets
from .presets import Preset
from .registry import canary

__all__ = ["Mutation", "MUTATIONS", "mutation", "MutationOutcome", "judge_mutation", "run_suite", "run"]

MUTATED_PROFILE = "quick"


@dataclass(frozen=True)
class Mutation:
    """A known bug: what it breaks, which registered canary must catch it, and how to inject it."""

    name: str
    description: str
    caught_by: str
    inject: Callable[[], contextlib.AbstractContextManager[Any]]
    needs_dropout: bool = False

    def apply(self) -> contextlib.AbstractContextManager[Any]:
        """The bug, active inside the returned context."""
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
def _commit_non_finite() -> Iterator[None]:
    """The commit's validation no longer checks finiteness: a first backward of a NaN loss publishes NaN."""
    with mock.patch.object(commit_module, "first_non_finite", lambda staged, norms: None):
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


def _aliasing_copy(self: SavedStateLedger, tensor: torch.Tensor) -> torch.Tensor:
    """A byte view of the original storage instead of a host copy."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


@contextlib.contextmanager
def _offload_alias() -> Iterator[None]:
    """Offload keeps an alias of the saved storage: the saved-state ledger's host "copy" is a view."""
    with mock.patch.object(SavedStateLedger, "_copy_storage", _aliasing_copy):
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
        Mutation("commit_non_finite", "the commit's validation skips the finiteness check (a first NaN backward "
                 "commits)", "derivative", _commit_non_finite),
        Mutation("staleness_off_by_one", "the staleness check admits bound + 1", "derivative", _staleness_off_by_one),
        Mutation("correct_fresh_records", "the importance correction is applied to fresh records", "derivative",
                 _correct_fresh_records),
        Mutation("offload_alias", "offload keeps an alias of the saved storage instead of a host copy", "memory",
                 _offload_alias),
        Mutation("per_rank_normalisation", "each logical rank normalises its loss by its own token count",
                 "derivative", _per_rank_normalisation),
    )
}



def mutation(name: str) -> Mutation:
    """The mutation ``name``; :class:`SetupError` naming the known ones otherwise."""
    try:
        return MUTATIONS[name]
    except KeyError:
        raise SetupError(f"unknown mutation {name!r}", fix=f"use one of {', '.join(MUTATIONS)}") from None


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


def _failures(record: dict) -> tuple[tuple[str, ...], str]:
    failed = tuple(name for name, ok in record["checks"].items() if not ok)  # sorted by name in the file
    notes = record["measurements"].get("failures") or record["measurements"].get("details") or {}
    first = next((str(notes[name]) for name in failed if name in notes), failed[0] if failed else "")
    return failed, first[:2000]


def judge_mutation(mutation_: Mutation, preset: str, *, scratch: Path) -> MutationOutcome:
    """Run the canary that must catch ``mutation_`` with the bug injected (NOTE Rule 1)."""
    if not mutation_.applies_to(presets.preset(preset).on_this_machine()):
        return MutationOutcome(mutation_.name, mutation_.caught_by, False, False, (), "", 0.0)
    started = time.perf_counter()
    with mutation_.apply(), contextlib.redirect_stdout(None):
        record = verify(canary(mutation_.caught_by).run(preset, MUTATED_PROFILE, scratch))
    failed, first = _failures(record)
    return MutationOutcome(mutation_.name, mutation_.caught_by, True, bool(failed), failed, first,
                           time.perf_counter() - started)


def run_suite(preset: str, profile: str, out_dir: Path, *, names: Sequence[str] | None = None) -> Path:
    """Unmutated canaries (must pass), then every selected mutation (each must be caught); the evidence path."""
    config = presets.preset(preset).on_this_machine()
    selected = [mutation(n) for n in (names if names is not None else MUTATIONS)]
    checks: dict[str, bool] = {}
    unmutated: dict[str, str] = {}
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="rtv-mutations-") as scratch:
        for name in dict.fromkeys(m.caught_by for m in selected):
            with contextlib.redirect_stdout(None):
                record = verify(canary(name).run(preset, MUTATED_PROFILE, Path(scratch)))
            checks[f"unmutated:{name} passes"] = record["passed"]
            unmutated[name] = _failures(record)[1]
            print(f"unmutated {name} canary: {'PASS' if record['passed'] else 'FAIL'}", flush=True)
        for m in tqdm(selected, desc="mutations", unit="mutation", leave=False):
            outcome = judge_mutation(m, preset, scratch=Path(scratch))
            outcomes.append(outcome)
            if outcome.applicable:
                checks[f"caught:{m.name}"] = outcome.caught
            verdict = "inapplicable" if not outcome.applicable else "caught" if outcome.caught else "NOT CAUGHT"
            tqdm.write(f"mutation {m.name:24} [{m.caught_by}] {verdict} {', '.join(outcome.failed_checks)}")
    record = make_record(
        "mutation-suite",
        config={"preset": config.describe(), "profile": profile, "mutated_profile": MUTATED_PROFILE,
                "mutations": [m.name for m in selected]},
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
            "unmutated_failures": {name: text for name, text in unmutated.items() if text},
        },
    )
    path = write_once(evidence_path(out_dir, f"mutations-{config.name}"), record)
    print(f"mutation suite {'PASSED' if record['passed'] else 'FAILED'}: {path}", flush=True)
    return path


def run(preset: str, profile: str, out_dir: Path) -> Path:
    """The registry's entry point: every mutation in :data:`MUTATIONS` (see :func:`run_suite`)."""
    return run_suite(preset, profile, out_dir)
