"""Logical-rank logic that needs no second process: layout, spreading, reduction order, rounds, errors.

Everything here runs with W = 1 (no process group): one process hosts every
logical rank, each on its own fiber.
"""

from __future__ import annotations

import functools
import operator

import dist_scenarios as ds
import pytest
import torch

import reference_trainer as rt
from reference_trainer.ranks import (
    LogicalLayout,
    PeerError,
    PeerFailure,
    logical_gradients,
    ordered_sum,
    run_logical,
    spread,
)
from reference_trainer.testing import inject_fault


# --- layout and order ------------------------------------------------------------------


@pytest.mark.parametrize(("logical_dp", "world_size"), [(3, 2), (2, 4), (6, 4)])
def test_logical_dp_must_be_a_multiple_of_the_world_size(logical_dp: int, world_size: int) -> None:
    with pytest.raises(rt.ConfigError, match="multiple of the number of processes") as info:
        LogicalLayout(logical_dp, world_size)
    assert info.value.field == "logical_dp" and info.value.value == logical_dp


@pytest.mark.parametrize("bad", [0, -2, True, 2.0])
def test_layout_rejects_non_positive_or_non_int_sizes(bad: object) -> None:
    with pytest.raises(rt.ConfigError):
        LogicalLayout(bad)  # type: ignore[arg-type]


def test_each_process_hosts_consecutive_logical_ranks() -> None:
    layouts = [LogicalLayout(8, 4, rank) for rank in range(4)]
    assert [list(layout.hosted) for layout in layouts] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [layouts[0].owner(rank) for rank in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert list(LogicalLayout(4).hosted) == [0, 1, 2, 3]  # one process hosts them all


@pytest.mark.parametrize(("count", "sizes"), [(13, [2, 2, 2, 2, 2, 1, 1, 1]), (3, [1, 1, 1, 0, 0, 0, 0, 0]), (16, [2] * 8)])
def test_spread_gives_contiguous_chunks_in_source_order(count: int, sizes: list[int]) -> None:
    chunks = spread(count, 8)
    assert [len(c) for c in chunks] == sizes
    assert [i for c in chunks for i in c] == list(range(count))


def test_ordered_sum_associates_left_to_right() -> None:
    # In FP32, 1e8 + 1 == 1e8: the association order decides the result.
    parts = [torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8]), torch.tensor([1.0])]
    assert ordered_sum(parts).item() == functools.reduce(operator.add, parts).item() == 1.0
    assert (parts[0] + (parts[1] + (parts[2] + parts[3]))).item() != 1.0  # another order, another result


def test_reduce_sums_over_logical_ranks_in_logical_order() -> None:
    values = [1e8, 1.0, -1e8, 1.0]

    def body(view: object) -> tuple[float, int]:
        total = view.reduce(torch.tensor([values[view.logical_rank]]))
        count = view.global_token_count(torch.ones(view.logical_rank + 1, dtype=torch.bool))
        return total.item(), count

    assert run_logical(body, ds.make_trainer(), logical_dp=4) == [(1.0, 10)] * 4


def test_each_logical_rank_draws_from_its_own_rng_stream_and_the_caller_keeps_its_own() -> None:
    trainer = ds.make_trainer()
    torch.manual_seed(123)
    caller = torch.get_rng_state()
    first = run_logical(lambda view: torch.rand(2), trainer, logical_dp=2)
    assert torch.equal(torch.get_rng_state(), caller), "run_logical moved the caller's RNG"
    assert not torch.equal(first[0], first[1])
    second = run_logical(lambda view: torch.rand(2), trainer, logical_dp=2)
    assert not torch.equal(first[0], second[0]), "a logical rank's stream restarted instead of continuing"


# --- arguments and misuse ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"mode": "tensor"}, "mode"), ({"logical_dp": 0}, "logical_dp"), ({"timeout_s": 0}, "timeout_s")],
)
def test_run_logical_rejects_bad_arguments(kwargs: dict, field: str) -> None:
    arguments = {"logical_dp": 2} | kwargs
    with pytest.raises(rt.ConfigError) as info:
        run_logical(lambda view: None, ds.make_trainer(), **arguments)
    assert info.value.field == field


def test_optim_step_inside_fn_is_refused() -> None:
    trainer = ds.make_trainer()
    run_logical(lambda view: None, trainer, logical_dp=2)  # installs the logical hooks
    with pytest.raises(rt.ConfigError, match="after run_logical returns"):
        run_logical(lambda view: trainer.optim_step(), trainer, logical_dp=2)


def test_changing_logical_dp_with_pending_logical_gradients_is_refused() -> None:
    trainer = ds.make_trainer()

    def body(view: object) -> None:
        items, advantages = ds.micro_batch(0, view.logical_rank)
        view.backward(ds.rank_loss(view.forward(items), advantages, 10))

    run_logical(body, trainer, logical_dp=2)
    with pytest.raises(rt.ConfigError, match="pending logical gradients"):
        run_logical(lambda view: None, trainer, logical_dp=4)
    trainer.zero_grad()
    run_logical(lambda view: None, trainer, logical_dp=4)


