"""The memory-lifetime canary and the censuses it stands on (contract §4, §6, §8; validation.memory).

Every census has a negative control here: a deliberately kept reference (an
activation, a record the trainer forgets to let go) must be flagged, and the
"offload that aliases instead of copies" mutation must fail the canary for the
right reasons.
"""

from __future__ import annotations

import contextlib
import gc
import io
from pathlib import Path
from unittest import mock

import pytest
import torch

import reference_trainer as rt
from canaries import memory
from reference_trainer.graphs import RecordTable
from reference_trainer.testing import inject_fault
from tests.support import make_trainer, sequence
from validation.evidence import verify
from validation.lifetime import TensorCensus
from validation.memory import (
    ActivationWitness,
    CudaReading,
    StorageCensus,
    cuda_leak_verdict,
    frozen_heap,
    two_witnesses,
)

OFFLOAD_CHECKS = {
    "offload: census device bytes within the trainer's own accounting",
    "offload: no activation outlives the forward",
    "offload: device bytes after forward fall to replay's floor",
    "offload: host copies hold what retain keeps on the device",
}


def _run(tmp: Path, **kwargs) -> tuple[dict, str, Path]:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        path = memory.run(out_dir=tmp, **kwargs)
    return verify(path), stdout.getvalue(), path


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, Path]:
    """One unmutated run of the CPU preset, shared by the tests that read it."""
    return _run(tmp_path_factory.mktemp("memory"), preset_name="cpu")


@pytest.fixture
def fast_gc():
    """Collections cost only what the test makes (validation.memory NOTE [Memory census] Rule 5)."""
    with frozen_heap(collect=False):
        yield


# --- the canary -------------------------------------------------------------------------


def test_canary_passes_on_the_reference_trainer_and_writes_verified_evidence(clean) -> None:
    record, stdout, path = clean
    assert record["kind"] == memory.KIND and record["passed"] is True, stdout
    checks = record["checks"]
    for p in memory.PLACEMENTS:
        for name in ("census sees the pending graph after forward", "nothing outlives backward",
                     "nothing outlives a dropped output", "nothing outlives a failed commit once the error is dropped",
                     "previous logical batch freed before the next pull"):
            assert checks[f"{p}: {name}"] is True
    assert OFFLOAD_CHECKS <= set(checks)
    assert {name for name in checks if name.startswith("admission:")} and not any(n.startswith("cuda") for n in checks)
    # One line per check, in order of making, and the record path last.
    lines = stdout.splitlines()
    assert sum(line.startswith(("PASS  ", "FAIL  ")) for line in lines) == len(checks)
    assert lines[-1] == f"wrote {path}"
    assert record["config"]["mutation"] is None and record["config"]["points"] == list(memory.POINTS)


def test_bytes_are_held_while_pending_and_gone_at_every_release_point(clean) -> None:
    record, _, _ = clean
    held = record["measurements"]["lifecycle_bytes"]
    assert set(held) == set(memory.PLACEMENTS) and all(set(held[p]) == set(memory.POINTS) for p in held)
    retain, offload, replay = (held[p]["after_forward"] for p in memory.PLACEMENTS)
    assert retain["device"] > 10 * replay["device"] > 0
    assert offload["device"] == replay["device"] and offload["host"] - replay["host"] == retain["device"] - replay["device"]
    for p in memory.PLACEMENTS:
        for point in ("after_backward", "after_drop", "after_failed_commit", "before_next_logical_batch"):
            assert held[p][point] == {"device": 0, "host": 0}, (p, point)
        assert record["measurements"]["lifecycle_values"][p]["held_with_error_after_failed_commit"]["device"] == 0


def test_admission_stays_within_a_limit_that_binds(clean) -> None:
    record, _, _ = clean
    admission = record["measurements"]["admission"]
    limit = admission["limit_bytes"]
    assert set(admission["placements"]) - {"retain"}, "the limit must force offload or replay"
    assert max(admission["predicted_bytes"]) <= limit
    assert 0 < admission["census_peak_device"] <= limit
    assert admission["census_peak_host"] <= admission["host_limit_bytes"]


