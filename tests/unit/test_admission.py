"""Memory admission under a small budget, checked by an independent storage census.

See docs/semantics.md#placements-and-memory-admission.
"""

from __future__ import annotations

import gc
import re

import pytest
import torch

import reference_trainer as rt
from reference_trainer.admission import DEVICE_MARGIN_FRACTION
from reference_trainer.planner import (
    ForwardCost,
    PendingUsage,
    Placement,
    PlanRequest,
    analytic_saved_bytes,
    plan_placement,
)
from reference_trainer.testing import substitute_device_capacity, substitute_stopwatch
from tests.support import NO_CORRECTION, make_trainer, sequence
from validation.lifetime import live_tensors
from validation.memory import StorageCensus
from validation.trainers import trainer_with_policy

DEVICE_LIMIT = 700_000
HOST_LIMIT = 600_000


def _forward(trainer: rt.Trainer, seed: int, **options) -> list[rt.ForwardOutput]:
    torch.manual_seed(seed)
    inputs = [rt.ForwardInput(*sequence(seed * 10 + k, length=16)) for k in range(2)]
    return trainer.forward(inputs, options=rt.ForwardOptions(corrections=(), **options))


def _run(trainer: rt.Trainer, census: StorageCensus | None) -> list[str]:
    outs = [_forward(trainer, seed) for seed in range(5)]
    placements = [o[0].placement for o in outs]
    if census is not None:
        census.measure()
    for seed, out in enumerate(outs):
        trainer.backward(-sum((o.target_logprobs * (seed + 1)).sum() for o in out))
        if census is not None:
            census.measure()
    return placements


def test_small_budget_auto_offloads_or_replays_what_no_longer_fits_and_stays_under_it() -> None:
    reference = make_trainer("lora", dropout=0.1)
    assert set(_run(reference, None)) == {"retain"}
    trainer = make_trainer("lora", dropout=0.1, memory_limit_bytes=DEVICE_LIMIT, host_memory_limit_bytes=HOST_LIMIT)
    census = StorageCensus()
    # Independent in-flight witness: a census at the last decoder layer of every forward and replay.
    trainer.model.model.layers[-1].register_forward_hook(census.sample_hook())
    placements = _run(trainer, census)
    assert placements[0] == "retain" and set(placements[1:]) & {"offload", "replay"}, placements
    assert 0 < census.peak_device <= DEVICE_LIMIT, census.peak_device
    assert census.peak_host <= HOST_LIMIT
    for (name, expected), param in zip(
        reference.checkpoint("policy").named_parameters(), trainer.checkpoint("policy").parameters()
    ):
        assert torch.equal(param.grad, expected.grad), name


def test_forced_retain_that_cannot_fit_is_refused_before_allocating() -> None:
    trainer = make_trainer("lora", dropout=0.1, memory_limit_bytes=DEVICE_LIMIT, host_memory_limit_bytes=HOST_LIMIT)
    pending = [_forward(trainer, seed) for seed in range(2)]
    gc.collect()
    before = len(live_tensors())
    with pytest.raises(rt.MemoryAdmissionError) as info:
        _forward(trainer, 9, backward_state="retain")
    error = info.value
    assert error.limit_bytes == DEVICE_LIMIT and error.predicted_peak_bytes > DEVICE_LIMIT
    assert "memory_limit_bytes" in error.suggestion and str(error.predicted_peak_bytes) in str(error)
    del info, error
    assert len(live_tensors()) == before, "nothing may be allocated before the refusal"
    assert trainer.live_records() == len(pending)
    auto = _forward(trainer, 9)
    assert auto[0].placement in {"offload", "replay"}
    assert auto[0].decision.predicted_bytes <= DEVICE_LIMIT and auto[0].decision.reason


def test_nothing_fits_raises_with_all_three_fields() -> None:
    trainer = make_trainer("lora", dropout=0.1, memory_limit_bytes=10_000)
    with pytest.raises(rt.MemoryAdmissionError) as info:
        _forward(trainer, 0)
    assert info.value.predicted_peak_bytes > info.value.limit_bytes == 10_000
    assert info.value.suggestion
    assert trainer.live_records() == 0


def _cost(**changes) -> ForwardCost:
    fields = dict(
        saved_bytes=100,
        transient_bytes=10,
        snapshot_bytes=0,
        input_bytes=0,
        staging_bytes=0,
        forward_seconds=1.0,
        transfer_seconds=0.1,
    )
    return ForwardCost(**{**fields, **changes})


def _request(cost: ForwardCost, **changes) -> PlanRequest:
    fields = dict(
        cost=cost,
        pending=PendingUsage(),
        requested="auto",
        allow_offload=True,
        allow_replay=True,
        device_limit=None,
        host_limit=None,
    )
    return PlanRequest(**{**fields, **changes})


