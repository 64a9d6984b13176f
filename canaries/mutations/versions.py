"""Injected bugs in checkpoints, their versions and the staleness rule (``canaries.mutations.catalogue``).

Each puts back a bug of the weights an old graph sees, the staleness bound,
the master weights, the AdamW state a load accepts, or the busy check a load
makes (NOTE [Intersection checks]).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

from reference_trainer import checkpoints as checkpoints_module
from reference_trainer import staleness as staleness_module
from reference_trainer.checkpoints import Checkpoint, WeightCapture
from reference_trainer.records import RecordTable

from .injection import Mutation, patched

__all__ = ["VERSION_MUTATIONS"]


@contextlib.contextmanager
def _stale_weights() -> Iterator[None]:
    """No copy-on-write and no ledger: an old graph silently sees the live weights an optimizer step wrote."""
    with (
        mock.patch.object(Checkpoint, "_copy_on_write", lambda self: None),
        mock.patch.object(WeightCapture, "check_ledger", lambda self: None),
    ):
        yield


@contextlib.contextmanager
def _staleness_off_by_one() -> Iterator[None]:
    """Every module's ``check_age`` admits staleness ``bound + 1``."""
    original = staleness_module.check_age

    def lenient_check_age(checkpoint: Any, version: Any, bound: int) -> None:
        original(checkpoint, version, bound + 1)

    with contextlib.ExitStack() as stack:
        for name, module in list(sys.modules.items()):
            if name.startswith("reference_trainer") and getattr(module, "check_age", None) is original:
                stack.enter_context(mock.patch.object(module, "check_age", lenient_check_age))
        yield


_REAL_COUNT = RecordTable.count


def _count_every_checkpoint(self: RecordTable, checkpoint: str | None = None) -> int:
    """The busy check's record count over every checkpoint, whichever one is asked for."""
    return _REAL_COUNT(self, None)


VERSION_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "stale_weights",
        "backward differentiates the live weights, not the forward's (no copy-on-write, no ledger)",
        "derivative",
        _stale_weights,
        "scenario:stale_exact",
    ),
    Mutation(
        "staleness_off_by_one",
        "the staleness check admits bound + 1",
        "derivative",
        _staleness_off_by_one,
        "scenario:bounds",
    ),
    Mutation(
        "fp32_masters_for_fp64",
        "FP32 masters for every dtype other than FP32, FP64 included",
        "derivative",
        patched(checkpoints_module, "needs_master", lambda dtype: dtype != torch.float32),
        "intersection: FP64 stale scenario matches the FP64 oracle at FP64 tolerance",
    ),
    Mutation(
        "optimizer_state_unchecked",
        "load_checkpoint accepts an AdamW state that cannot step",
        "derivative",
        patched(checkpoints_module, "check_adamw_state", lambda *args: None),
        "intersection: refused load_checkpoint of an AdamW state without exp_avg (discard_graphs=True) changes nothing",
    ),
    Mutation(
        "busy_counts_every_checkpoint",
        "the busy check counts every checkpoint's records",
        "derivative",
        patched(RecordTable, "count", _count_every_checkpoint),
        "intersection: load_checkpoint of one checkpoint while another has a pending record succeeds",
    ),
)