def test_diverging_logical_ranks_raise_peer_error_on_every_rank() -> None:
    def body(view: object) -> None:
        if view.logical_rank == 0:
            view.reduce(torch.ones(1))  # logical rank 1 returns instead

    with pytest.raises(PeerError, match="logical ranks diverged"):
        run_logical(body, ds.make_trainer(), logical_dp=2)


def test_reduce_of_different_shapes_is_refused() -> None:
    with pytest.raises(PeerError, match="one shape and dtype"):
        run_logical(lambda view: view.reduce(torch.ones(view.logical_rank + 1)), ds.make_trainer(), logical_dp=2)


def test_user_error_on_one_logical_rank_is_the_error_raised() -> None:
    def body(view: object) -> None:
        if view.logical_rank == 1:
            raise KeyError("logical rank 1 has no data")
        view.reduce(torch.ones(1))

    with pytest.raises(KeyError, match="logical rank 1 has no data"):
        run_logical(body, ds.make_trainer(), logical_dp=3)


# --- commit: all logical ranks or none -------------------------------------------------


def _buffers(trainer: rt.Trainer) -> dict:
    return logical_gradients(trainer)


def test_fault_in_one_logical_rank_commits_nothing_in_any() -> None:
    trainer = ds.make_trainer()
    state: dict = {}

    def forward(view: object) -> None:
        items, advantages = ds.micro_batch(0, view.logical_rank)
        outputs = view.forward(items)
        view.backward(ds.rank_loss(outputs, advantages, 10), retain_graph=True)
        state[view.logical_rank] = (outputs, advantages)

    run_logical(forward, trainer, logical_dp=3)
    before = _buffers(trainer)
    assert before
    with inject_fault("model_backward"), pytest.raises(rt.GradientCommitError, match="injected fault"):
        run_logical(lambda view: view.backward(ds.rank_loss(*state[view.logical_rank], 10)), trainer, logical_dp=3)
    after = _buffers(trainer)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before), "a pending logical-rank sum changed"
    assert not trainer.checkpoint(ds.POLICY).has_gradients()


# --- errors across processes -------------------------------------------------------------


def test_failure_rebuilds_the_same_type_message_and_attributes() -> None:
    original = rt.StaleGradientError("policy", 3, 2, 1, 4)  # a constructor that does not take its message
    rebuilt = PeerFailure.of(original, "logical rank 5 (physical rank 1)", 5).rebuild()
    assert type(rebuilt) is rt.StaleGradientError and str(rebuilt) == str(original)
    assert (rebuilt.checkpoint, rebuilt.staleness, rebuilt.bound, rebuilt.forward_revision, rebuilt.current_revision) == (
        "policy", 3, 2, 1, 4
    )
    assert any("logical rank 5" in note for note in getattr(rebuilt, "__notes__", ["logical rank 5"]))


# --- zero mode in one process --------------------------------------------------------------


def test_zero_mode_spreads_inputs_and_returns_outputs_in_source_order() -> None:
    trainer = ds.make_trainer()
    items = [rt.ForwardInput(torch.arange(1, n + 2)) for n in range(5)]  # 5 inputs, 8 logical ranks

    def fn(zero: object) -> list[int]:
        with pytest.raises(AttributeError, match="zero mode has no reduce"):
            zero.reduce  # noqa: B018
        outputs = zero.forward(items)
        zero.backward(-sum(o.target_logprobs.sum() for o in outputs))
        return [o.target_logprobs.numel() for o in outputs]

    assert run_logical(fn, trainer, mode="zero", logical_dp=8) == [1, 2, 3, 4, 5]
    assert logical_gradients(trainer).keys() == {(ds.POLICY, n) for n, _ in trainer.checkpoint(ds.POLICY).named_parameters()}


def test_trainer_step_inside_a_zero_mode_fn_is_refused_and_zero_step_works() -> None:
    trainer = ds.make_trainer()

    def fn(zero: object) -> str:
        items, advantages = ds.micro_batch(0, 0)
        zero.backward(ds.rank_loss(zero.forward(items), advantages, 10))
        with pytest.raises(rt.ConfigError, match="zero.optim_step"):
            trainer.optim_step()  # would step this process alone
        with pytest.raises(rt.ConfigError, match="inside run_logical's fn"):
            run_logical(lambda view: None, trainer, logical_dp=2)
        return "stepped" if zero.optim_step()[ds.POLICY].stepped else "not stepped"

    assert run_logical(fn, trainer, mode="zero", logical_dp=2) == "stepped"
    run_logical(lambda view: None, trainer, logical_dp=2)  # usable again once fn returned