def test_cuda_checks_are_reported_as_skipped_on_cpu(clean) -> None:
    record, stdout, _ = clean
    skipped = record["measurements"]["skipped_checks"]
    assert set(skipped) == set(memory.CUDA_CHECKS)
    assert all("runs on cpu" in reason for reason in skipped.values())
    assert all(f"SKIP  {name}" in stdout for name in memory.CUDA_CHECKS)


def test_offload_that_aliases_instead_of_copying_is_caught(tmp_path: Path) -> None:
    record, stdout, path = _run(tmp_path, preset_name="cpu", mutation="offload_alias")
    failed = {name for name, ok in record["checks"].items() if not ok}
    assert record["passed"] is False and failed == OFFLOAD_CHECKS, failed
    assert record["config"]["mutation"] == "offload_alias" and "offload_alias" in path.name
    details = record["measurements"]["details"]
    assert "still allocated" in details["offload: no activation outlives the forward"]
    # The trainer itself is untouched afterwards: the patch lived only inside the run.
    from reference_trainer.residency import SavedStateLedger

    assert SavedStateLedger._copy_storage is not memory._aliasing_copy


def test_a_trainer_that_keeps_released_records_fails_every_release_point(tmp_path: Path) -> None:
    """Negative control for the lifecycle censuses: records kept after release must be flagged."""
    kept: list[object] = []
    release = RecordTable.release

    def keeping_release(self: RecordTable, record: object) -> None:
        kept.append((record, record.root, record.ledger, record.batch))  # what release would drop
        release(self, record)

    with mock.patch.object(RecordTable, "release", keeping_release):
        record, _, _ = _run(tmp_path, preset_name="cpu")
    failed = {name for name, ok in record["checks"].items() if not ok}
    for p in memory.PLACEMENTS:
        assert {f"{p}: nothing outlives backward", f"{p}: nothing outlives a dropped output",
                f"{p}: nothing outlives a failed commit once the error is dropped",
                f"{p}: previous logical batch freed before the next pull"} <= failed, failed


def test_unknown_mutation_is_refused_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(memory.MemoryCanaryError, match="offload_alias"):
        memory.run("cpu", out_dir=tmp_path, mutation="no_such_bug")
    assert list(tmp_path.iterdir()) == []


# --- the censuses and their negative controls ----------------------------------------------


def _stash_hook(trainer: rt.Trainer, stash: list[torch.Tensor]):
    mlp = trainer.model.model.layers[0].mlp.up_proj
    return mlp.register_forward_hook(lambda m, i, o: stash.append(o))


def test_storage_census_flags_a_deliberately_kept_activation(fast_gc) -> None:
    trainer = make_trainer("lora", dropout=0.0)
    results = {}
    for keep in (False, True):
        stash: list[torch.Tensor] = []
        handle = _stash_hook(trainer, stash) if keep else None
        census = StorageCensus()
        out = trainer.forward(rt.ForwardInput(*sequence(int(keep))), options=rt.ForwardOptions(backward_state="offload"))
        trainer.backward(out.target_logprobs.sum())
        grads = [p.grad for p in trainer.checkpoint("policy").parameters()]
        results[keep] = two_witnesses("left", lambda: census.measure(ignore=[out.target_logprobs, *grads]).total, baseline=0)
        if handle is not None:
            handle.remove()
    assert not results[False].leaked
    assert results[True].leaked and results[True].second >= stash[0].untyped_storage().nbytes()