def test_planner_is_a_pure_function_of_sizes_and_costs() -> None:
    assert plan_placement(_request(_cost())).placement is Placement.RETAIN
    # A pending offloaded record already reserves a 110-byte backward workspace: retaining
    # 100 more bytes (peak 10 + 100 + 110) does not fit in 150, rebuilding them later (10 + 110) does.
    busy = dict(device_limit=150, pending=PendingUsage(device_persistent=10, max_workspace=110))
    assert plan_placement(_request(_cost(), **busy)).placement is Placement.OFFLOAD  # 2 x 0.1 s < 1 s
    assert plan_placement(_request(_cost(transfer_seconds=5.0), **busy)).placement is Placement.REPLAY
    assert plan_placement(_request(_cost(), allow_offload=False, **busy)).placement is Placement.REPLAY
    assert plan_placement(_request(_cost(), host_limit=50, **busy)).placement is Placement.REPLAY
    assert plan_placement(_request(_cost(), requested="replay", **busy)).placement is Placement.REPLAY
    with pytest.raises(rt.MemoryAdmissionError):
        plan_placement(_request(_cost(), requested="retain", **busy))
    with pytest.raises(rt.MemoryAdmissionError):
        plan_placement(_request(_cost(), allow_offload=False, allow_replay=False, **busy))
    with pytest.raises(rt.MemoryAdmissionError):
        plan_placement(_request(_cost(), device_limit=50))


def test_every_forward_reports_placement_bytes_and_why() -> None:
    trainer = make_trainer("full", dropout=0.0)
    out = trainer.forward(rt.ForwardInput(*sequence(1)), options=NO_CORRECTION)
    assert out.placement == out.decision.placement == "retain"
    assert out.decision.predicted_bytes > 0 and "retain" in out.decision.reason


def _prediction_after_step(first_forward_shares_the_version: bool) -> int:
    """The next forward's predicted peak when one pending record outlives an optimizer step."""
    trainer = make_trainer("full", dropout=0.0)
    first = (
        trainer.forward(rt.ForwardInput(*sequence(1)), options=NO_CORRECTION)
        if first_forward_shares_the_version
        else None
    )
    pending = trainer.forward(rt.ForwardInput(*sequence(2)), options=NO_CORRECTION)
    other = first if first is not None else trainer.forward(rt.ForwardInput(*sequence(1)), options=NO_CORRECTION)
    trainer.backward(other.target_logprobs.sum())
    del first, other
    trainer.optim_step()  # the pending record's snapshot is now a copy of its own
    assert trainer.live_records() == 1 and pending.version.revision == 0
    return trainer.forward(rt.ForwardInput(*sequence(3)), options=NO_CORRECTION).decision.predicted_bytes


def test_a_shared_weight_snapshot_is_counted_while_any_record_of_its_version_lives() -> None:
    """The snapshot one record paid for must not vanish from the budget when that record goes."""
    assert _prediction_after_step(True) == _prediction_after_step(False)


def test_a_refused_forward_call_leaves_no_record_of_its_earlier_groups() -> None:
    trainer = make_trainer("lora", dropout=0.0, host_memory_limit_bytes=0)
    fits = rt.ForwardInput(*sequence(1))
    refused = rt.ForwardInput(*sequence(2), options=rt.ForwardOptions(backward_state="offload"))
    with pytest.raises(rt.MemoryAdmissionError) as info:
        trainer.forward([fits, refused], options=NO_CORRECTION)
    assert trainer.live_records() == 0, "one call is all or nothing, even while the error is held"
    del info


# --- the default device limit (memory_limit_bytes=None) -------------------------------------

# A device whose capacity, less the documented margin, is DEVICE_LIMIT.
CAPACITY = round(DEVICE_LIMIT / (1 - DEVICE_MARGIN_FRACTION))


def test_default_limit_under_a_substituted_capacity_offloads_or_replays_and_stays_under_it() -> None:
    calls = []

    def capacity(device: torch.device) -> int:
        calls.append(device)
        return CAPACITY

    with substitute_device_capacity(capacity):
        trainer = make_trainer("lora", dropout=0.1, host_memory_limit_bytes=HOST_LIMIT)
    assert calls == [trainer.device], "the capacity is read once, at construction, for the trainer's device"
    assert 0.9 * CAPACITY <= trainer.memory_limit_bytes < CAPACITY, "a margin of a few percent is kept"
    census = StorageCensus()
    trainer.model.model.layers[-1].register_forward_hook(census.sample_hook())
    placements = _run(trainer, census)
    assert placements[0] == "retain" and set(placements[1:]) & {"offload", "replay"}, placements
    assert 0 < census.peak_device <= trainer.memory_limit_bytes, census.peak_device


