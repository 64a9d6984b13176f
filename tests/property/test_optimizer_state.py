"""``load_checkpoint`` checks the optimizer state like the parameters: one that cannot step is refused.

See docs/semantics.md#refusals-change-nothing.

A corrupted AdamW state (a slot or hyperparameter missing, a value of the
wrong type, out of range or non-finite) is a ``ConfigError`` naming the
place, and the checkpoint is left exactly as it was; a state that round-trips
through ``state_dict()`` loads and steps bitwise like the trainer it came from.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference_trainer as rt
from tests.support import NO_CORRECTION, advantages, sequence
from validation.trainers import trainer_with_policy

DELETE = object()  # the corruption removes the key

# (where, key, bad value): "group" is param_groups[0]; "slot" is state[<param id>].
CORRUPTIONS: list[tuple[str, str, Any]] = [
    *[("group", key, DELETE) for key in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")],
    *[("group", "lr", bad) for bad in ("fast", -1.0, float("nan"), float("inf"), None, True)],
    *[("group", "eps", bad) for bad in (float("nan"), -1e-8, "tiny")],
    *[("group", "weight_decay", bad) for bad in (-0.1, float("inf"))],
    *[("group", "betas", bad) for bad in (None, (0.9,), (1.0, 0.9), (0.9, "a"), "ab", 0.9)],
    ("group", "amsgrad", True),  # would need a max_exp_avg_sq slot nothing saved
    ("group", "maximize", True),  # another algorithm than this checkpoint's AdamW
    ("group", "params", "duplicate"),
    *[("slot", key, DELETE) for key in ("exp_avg", "exp_avg_sq", "step")],
    *[("slot", "step", bad) for bad in ("one", torch.tensor(float("nan")), torch.tensor(-1.0), torch.ones(2), 3)],
    *[("slot", "exp_avg", bad) for bad in ("zeros", "nan", "int", "shape")],
    *[("slot", "exp_avg_sq", bad) for bad in ("negative", "inf")],
    ("slot", "surplus", torch.zeros(())),  # a slot AdamW does not have
]


def _trainer(optimizer: rt.AdamWConfig | None = None) -> rt.Trainer:
    trainer = trainer_with_policy(
        rt.ModelConfig.tiny(dropout=0.0), lora=rt.LoRAConfig(rank=2), optimizer=optimizer or rt.AdamWConfig(lr=1e-2)
    )
    return trainer


def _step(trainer: rt.Trainer, seed: int) -> None:
    ids, tgt = sequence(seed)
    out = trainer.forward(rt.ForwardInput(ids, tgt), options=NO_CORRECTION)
    trainer.backward(-(out.target_logprobs * advantages(seed)).sum())
    trainer.optim_step()
    trainer.zero_grad()


def _bad_tensor(kind: str, like: torch.Tensor) -> Any:
    return {
        "zeros": like.tolist(),  # not a tensor
        "nan": torch.full_like(like, float("nan")),
        "int": torch.zeros(like.shape, dtype=torch.int64),
        "shape": torch.zeros(like.numel() + 1),
        "negative": -torch.ones_like(like),
        "inf": torch.full_like(like, float("inf")),
    }[kind]


def _corrupt(state: dict, where: str, key: str, bad: Any, param_id: int) -> dict:
    state = copy.deepcopy(state)
    optimizer = state["optimizer"]
    target = optimizer["param_groups"][0] if where == "group" else optimizer["state"][param_id]
    if bad is DELETE:
        del target[key]
    elif key == "params":
        target["params"] = [target["params"][0]] * len(target["params"])
    elif isinstance(bad, str) and key in ("exp_avg", "exp_avg_sq"):
        target[key] = _bad_tensor(bad, target[key])
    else:
        target[key] = bad
    return state


def _fingerprint(trainer: rt.Trainer) -> tuple:
    """Everything a load touches: parameters, optimizer state, version."""
    checkpoint = trainer.checkpoint("policy")
    state = checkpoint.state_dict()
    flat = [state["parameters"][n] for n in sorted(state["parameters"])]
    slots = [
        state["optimizer"]["state"][i][k]
        for i in sorted(state["optimizer"]["state"])
        for k in sorted(state["optimizer"]["state"][i])
    ]
    group = {k: v for k, v in state["optimizer"]["param_groups"][0].items()}
    return [t.clone() for t in flat], [t.clone() for t in slots], group, checkpoint.version


def _assert_same(before: tuple, after: tuple) -> None:
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0], strict=True)), "a parameter changed"
    assert all(torch.equal(a, b) for a, b in zip(before[1], after[1], strict=True)), "an optimizer slot changed"
    assert before[2:] == after[2:], "hyperparameters or version changed"


@functools.cache
def _stepped() -> tuple[rt.Trainer, dict]:
    """One trainer for every refusal (a refused load changes nothing, which each test checks), and a
    state saved after a step, so every slot exists."""
    trainer = _trainer()
    _step(trainer, 0)
    saved = trainer.checkpoint("policy").state_dict()
    _step(trainer, 1)
    return trainer, saved


def _assert_refused(bad: dict) -> None:
    trainer, _ = _stepped()
    before = _fingerprint(trainer)
    try:
        trainer.load_checkpoint("policy", bad)
    except rt.ConfigError as error:
        assert error.field.startswith("state_dict['optimizer']"), error.field
        assert "expected" in str(error) and "found" in str(error)
    else:
        raise AssertionError("a corrupted optimizer state loaded")
    _assert_same(before, _fingerprint(trainer))


@pytest.mark.parametrize(
    "corruption", CORRUPTIONS, ids=lambda c: f"{c[0]}-{c[1]}-{'missing' if c[2] is DELETE else c[2]!r}"
)
def test_each_catalogued_corruption_is_refused_and_changes_nothing(corruption: tuple) -> None:
    _assert_refused(_corrupt(_stepped()[1], *corruption, 3))


NOT_A_RATE = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).filter(lambda x: not 0.0 <= x < float("inf")),
    st.text(max_size=3),
    st.none(),
    st.booleans(),
    st.lists(st.floats(0, 1), max_size=2),
)
NOT_BETAS = st.one_of(
    st.tuples(st.floats(allow_nan=True), st.floats(allow_nan=True)).filter(
        lambda b: not all(0.0 <= x < 1.0 for x in b)
    ),
    st.lists(st.floats(0.0, 0.9), max_size=3).filter(lambda b: len(b) != 2),
    st.none(),
    st.text(max_size=2),
    st.floats(0.0, 0.9),
)


@given(
    corruption=st.one_of(
        st.tuples(st.just("group"), st.sampled_from(["lr", "eps", "weight_decay"]), NOT_A_RATE),
        st.tuples(st.just("group"), st.just("betas"), NOT_BETAS),
        st.tuples(st.just("slot"), st.sampled_from(["exp_avg", "exp_avg_sq", "step"]), st.just(DELETE)),
        st.tuples(
            st.just("slot"), st.sampled_from(["exp_avg", "exp_avg_sq"]), st.sampled_from(["nan", "int", "shape", "inf"])
        ),
    ),
    param_id=st.integers(0, 27),
)
def test_generated_corruptions_are_refused_and_change_nothing(corruption: tuple, param_id: int) -> None:
    saved = _stepped()[1]
    _assert_refused(_corrupt(saved, *corruption, param_id % len(saved["optimizer"]["state"])))


@given(
    lr=st.floats(0.0, 0.1),
    beta1=st.floats(0.0, 0.99),
    beta2=st.floats(0.0, 0.9999),
    eps=st.floats(1e-12, 1e-3),
    weight_decay=st.floats(0.0, 0.5),
)
def test_a_round_tripped_state_loads_and_steps_like_its_source(
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float
) -> None:
    optimizer = rt.AdamWConfig(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
    source = _trainer(optimizer)
    _step(source, 0)
    saved = source.checkpoint("policy").state_dict()
    target = _trainer()  # other hyperparameters: the load brings the source's
    target.load_checkpoint("policy", saved)
    _step(source, 1)
    _step(target, 1)
    expected, found = _fingerprint(source), _fingerprint(target)
    for part in (0, 1):  # parameters, then optimizer slots: bitwise
        assert all(torch.equal(a, b) for a, b in zip(expected[part], found[part], strict=True))
    assert expected[2] == found[2], "the hyperparameters did not load"
    assert source.checkpoint("policy").revision == target.checkpoint("policy").revision == 2