def test_activation_witness_names_a_kept_activation_and_forgets_a_dropped_one(fast_gc) -> None:
    model = rt.DecoderLM(rt.ModelConfig.tiny(), seed=0)
    tokens = torch.arange(1, 9).unsqueeze(0)  # (B, T)
    with torch.no_grad(), ActivationWitness(model) as witness:
        logits = model(tokens)
    assert [s.name for s in witness.alive()] == ["lm_head"], "the caller holds the logits, lm_head's output"
    del logits
    assert witness.seen and witness.alive() == []
    stash: list[torch.Tensor] = []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda m, i, o: stash.append(o))
    with torch.no_grad(), ActivationWitness(model) as witness:
        logits = model(tokens)
    handle.remove()
    del logits
    assert [s.name for s in witness.alive()] == ["model.layers.1.mlp.down_proj = model.layers.1.mlp"]
    stash.clear()
    assert witness.alive() == []


def test_census_counts_a_byte_view_of_an_activation_in_the_device_pool(fast_gc) -> None:
    census = StorageCensus()
    activation = torch.randn(64)
    ref = ActivationWitness(torch.nn.Identity(), include_root=True)
    with ref:
        ref.model(activation)
    census.mark_device(ref.refs)
    alias = torch.empty(0, dtype=torch.uint8).set_(activation.untyped_storage())
    copy = torch.empty(activation.untyped_storage().nbytes(), dtype=torch.uint8)
    del activation
    assert census.measure(collect=False).as_dict() == {"device": 256, "host": 256}
    del copy
    assert census.measure().as_dict() == {"device": 256, "host": 0}
    del alias
    assert census.measure().total == 0 and census.peak.as_dict() == {"device": 256, "host": 256}


def test_frozen_heap_keeps_what_existed_as_baseline_and_sees_what_is_new() -> None:
    """``frozen_heap`` hides old tensors from the collector; their storages must still count as baseline."""
    before = torch.randn(100)
    with frozen_heap(collect=False):
        census = StorageCensus()
        view = before[10:]  # a new tensor object over an old storage: baseline, not new bytes
        fresh = torch.randn(50)
        assert census.measure().as_dict() == {"device": 200, "host": 0}
        del fresh
        assert census.measure().total == 0
    del view


def test_two_witnesses_fail_only_when_both_readings_agree_and_name_the_values(fast_gc) -> None:
    readings = iter([120, 100])
    transient = two_witnesses("bytes", lambda: next(readings), baseline=100)
    assert not transient.leaked
    readings = iter([120, 130])
    leak = two_witnesses("bytes", lambda: next(readings), baseline=100, tolerance=10)
    assert leak.leaked and "before 100 B, after 120 B, after again 130 B" in leak.describe()


@pytest.mark.parametrize(
    "allocated,driver,leaked",
    [((900, 900), (900, 900), True), ((900, 900), (100, 100), False), ((900, 100), (900, 900), False)],
)
def test_cuda_leak_verdict_needs_allocator_and_driver_to_agree_twice(allocated, driver, leaked) -> None:
    readings = iter(CudaReading(a, d) for a, d in zip(allocated, driver))
    with mock.patch("validation.memory.cuda_reading", lambda device: next(readings)):
        verdict, values = cuda_leak_verdict("after backward", "cuda", CudaReading(100, 100))
    assert verdict is leaked and values["leaked"] is leaked
    assert values["allocator"]["baseline"] == 100 and values["allocator"]["first"] == allocated[0]


# --- trainer findings ------------------------------------------------------------------------


def test_the_error_of_a_failed_commit_holds_no_record_state(fast_gc) -> None:
    trainer = make_trainer("lora", dropout=0.0)
    with TensorCensus() as census:
        out = trainer.forward(rt.ForwardInput(*sequence(3)))
    with inject_fault("publish"), pytest.raises(rt.GradientCommitError) as info:
        trainer.backward(out.target_logprobs.sum())
    gc.collect()
    alive = census.alive(ignore=[out.target_logprobs])
    assert info.value is not None and alive == [], [(e.shape, e.dtype) for e in alive]