def test_default_limit_refuses_when_nothing_fits_the_capacity() -> None:
    with substitute_device_capacity(10_000):
        trainer = make_trainer("lora", dropout=0.1)
    with pytest.raises(rt.MemoryAdmissionError) as info:
        _forward(trainer, 0)
    assert info.value.limit_bytes == trainer.memory_limit_bytes < 10_000
    assert trainer.live_records() == 0


def test_an_explicit_limit_wins_over_the_capacity() -> None:
    with substitute_device_capacity(10_000):
        trainer = make_trainer("lora", dropout=0.1, memory_limit_bytes=10**9)
    assert trainer.memory_limit_bytes == 10**9
    assert _forward(trainer, 0)[0].placement == "retain"


def test_cpu_default_stays_unbounded() -> None:
    trainer = make_trainer("lora", dropout=0.1)
    assert trainer.device.type == "cpu" and trainer.memory_limit_bytes is None
    outs = [_forward(trainer, seed) for seed in range(5)]
    assert {o[0].placement for o in outs} == {"retain"}


def test_a_retained_record_demoted_to_host_reports_offload_at_backward() -> None:
    trainer = make_trainer("lora", dropout=0.1, memory_limit_bytes=DEVICE_LIMIT, host_memory_limit_bytes=HOST_LIMIT)
    outs = [_forward(trainer, seed) for seed in range(5)]
    demoted = sum(int(m.group(1)) for o in outs if (m := re.search(r"demoted (\d+) pending", o[0].decision.reason)))
    assert demoted >= 1, [o[0].decision.reason for o in outs]
    became = []
    for out in outs:
        (record,) = trainer.backward(-sum(o.target_logprobs.sum() for o in out)).records
        became.append((out[0].placement, record.placement))
    # Demotion takes the oldest retained records first: exactly those now report what they became.
    retained = [i for i, (at_forward, _) in enumerate(became) if at_forward == "retain"]
    assert [became[i][1] for i in retained[:demoted]] == ["offload"] * demoted, became
    assert [became[i][1] for i in retained[demoted:]] == ["retain"] * (len(retained) - demoted), became


def test_a_retained_tensor_modified_in_place_is_still_refused_after_its_record_is_demoted() -> None:
    trainer = make_trainer("lora", dropout=0.1, memory_limit_bytes=DEVICE_LIMIT, host_memory_limit_bytes=HOST_LIMIT)
    stash: list[torch.Tensor] = []
    hook = trainer.model.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, i, o: stash.append(o))
    first = _forward(trainer, 0)
    hook.remove()
    with torch.no_grad():
        stash[0].mul_(3.0)  # SwiGLU saved this for backward
    later = [_forward(trainer, seed) for seed in range(1, 5)]
    assert first[0].placement == "retain" and trainer.records.get(first[0].record_id).placement == "offload"
    with pytest.raises(rt.GradientCommitError, match="modified in place"):
        trainer.backward(-sum(o.target_logprobs.sum() for o in first))
    assert all(p.grad is None for p in trainer.checkpoint("policy").parameters())
    del later


def test_records_of_one_version_share_one_weight_snapshot_in_the_prediction() -> None:
    """A second pending record of the same version adds its own bytes, not another weight snapshot."""
    trainer = make_trainer("full", dropout=0.0)
    snapshot = sum(p.numel() * p.element_size() for p in trainer.checkpoint("policy").parameters())
    retain = rt.ForwardOptions(backward_state="retain", corrections=())
    item = rt.ForwardInput(*sequence(1, length=3))  # short: its saved bytes are well below the snapshot
    outs = [trainer.forward(item, options=retain) for _ in range(3)]  # the first one measures the saved bytes
    same_version = outs[2].decision.predicted_bytes - outs[1].decision.predicted_bytes
    assert 0 < same_version < snapshot, (same_version, snapshot)
    trainer.backward(outs[0].target_logprobs.sum())
    trainer.optim_step()  # a new version: its snapshot is counted again
    new_version = trainer.forward(item, options=retain).decision.predicted_bytes - outs[2].decision.predicted_bytes
    assert new_version >= snapshot, (new_version, snapshot)
    del outs


def _offloaded_then_quantized(limit: int | None, placement: str) -> tuple[list, rt.Trainer, list[rt.ForwardOutput]]:
    """A pending offloaded record, then the model marked quantized, then a forward under ``placement``."""
    trainer = make_trainer("lora", dropout=0.1, memory_limit_bytes=limit)
    pending = _forward(trainer, 0, backward_state="offload")
    rt.mark_quantized_saved_state(trainer.model.model.layers[0].mlp)
    return pending, trainer, _forward(trainer, 1, backward_state=placement, allow_replay=False)


