"""Forward options: validation, per-field precedence, capture at submission (NOTE [Option resolution]).

See docs/semantics.md#options.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

import reference_trainer as rt
from reference_trainer.options import _Unset
from tests.support import make_trainer, sequence, train_step

# The documented defaults (docs/semantics.md#options), written out so a changed default fails here.
DEFAULTS = {
    "max_gradient_staleness": 2,
    "corrections": (rt.ImportanceCorrection(),),
    "backward_state": "auto",
    "allow_offload": True,
    "allow_replay": True,
}
VALUES = {
    "max_gradient_staleness": st.integers(0, 6),
    "corrections": st.sampled_from(
        [(), (rt.ImportanceCorrection(),), (rt.ImportanceCorrection(clip_high=2.0, policy="always"),)]
    ),
    "backward_state": st.sampled_from(["auto", "retain", "offload", "replay"]),
    "allow_offload": st.booleans(),
    "allow_replay": st.booleans(),
}
LEVELS = ("input", "call", "trainer")


@st.composite
def _levels(draw: st.DrawFn) -> dict[str, dict[str, object]]:
    """For each level, the fields it sets (each field independently set or not at each level)."""
    return {level: {f: draw(VALUES[f]) for f in VALUES if draw(st.booleans())} for level in LEVELS}


@given(_levels(), st.sampled_from(LEVELS + (None,)))
def test_each_field_resolves_to_the_highest_level_that_sets_it(levels: dict, absent: str | None) -> None:
    # A level may also be missing entirely (None), which must read as "sets nothing".
    if absent is not None:
        levels[absent] = {}
    options = [None if (level == absent) else rt.ForwardOptions(**levels[level]) for level in LEVELS]
    expected = {f: next((levels[level][f] for level in LEVELS if f in levels[level]), DEFAULTS[f]) for f in DEFAULTS}
    conflict = (expected["backward_state"] == "offload" and not expected["allow_offload"]) or (
        expected["backward_state"] == "replay" and not expected["allow_replay"]
    )
    if conflict:
        with pytest.raises(rt.ConfigError) as info:
            rt.resolve_options(*options)
        assert info.value.field == "backward_state" and info.value.value == expected["backward_state"]
        return
    resolved = rt.resolve_options(*options)
    assert {f: getattr(resolved, f) for f in DEFAULTS} == expected


def test_nothing_set_anywhere_resolves_to_the_contract_defaults() -> None:
    resolved = rt.resolve_options(None, rt.ForwardOptions(), None)
    assert {f: getattr(resolved, f) for f in DEFAULTS} == DEFAULTS
    assert resolved.correction == rt.ImportanceCorrection()
    assert rt.resolve_options(rt.ForwardOptions(corrections=())).correction is None


def _bound_in_force(trainer: rt.Trainer, item: rt.ForwardInput, call: rt.ForwardOptions | None) -> int:
    """The staleness bound a forward actually got: age it past any small bound and read the error."""
    out = trainer.forward(item, options=call)
    for step in range(4):
        train_step(trainer, seed=100 + step)
    with pytest.raises(rt.StaleGradientError) as info:
        trainer.backward(out.target_logprobs.sum())
    return info.value.bound


@pytest.mark.parametrize(
    "trainer_bound,call_bound,input_bound,expected",
    [
        (None, None, None, 2),
        (0, None, None, 0),
        (0, 3, None, 3),
        (0, 3, 1, 1),
        (None, None, 0, 0),
        (3, None, 1, 1),
    ],
)
def test_end_to_end_bound_comes_from_the_highest_level(trainer_bound, call_bound, input_bound, expected) -> None:
    def opts(bound: int | None) -> rt.ForwardOptions | None:
        return None if bound is None else rt.ForwardOptions(max_gradient_staleness=bound, corrections=())

    trainer = make_trainer("lora", dropout=0.0, options=opts(trainer_bound))
    item = rt.ForwardInput(*sequence(1), options=opts(input_bound))
    assert _bound_in_force(trainer, item, opts(call_bound)) == expected


def test_per_input_bound_overrides_the_calls_within_one_forward() -> None:
    trainer = make_trainer("full", dropout=0.0)
    call = rt.ForwardOptions(max_gradient_staleness=0, corrections=())
    lenient = rt.ForwardInput(*sequence(1), options=rt.ForwardOptions(max_gradient_staleness=1))
    strict = rt.ForwardInput(*sequence(2))
    outs = trainer.forward([lenient, strict], options=call)
    train_step(trainer, seed=10)
    trainer.backward(outs[0].target_logprobs.sum())  # staleness 1 <= its own bound 1
    with pytest.raises(rt.StaleGradientError) as info:
        trainer.backward(outs[1].target_logprobs.sum())  # staleness 1 > the call's bound 0
    assert info.value.bound == 0


@pytest.mark.parametrize("direction", ["tighten", "loosen"])
def test_options_are_captured_when_the_forward_is_submitted(direction: str) -> None:
    before, after = (2, 0) if direction == "tighten" else (0, 5)
    trainer = make_trainer(
        "full", dropout=0.0, options=rt.ForwardOptions(max_gradient_staleness=before, corrections=())
    )
    out = trainer.forward(rt.ForwardInput(*sequence(1)))
    trainer.options = rt.ForwardOptions(max_gradient_staleness=after, corrections=())
    train_step(trainer, seed=20)
    if direction == "tighten":
        trainer.backward(out.target_logprobs.sum())  # the submitted bound 2 still holds
    else:
        with pytest.raises(rt.StaleGradientError) as info:
            trainer.backward(out.target_logprobs.sum())
        assert info.value.bound == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        trainer.options.max_gradient_staleness = 1  # type: ignore[misc]


# --- validation at construction ---------------------------------------------------------

TWO = (rt.ImportanceCorrection(), rt.ImportanceCorrection())
BAD = [
    # (builder, field, offending value, a word of what is allowed)
    (lambda: rt.ForwardOptions(max_gradient_staleness=-1), "max_gradient_staleness", -1, "int >= 0"),
    (lambda: rt.ForwardOptions(max_gradient_staleness=True), "max_gradient_staleness", True, "int >= 0"),
    (lambda: rt.ForwardOptions(max_gradient_staleness=1.5), "max_gradient_staleness", 1.5, "int >= 0"),
    (lambda: rt.ForwardOptions(max_gradient_staleness=None), "max_gradient_staleness", None, "int >= 0"),
    (lambda: rt.ForwardOptions(backward_state="keep"), "backward_state", "keep", "offload"),
    (lambda: rt.ForwardOptions(corrections=TWO), "corrections", TWO, "at most one"),
    (lambda: rt.ForwardOptions(corrections=("x",)), "corrections", "x", "ImportanceCorrection"),
    (lambda: rt.ForwardOptions(corrections=5), "corrections", 5, "ImportanceCorrection"),
    (lambda: rt.ForwardOptions(allow_offload=1), "allow_offload", 1, "bool"),
    (lambda: rt.ForwardOptions(allow_replay="yes"), "allow_replay", "yes", "bool"),
    (lambda: rt.ImportanceCorrection(clip_low=-0.5), "ImportanceCorrection.clip_low", -0.5, ">= 0"),
    (lambda: rt.ImportanceCorrection(clip_high=-1.0), "ImportanceCorrection.clip_high", -1.0, ">= 0"),
    (lambda: rt.ImportanceCorrection(clip_low=3.0, clip_high=2.0), "ImportanceCorrection.clip_low", 3.0, "clip_high"),
    (lambda: rt.ImportanceCorrection(clip_high=math.nan), "ImportanceCorrection.clip_high", math.nan, "finite"),
    (lambda: rt.ImportanceCorrection(clip_high=math.inf), "ImportanceCorrection.clip_high", math.inf, "finite"),
    (lambda: rt.ImportanceCorrection(clip_low=True), "ImportanceCorrection.clip_low", True, "number"),
    (lambda: rt.ImportanceCorrection(policy="never"), "ImportanceCorrection.policy", "never", "when_available"),
    (
        lambda: rt.ImportanceCorrection(level="tokens"),
        "ImportanceCorrection.level",
        "tokens",
        "('token', 'sequence', 'geometric', 'average')",
    ),
    (lambda: rt.ImportanceCorrection(level=None), "ImportanceCorrection.level", None, "'geometric'"),
    (lambda: rt.ImportanceCorrection(max_log_ratio=-1.0), "ImportanceCorrection.max_log_ratio", -1.0, ">= 0"),
    (lambda: rt.ImportanceCorrection(max_log_ratio=math.inf), "ImportanceCorrection.max_log_ratio", math.inf, "<= 700"),
    (lambda: rt.ImportanceCorrection(max_log_ratio=701.0), "ImportanceCorrection.max_log_ratio", 701.0, "<= 700"),
]


@pytest.mark.parametrize("build,field,value,allowed", BAD, ids=[f"{b[1]}={b[2]!r}" for b in BAD])
def test_bad_values_are_config_errors_naming_field_value_and_what_is_allowed(build, field, value, allowed) -> None:
    with pytest.raises(rt.ConfigError) as info:
        build()
    error = info.value
    assert isinstance(error, rt.TrainerError) and isinstance(error, ValueError)
    assert error.field == field
    if isinstance(value, float) and math.isnan(value):
        assert math.isnan(error.value)
    else:
        assert error.value == value and type(error.value) is type(value)
    assert allowed in error.allowed
    message = str(error)
    assert field in message and repr(value) in message and error.allowed in message


def test_options_are_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        rt.ForwardOptions(2)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        rt.ImportanceCorrection().clip_high = 1.0  # type: ignore[misc]


def test_a_single_correction_is_normalised_to_a_tuple() -> None:
    correction = rt.ImportanceCorrection(clip_high=3.0)
    assert rt.ForwardOptions(corrections=correction).corrections == (correction,)
    assert rt.ForwardOptions(corrections=[correction]).corrections == (correction,)


# --- conflicts after resolution ---------------------------------------------------------------


@pytest.mark.parametrize("state,flag", [("offload", "allow_offload"), ("replay", "allow_replay")])
def test_forced_placement_forbidden_by_its_flag_fails_at_forward_unless_a_higher_level_allows_it(
    state: str, flag: str
) -> None:
    trainer = make_trainer("full", dropout=0.0, options=rt.ForwardOptions(**{flag: False}))
    call = rt.ForwardOptions(backward_state=state)
    with pytest.raises(rt.ConfigError) as info:
        trainer.forward(rt.ForwardInput(*sequence(1)), options=call)
    assert info.value.field == "backward_state" and info.value.value == state and flag in info.value.allowed
    assert trainer.live_records() == 0
    allowed = rt.ForwardInput(*sequence(1), options=rt.ForwardOptions(**{flag: True}))
    out = trainer.forward(allowed, options=call)
    assert out.target_logprobs.requires_grad
    # Each construction on its own is valid: the conflict only exists after resolution.
    rt.ForwardOptions(backward_state=state, **{flag: True})


# --- the UNSET marker -----------------------------------------------------------------------


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_unset_identity_survives_pickle(protocol: int) -> None:
    assert pickle.loads(pickle.dumps(rt.UNSET, protocol=protocol)) is rt.UNSET
    options = pickle.loads(pickle.dumps(rt.ForwardOptions(max_gradient_staleness=1), protocol=protocol))
    assert options.backward_state is rt.UNSET and options.max_gradient_staleness == 1
    assert rt.resolve_options(options).backward_state == "auto"


def test_unset_identity_survives_copy_and_deepcopy() -> None:
    assert copy.copy(rt.UNSET) is rt.UNSET
    assert copy.deepcopy(rt.UNSET) is rt.UNSET
    assert copy.deepcopy([rt.UNSET, {"k": rt.UNSET}])[1]["k"] is rt.UNSET
    assert _Unset() is rt.UNSET
    options = copy.deepcopy(rt.ForwardOptions(allow_replay=False))
    assert options.corrections is rt.UNSET and options.allow_replay is False
    assert rt.resolve_options(options).corrections == DEFAULTS["corrections"]
    assert repr(rt.UNSET) == "UNSET"


def test_pickled_options_keep_their_corrections() -> None:
    options = rt.ForwardOptions(corrections=rt.ImportanceCorrection(clip_low=0.5, policy="always"))
    assert pickle.loads(pickle.dumps(options)) == options