def test_zero_mode_refuses_inputs_carrying_behaviour_data_rather_than_dropping_it() -> None:
    trainer = ds.make_trainer()

    def fn(zero: object) -> str:
        items, _ = ds.micro_batch(0, 0)
        tagged = [rt.ForwardInput(i.input_tokens, i.target_tokens, behaviour_revisions=torch.zeros_like(i.input_tokens))
                  for i in items]
        with pytest.raises(rt.ConfigError, match="RankZero"):
            zero.forward(tagged)
        return "refused"

    assert run_logical(fn, trainer, mode="zero", logical_dp=2) == "refused"
    assert trainer.live_records() == 0


# --- calls that would escape fn's logical rank (NOTE [Logical ranks] Rules 2 and 5) -----------------


def _forward_on_every_rank(trainer: rt.Trainer, logical_dp: int = 2) -> dict[int, tuple]:
    made: dict[int, tuple] = {}

    def body(view: object) -> None:
        items, advantages = ds.micro_batch(0, view.logical_rank)
        made[view.logical_rank] = (view.forward(items), advantages)

    run_logical(body, trainer, logical_dp=logical_dp)
    return made


def _assert_nothing_committed(trainer: rt.Trainer) -> None:
    assert not trainer.checkpoint(ds.POLICY).has_gradients(), "a refused call wrote .grad"
    assert logical_gradients(trainer) == {}, "a refused call left a logical-rank sum"


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda trainer, view, made: trainer.backward(ds.rank_loss(*made[view.logical_rank], 10)), "view.backward"),
        (lambda trainer, view, made: view.backward(ds.rank_loss(*made[1 - view.logical_rank], 10)), "logical rank"),
    ],
    ids=["plain-backward-in-fn", "another-ranks-output"],
)
def test_a_call_inside_fn_that_bypasses_the_logical_buffers_is_refused_and_commits_nothing(call, match: str) -> None:
    trainer = ds.make_trainer()
    made = _forward_on_every_rank(trainer)
    with pytest.raises(rt.ConfigError, match=match):
        run_logical(lambda view: call(trainer, view, made), trainer, logical_dp=2)
    _assert_nothing_committed(trainer)
    # Through the right views the same outputs still commit (a later run_logical call, Rule 2).
    run_logical(lambda view: view.backward(ds.rank_loss(*made[view.logical_rank], 10)), trainer, logical_dp=2)
    assert logical_gradients(trainer)


def test_a_logical_ranks_output_backpropagated_outside_fn_is_refused() -> None:
    trainer = ds.make_trainer()
    made = _forward_on_every_rank(trainer)
    with pytest.raises(rt.ConfigError, match="logical rank 0"):
        trainer.backward(ds.rank_loss(*made[0], 10))
    _assert_nothing_committed(trainer)


def test_load_checkpoint_on_one_logical_rank_is_refused_and_loads_nothing() -> None:
    trainer = ds.make_trainer()
    saved = trainer.checkpoint(ds.POLICY).state_dict()
    run_logical(lambda view: None, trainer, logical_dp=2)  # the trainer hosts logical ranks now

    def body(view: object) -> None:
        if view.logical_rank == 1:
            trainer.load_checkpoint(ds.POLICY, saved)

    with pytest.raises(rt.ConfigError, match="after run_logical returns"):
        run_logical(body, trainer, logical_dp=2)
    assert trainer.checkpoint(ds.POLICY).version == rt.CheckpointVersion(ds.POLICY, 0, 0)
    trainer.load_checkpoint(ds.POLICY, saved)  # on every process, outside fn: allowed


def test_a_plain_backward_inside_fn_is_refused_even_for_an_output_made_outside() -> None:
    """Only ``view.backward`` commits inside ``fn``: a plain backward there would write ``.grad`` on one
    logical rank's behalf, whoever made the output."""
    trainer = ds.make_trainer()
    run_logical(lambda view: None, trainer, logical_dp=2)
    items, advantages = ds.micro_batch(0, 0)
    outputs = trainer.forward(items)  # outside fn: no logical rank owns it

    def body(view: object) -> None:
        if view.logical_rank == 0:
            trainer.backward(ds.rank_loss(outputs, advantages, 10))

    with pytest.raises(rt.ConfigError, match="view.backward"):
        run_logical(body, trainer, logical_dp=2)
    _assert_nothing_committed(trainer)
    trainer.backward(ds.rank_loss(outputs, advantages, 10))  # outside fn it is a plain backward, as before
    assert trainer.checkpoint(ds.POLICY).has_gradients()


def test_a_transport_timeout_is_any_positive_number_of_seconds() -> None:
    from reference_trainer.peers import timeout_seconds

    assert timeout_seconds(0.5, "RTV_UNSET_TIMEOUT", 60) == 0.5  # sub-second limits are valid
    assert timeout_seconds(None, "RTV_UNSET_TIMEOUT", 60) == 60.0
    for bad in (0, -1, True):
        with pytest.raises(rt.ConfigError, match="timeout_s"):
            timeout_seconds(bad, "RTV_UNSET_TIMEOUT", 60)