def test_auto_never_offloads_quantized_saved_state() -> None:
    """Offload would fit where retain does not, but quantized state cannot be restored: refused at admission."""
    _, _, offload = _offloaded_then_quantized(None, "offload")
    _, _, retain = _offloaded_then_quantized(None, "retain")
    low, high = offload[0].decision.predicted_bytes, retain[0].decision.predicted_bytes
    assert low < high, (low, high)
    with pytest.raises(rt.MemoryAdmissionError):
        _offloaded_then_quantized((low + high) // 2, "auto")


class _DeviceStopwatch:
    """A CUDA-like stopwatch: its seconds are unknown until the (simulated) device has finished."""

    finished = False

    def stop(self) -> _DeviceStopwatch:
        return self

    def seconds(self) -> float | None:
        return 10.0 if _DeviceStopwatch.finished else None


def _replay_ms(trainer: rt.Trainer, seed: int) -> float:
    """The replay time the planner prices for a forward that must leave a pending one in place."""
    pending, out = _forward(trainer, seed), _forward(trainer, seed + 1)
    trainer.backward(sum(o.target_logprobs.sum() for o in pending + out))
    match = re.search(r"replay ([\d.]+) ms", out[0].decision.reason)
    assert match, out[0].decision.reason
    return float(match.group(1))


def test_the_planner_learns_forward_time_from_the_device_clock_once_the_device_finished() -> None:
    """On CUDA a forward returns before its kernels ran: its time is read later, from events, never guessed."""
    trainer = make_trainer(
        "lora", dropout=0.1, memory_limit_bytes=570_000
    )  # one retained record, not two (the LoRA state holds 49,152 B)
    _DeviceStopwatch.finished = False
    with substitute_stopwatch(lambda device: _DeviceStopwatch()):
        unknown = _replay_ms(trainer, 0)
        _DeviceStopwatch.finished = True
        known = _replay_ms(trainer, 2)
    tokens = 2 * 16  # _forward's batch: two sequences of 16 tokens, 10 s each forward
    assert unknown == pytest.approx(2e-5 * tokens * 1e3)  # the default speed: nothing measured yet
    assert known == pytest.approx(10.0 * 1e3, rel=1e-3)


def _predicted(trainer: rt.Trainer, length: int) -> int:
    out = trainer.forward(rt.ForwardInput(*sequence(length, length=length)), options=rt.ForwardOptions(corrections=()))
    trainer.backward(out.target_logprobs.sum())
    trainer.zero_grad()  # committed gradients are in the budget too: compare saved bytes alone
    return out.decision.predicted_bytes


def test_a_measured_scale_applies_to_its_own_shape_class_only() -> None:
    fresh = _predicted(make_trainer("lora", dropout=0.1), 40)
    trainer = make_trainer("lora", dropout=0.1)
    first_short = _predicted(trainer, 8)
    assert _predicted(trainer, 40) == fresh, "a scale measured at length 8 changed the estimate at length 40"
    assert _predicted(trainer, 8) != first_short, (
        "the measured scale did not replace the analytic estimate in its class"
    )


# --- held <= admitted: the estimate covers what a forward really saves (NOTE [Memory admission] Rule 5)


def _trainer_in_census(rank: int, *, dropout: float = 0.1, **limits) -> tuple[rt.Trainer, StorageCensus]:
    """A tiny LoRA trainer and a census of everything it allocated since it was built (checkpoint included)."""
    trainer = rt.Trainer(rt.DecoderLM(rt.ModelConfig.tiny(dropout=dropout), seed=0), **limits)
    census = StorageCensus()
    trainer.add_checkpoint("policy", lora=rt.LoRAConfig(rank=rank), seed=1)
    trainer.model.model.layers[-1].register_forward_hook(census.sample_hook())  # the in-flight peak
    return trainer, census


def _admit_until_refused(trainer: rt.Trainer, census: StorageCensus, seeds: range, **options) -> list:
    """Forwards (kept pending) until one is refused; after each admitted one, what is held fits the limits."""
    outs = []
    for seed in seeds:
        try:
            outs.append(_forward(trainer, seed, **options))
        except rt.MemoryAdmissionError:
            break
        held = census.measure()
        assert trainer.memory_limit_bytes is None or census.peak_device <= trainer.memory_limit_bytes, (
            f"forward {len(outs)} admitted, then the device held {census.peak_device} B "
            f"against a limit of {trainer.memory_limit_bytes} B"
        )
        limit = trainer.host_memory_limit_bytes
        assert limit is None or held.host <= limit, (
            f"forward {len(outs)} admitted, then the host held {held.host} B against {limit} B"
        )
    return outs


def _assert_saved_within_admitted(outs: list) -> None:
    """Per record: the saved bytes it holds (device for retain, host for offload) <= the saved bytes admitted."""
    for out in outs:
        held, admitted = out[0].usage.saved_bytes, out[0].decision.saved_bytes
        assert held <= admitted, f"{out[0].placement} record {out[0].record_id}: holds {held} B, admitted {admitted} B"


def test_a_scale_learned_in_eval_mode_never_admits_a_train_forward_over_the_host_limit() -> None:
    """Eval mode saves no dropout masks or attention probabilities: its scale must not price train mode."""
    trainer, census = _trainer_in_census(4, host_memory_limit_bytes=340_000)
    trainer.model.eval()
    outs = _admit_until_refused(trainer, census, range(1), backward_state="offload")  # learns this class in eval mode
    assert outs, "non-vacuous: the eval-mode forward is admitted"
    trainer.model.train()
    outs += _admit_until_refused(trainer, census, range(1, 6), backward_state="offload")
    _assert_saved_within_admitted(outs)


@pytest.mark.parametrize("placement", ["retain", "offload"])
def test_a_first_bf16_train_forward_with_dropout_is_priced_with_its_fp32_masks(placement: str) -> None:
    """No measured scale yet: the analytic estimate alone must cover the FP32 keep-masks of a BF16 model."""
    model = rt.DecoderLM(rt.ModelConfig.tiny(dropout=0.1, dtype=torch.bfloat16), seed=0)
    trainer = trainer_with_policy(model)
    tokens = torch.randint(0, model.config.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
    options = rt.ForwardOptions(backward_state=placement, corrections=())
    outs = trainer.forward([rt.ForwardInput(row[:-1], row[1:]) for row in tokens], options=options)
    _assert_saved_within_admitted([outs])


@pytest.mark.parametrize("seq_len", [16, 128])
def test_a_first_train_forward_with_dropout_is_priced_with_its_three_attention_squares(seq_len: int) -> None:
    """Math attention with dropout saves probabilities, mask and dropped probabilities: 3·H·B·T², dominant when long."""
    trainer = trainer_with_policy(rt.ModelConfig.tiny(dropout=0.1))
    tokens = torch.randint(
        0, trainer.model.config.vocab_size, (3, seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    options = rt.ForwardOptions(backward_state="offload", corrections=())
    _assert_saved_within_admitted(
        [trainer.forward([rt.ForwardInput(row[:-1], row[1:]) for row in tokens], options=options)]
    )


def test_a_scale_learned_on_a_shorter_forward_with_dropout_covers_a_longer_one_of_its_class() -> None:
    """17 and 32 tokens share a shape class: the scale learned at 17 must price 32, whose T² share is larger."""
    trainer = trainer_with_policy(rt.ModelConfig.tiny(dropout=0.1))
    options = rt.ForwardOptions(backward_state="offload", corrections=())
    outs = []
    for seed, length in enumerate((17, 32)):
        tokens = torch.randint(
            0, trainer.model.config.vocab_size, (3, length + 1), generator=torch.Generator().manual_seed(seed)
        )
        outs.append(trainer.forward([rt.ForwardInput(row[:-1], row[1:]) for row in tokens], options=options))
    _assert_saved_within_admitted(outs)


@pytest.mark.parametrize("placement", ["retain", "offload"])
def test_every_forward_holds_at_most_the_saved_bytes_admitted_in_eval_then_train(placement: str) -> None:
    """Both budgets: a retained record's saved bytes are on the device, an offloaded one's on the host."""
    trainer, census = _trainer_in_census(4)
    trainer.model.eval()
    outs = _admit_until_refused(trainer, census, range(2), backward_state=placement)
    trainer.model.train()
    outs += _admit_until_refused(trainer, census, range(2, 5), backward_state=placement)
    _assert_saved_within_admitted(outs)


@pytest.mark.parametrize("host_limit", [500_000, 800_000])
def test_a_first_lora_forward_is_priced_with_its_rank_on_the_host(host_limit: int) -> None:
    """Rank 256 on tiny: the adapters' ``x A^T`` intermediates are about half of what a forward saves."""
    trainer, census = _trainer_in_census(256, dropout=0.0, host_memory_limit_bytes=host_limit)
    outs = _admit_until_refused(trainer, census, range(4), backward_state="offload")
    assert outs or host_limit < 800_000, "non-vacuous: the larger limit admits a forward"
    _assert_saved_within_admitted(outs)


@pytest.mark.parametrize("placement", ["retain", "offload"])
def test_a_first_lora_forward_holds_at_most_the_saved_bytes_admitted(placement: str) -> None:
    trainer, census = _trainer_in_census(256, dropout=0.0)
    _assert_saved_within_admitted(_admit_until_refused(trainer, census, range(2), backward_state=placement))


# --- the budget covers the checkpoints' own state (NOTE [Memory admission] Rule 1) -------------


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _prediction_with(dtype: torch.dtype, other: str) -> int:
    """The predicted peak of one LoRA forward beside a full checkpoint ``other`` ("none", "fresh", "stepped", "grads")."""
    trainer = trainer_with_policy(rt.ModelConfig.tiny(dtype=dtype), lora=rt.LoRAConfig(rank=4))
    if other != "none":
        trainer.add_checkpoint("other", full=True)
    if other in ("stepped", "grads"):
        out = trainer.forward(rt.ForwardInput(*sequence(7, length=3)), checkpoint="other", options=NO_CORRECTION)
        trainer.backward(out.target_logprobs.sum())
        trainer.optim_step(checkpoints=["other"])
        trainer.zero_grad()
    if other == "grads":
        out = trainer.forward(rt.ForwardInput(*sequence(8, length=3)), checkpoint="other", options=NO_CORRECTION)
        trainer.backward(out.target_logprobs.sum())
    return trainer.forward(
        rt.ForwardInput(*sequence(1)), checkpoint="policy", options=NO_CORRECTION
    ).decision.predicted_bytes


def _held_by_oracle(dtype: torch.dtype, with_grads: bool) -> int:
    """What a stepped full checkpoint holds, counted from torch's own AdamW state (an independent run)."""
    trainer = rt.Trainer(rt.DecoderLM(rt.ModelConfig.tiny(dtype=dtype), seed=0))
    other = trainer.add_checkpoint("other", full=True)
    out = trainer.forward(rt.ForwardInput(*sequence(7, length=3)), options=NO_CORRECTION)
    trainer.backward(out.target_logprobs.sum())
    trainer.optim_step()
    state = other.state_dict()
    moments = _nbytes(t for slots in state["optimizer"]["state"].values() for k, t in slots.items() if k != "step")
    masters = _nbytes(state.get("master_parameters", {}).values())
    grads = _nbytes(p.grad for p in other.parameters()) if with_grads else 0
    # Masters count twice: each has an FP32 gradient buffer of its own shape and dtype.
    return _nbytes(other.parameters()) + moments + 2 * masters + grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plan_counts_every_checkpoints_parameters_optimizer_state_masters_and_grads(dtype: torch.dtype) -> None:
    alone = _prediction_with(dtype, "none")
    stepped = _held_by_oracle(dtype, with_grads=False)
    assert _prediction_with(dtype, "stepped") - alone == stepped
    assert _prediction_with(dtype, "fresh") - alone == stepped, (
        "the first step's state is reserved before it is allocated"
    )
    assert _prediction_with(dtype, "grads") - alone == _held_by_oracle(dtype, with_grads=True)


def test_a_default_limit_counts_what_others_use_and_refuses_what_the_checkpoints_would_overflow() -> None:
    total, others = 3_000_000, 400_000
    with substitute_device_capacity(total, in_use=others):
        trainer = rt.Trainer(rt.DecoderLM(rt.ModelConfig.tiny(), seed=0))
    assert trainer.memory_limit_bytes == int(total * (1 - DEVICE_MARGIN_FRACTION)) - others
    names = [f"c{k}" for k in range(8)]
    for name in names:
        trainer.add_checkpoint(name, full=True)
    held = sum(_held_by_oracle(torch.float32, with_grads=False) for _ in names)  # each: parameters + AdamW moments
    assert held < trainer.memory_limit_bytes, "non-vacuous: the checkpoints alone fit"
    with pytest.raises(rt.MemoryAdmissionError) as info:  # but not with a forward beside them
        trainer.forward(rt.ForwardInput(*sequence(1)), checkpoint="c0", options=NO_CORRECTION)
    assert info.value.predicted_peak_bytes > held and info.value.limit_bytes == trainer.memory_limit_bytes
    assert trainer.live_records() == 0


# --- a refused call changes nothing (NOTE [Memory admission] Rule 4) -------------------------


def _state(trainer: rt.Trainer) -> dict:
    checkpoint = trainer.checkpoint("policy")
    return {
        "params": {n: p.detach().clone() for n, p in checkpoint.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in checkpoint.named_parameters()},
        "records": [(r.id, r.placement, r.ledger.placement if r.ledger else None) for r in trainer.records],
        "rng": torch.get_rng_state(),
        "revision": (checkpoint.revision, checkpoint.generation),
    }


def _assert_same_state(before: dict, after: dict) -> None:
    for key in ("params", "grads"):
        for name, value in before[key].items():
            other = after[key][name]
            assert (value is None) == (other is None) and (value is None or torch.equal(value, other)), f"{key} {name}"
    assert before["records"] == after["records"], "records or their placements changed"
    assert torch.equal(before["rng"], after["rng"]), "the global RNG advanced"
    assert before["revision"] == after["revision"]


def test_a_call_refused_in_its_second_group_ran_nothing_demoted_nothing_and_drew_nothing() -> None:
    trainer = make_trainer("lora", dropout=0.1, memory_limit_bytes=1_050_000)
    committed = _forward(trainer, 0)
    trainer.backward(-committed[0].target_logprobs.sum())  # committed .grad to protect
    pending = [_forward(trainer, seed) for seed in (1, 2, 3)]
    assert [r.placement for r in trainer.records] == ["retain"] * 3, "retained records the first group must demote"
    before = _state(trainer)
    # The first group (replay off) fits only by demoting a pending record; the second, a forced retain, not at all.
    no_replay = rt.ForwardOptions(allow_replay=False, corrections=())
    first = [rt.ForwardInput(*sequence(40 + k, length=16), options=no_replay) for k in range(2)]
    retain = rt.ForwardOptions(backward_state="retain", corrections=())
    forced = [rt.ForwardInput(*sequence(50 + k, length=16), options=retain) for k in range(8)]
    with pytest.raises(rt.MemoryAdmissionError):
        trainer.forward([*first, *forced], options=NO_CORRECTION)
    _assert_same_state(before, _state(trainer))
    out = trainer.forward(first, options=NO_CORRECTION)  # non-vacuous: alone, the first group demotes the record
    assert "demoted 1" in out[0].decision.reason and next(r.placement for r in trainer.records) == "offload"
    del pending


def test_each_group_of_a_call_is_planned_beside_the_groups_before_it() -> None:
    """Two groups that each fit alone but not together are refused together, before either runs."""
    host_limit = 400_000
    trainer = make_trainer("lora", dropout=0.1, host_memory_limit_bytes=host_limit)
    offload = rt.ForwardOptions(backward_state="offload")
    one = [rt.ForwardInput(*sequence(k, length=16), options=offload) for k in range(2)]
    alone = trainer.forward(one, options=NO_CORRECTION)
    assert alone[0].usage.host_bytes > host_limit / 2, "two such groups cannot share the host budget"
    del alone
    offload_too = rt.ForwardOptions(backward_state="offload", max_gradient_staleness=2)  # another group, same size
    other = [rt.ForwardInput(*sequence(10 + k, length=16), options=offload_too) for k in range(2)]
    before = _state(trainer)
    with pytest.raises(rt.MemoryAdmissionError):
        trainer.forward(one + other, options=NO_CORRECTION)
    _assert_same_state(before, _state(trainer))


# --- the measured scale is the class maximum (NOTE [Memory admission] Rule 5) -----------------


def test_a_smaller_scale_measured_later_does_not_lower_its_class_estimate() -> None:
    """Lengths 64 and 33 share a shape class; in BF16 with dropout the short one's ratio to the analytic
    estimate is lower by more than the estimate's 5% margin (its FP32-priced per-token terms weigh more)."""
    trainer = trainer_with_policy(rt.ModelConfig.tiny(dropout=0.1, dtype=torch.bfloat16), lora=rt.LoRAConfig(rank=4))
    outs = [_forward_length(trainer, 0, 64), _forward_length(trainer, 1, 33)]
    lora, config = rt.LoRAConfig(rank=4), trainer.model.config
    large, small = (
        o[0].usage.saved_bytes / analytic_saved_bytes(config, 2, n, lora=lora, dropout_active=True)
        for o, n in zip(outs, (64, 33))
    )
    assert small < large / 1.05, "non-vacuous: the second scale is lower than the first by more than the margin"
    outs.append(_forward_length(trainer, 2, 64))
    _assert_saved_within_admitted(outs)


def _forward_length(trainer: rt.Trainer, seed: int, length: int) -> list[rt.ForwardOutput]:
    inputs = [rt.ForwardInput(*sequence(seed * 10 + k, length=length)) for k in range(2)]
    return trainer.forward(inputs, options=NO_CORRECTION)


def _two_pending(trainer: rt.Trainer, first: str, second: str) -> list[list[rt.ForwardOutput]]:
    """Two forwards of one shape class (dropout on: replay must restore the masks), the second pending the first."""
    return [_forward(trainer, seed, backward_state=placement) for seed, placement in ((1, first), (2, second))]


def test_where_only_replaying_both_pending_forwards_fits_auto_demotes_the_first_to_replay() -> None:
    """Host 0 (no offload); device one byte under "first retained, second replayed": only replay-both fits."""
    probe = make_trainer("lora", dropout=0.1)  # the same trainer unlimited: the plan's own prediction of that pair
    limit = _two_pending(probe, "retain", "replay")[1][0].decision.predicted_bytes - 1
    trainer = make_trainer("lora", dropout=0.1, memory_limit_bytes=limit, host_memory_limit_bytes=0)
    census = StorageCensus()
    trainer.model.model.layers[-1].register_forward_hook(census.sample_hook())  # forwards and replays
    outs = _two_pending(trainer, "auto", "auto")
    assert [o[0].placement for o in outs] == ["retain", "replay"], [o[0].decision.reason for o in outs]
    assert "demoted 1" in outs[1][0].decision.reason and outs[1][0].decision.predicted_bytes <= limit
    held = census.measure(ignore=[o.target_logprobs for out in outs for o in out]).device
    assert held < outs[0][0].usage.saved_bytes / 2, (held, "the demoted record's saved tensors are still held")
    assert _placements_at_backward_with_plain_gradients(trainer, outs) == ["replay", "replay"]
    assert 0 < census.peak_device <= limit, (census.peak_device, limit)
    assert census.peak_host < outs[0][0].decision.saved_bytes / 4, "saved state went to the host (RNG states only)"


def _placements_at_backward_with_plain_gradients(trainer: rt.Trainer, outs: list[list[rt.ForwardOutput]]) -> list[str]:
    """Backpropagate both pending forwards; their gradients must be bitwise plain autograd's (both retained, unlimited)."""
    reports = [trainer.backward(-sum((o.target_logprobs * k).sum() for o in out)) for k, out in enumerate(outs, 1)]
    reference = make_trainer("lora", dropout=0.1)  # PyTorch's own autograd on both graphs, unlimited
    for k, out in enumerate(_two_pending(reference, "retain", "retain"), 1):
        reference.backward(-sum((o.target_logprobs * k).sum() for o in out))
    grads = {n: p.grad for n, p in reference.checkpoint("policy").named_parameters()}
    assert any(g.abs().max() > 0 for g in grads.values())
    for name, param in trainer.checkpoint("policy").named_parameters():
        assert torch.equal(param.grad, grads[name]), name
    return [r.records[0].placement for r in reports]


def test_a_new_forward_that_can_only_offload_gets_the_host_by_replaying_the_demoted_record() -> None:
    """Host room for one record; the new forward may not replay: the pending one is demoted to replay, not the host."""
    probe = make_trainer("lora", dropout=0.1)
    second = _two_pending(probe, "retain", "offload")[1][0].decision
    trainer = make_trainer(
        "lora", dropout=0.1, memory_limit_bytes=second.predicted_bytes - 1, host_memory_limit_bytes=second.saved_bytes
    )
    outs = [_forward(trainer, 1), _forward(trainer, 2, allow_replay=False)]
    assert [o[0].placement for o in outs] == ["retain", "offload"], [o[0].decision.reason for o in outs]
    assert "1 to replay" in outs[1][0].decision.reason
    assert _placements_at_backward_with_plain_gradients(trainer, outs) == ["replay", "offload"]


def test_a_call_that_fits_only_by_demoting_to_replay_but_is_refused_later_demotes_nothing() -> None:
    probe = make_trainer("lora", dropout=0.1)
    limit = _two_pending(probe, "retain", "replay")[1][0].decision.predicted_bytes - 1
    trainer = make_trainer("lora", dropout=0.1, memory_limit_bytes=limit, host_memory_limit_bytes=0)
    first = _forward(trainer, 1)
    fits = [rt.ForwardInput(*sequence(20 + k, length=16)) for k in range(2)]
    forced = [
        rt.ForwardInput(*sequence(30 + k, length=16), options=rt.ForwardOptions(backward_state="retain"))
        for k in range(2)
    ]
    with pytest.raises(rt.MemoryAdmissionError):
        trainer.forward([*fits, *forced], options=NO_CORRECTION)
    assert [r.placement for r in trainer.records] == ["retain"], "a refused call demoted a pending record"
    assert trainer.records.get(first[0].record_id).root is not None, "a refused call dropped a pending graph"
    second = trainer.forward(fits, options=NO_CORRECTION)  # non-vacuous: alone, the first group demotes the record
    assert [r.placement for r in trainer.records] == ["replay", "replay"], second[0].decision.reason


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_loaded_trainer_predicts_the_bytes_the_uninterrupted_one_does(tmp_path, kind):
    """A kept version's weights count once (in ``held_nbytes``, NOTE [Weight captures] Rule 4): a forward made again
    at it takes no copy-on-write snapshot, and the next forward is priced as in the job that never stopped."""

    def model() -> rt.DecoderLM:
        return rt.DecoderLM(rt.ModelConfig.tiny(dropout=0.0, num_hidden_layers=1), seed=0)

    torch.manual_seed(0)
    trainer = rt.Trainer(model(), options=rt.ForwardOptions(corrections=()))
    trainer.add_checkpoint("p", full=kind == "full", lora=rt.LoRAConfig(rank=2) if kind == "lora" else None, seed=1)
    stale = trainer.forward(rt.ForwardInput(*sequence(1)))
    fresh = trainer.forward(rt.ForwardInput(*sequence(2)))
    trainer.backward(-fresh.target_logprobs.sum())
    trainer.optim_step()
    trainer.zero_grad()
    trainer.save(tmp_path)
    expected = trainer.forward(rt.ForwardInput(*sequence(3))).decision.predicted_bytes
    loaded = rt.Trainer.load(tmp_path, model())
    remade = loaded.forward(rt.ForwardInput(*sequence(1)), checkpoint=stale.version)
    assert remade.decision.predicted_bytes == stale.decision.predicted_bytes, "made again: no snapshot of its own"
    assert loaded.forward(rt.ForwardInput(*sequence(3))).decision.predicted_bytes == expected
