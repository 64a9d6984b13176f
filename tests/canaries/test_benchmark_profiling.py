"""The benchmark's differential profile: its components, their arithmetic, and that it times what it says."""

from __future__ import annotations

from unittest import mock

import pytest

from canaries.benchmark import profiling
from canaries.benchmark.arms import TimedWorkload
from reference_trainer.residency import SavedStateLedger

TINY = TimedWorkload(model="tiny", sequences=1, seq_len=4)


def test_the_profile_splits_the_extra_time_into_its_components_and_a_remainder() -> None:
    with mock.patch.object(SavedStateLedger, "hooks", autospec=True, side_effect=SavedStateLedger.hooks) as hooks:
        result = profiling.profile(TINY, plain_seconds=2.0, extra_seconds=0.25, blocks=2)
    # Warm-up runs the hooked step twice; each of two blocks runs it twice more.
    assert hooks.call_count == 2 + 2 * 2, "the hooked arm must run inside a ledger's saved-tensor hooks"
    seconds = {c["name"]: c["seconds"] for c in result["components"]}
    assert list(seconds) == list(profiling.COMPONENTS)
    assert seconds["bookkeeping"] == pytest.approx(0.25 - seconds["saved_tensor_hooks"] - seconds["gradient_norm"])
    assert seconds["gradient_norm"] > 0 and result["plain_step_seconds"] == 2.0
    assert result["saved_by_reuse_seconds"] == seconds["gradient_norm"]
    assert all(c["buys"] == profiling.COMPONENTS[c["name"]] for c in result["components"])
