"""The censuses the memory canary stands on (``validation.lifetime``, ``validation.memory``).

Every census has a negative control: a deliberately kept reference (an
activation, a view of one, a record's state) must be flagged, and two
witnesses fail only when both readings agree.
"""

from __future__ import annotations

import gc
from unittest import mock

import pytest
import torch

import reference_trainer as rt
from reference_trainer.testing import inject_fault
from tests.support import make_trainer, sequence
from validation.lifetime import TensorCensus
from validation.memory import (
    ActivationWitness,
    CudaReading,
    StorageCensus,
    cuda_leak_verdict,
    frozen_heap,
    two_witnesses,
)


@pytest.fixture
def fast_gc():
    """Collections cost only what the test makes (validation.memory NOTE [Memory census] Rule 6)."""
    with frozen_heap(collect=False):
        yield


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
        out = trainer.forward(
            rt.ForwardInput(*sequence(int(keep))), options=rt.ForwardOptions(backward_state="offload")
        )
        trainer.backward(out.target_logprobs.sum())
        grads = [p.grad for p in trainer.checkpoint("policy").parameters()]
        ignore = [out.target_logprobs, *grads]
        results[keep] = two_witnesses("left", lambda c=census, i=ignore: c.measure(ignore=i).total, baseline=0)
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
