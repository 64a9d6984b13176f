"""The derivative canary's exploration: a hypothesis state machine of random op interleavings, steered stale.

:func:`machine_for` builds a ``RuleBasedStateMachine`` whose rules are the
harness's ops and whose invariant is :meth:`DerivativeHarness.check`; a
failure is shrunk to a minimal op sequence, printed as ``state.start(...)`` /
``state.backward(...)`` lines. :func:`explore` runs it with the settings of a
canary profile (``validation.profiles.EXPLORATION``).

Steering (what makes stale gradients most of what is checked):
  - every example starts with :meth:`start`: a checkpoint kind (LoRA or full),
    four forwards with the widest staleness bound, a training step on other
    data, a backward of two of those records (staleness 1), an optimizer step
    and a backward of the third (staleness 2), so every example
    backpropagates stale records; the fourth record's outputs stay pending;
  - ``train_step`` (fresh data) ages pending outputs only when no gradient is
    waiting for ``step`` to do it;
  - forwards draw the bound 2 first (hypothesis also shrinks towards it) and
    stop while enough outputs are pending, so steps age them before a backward;
  - bookkeeping ops (save, load, drop, zero_grad) run only when there is
    something for them to act on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ..presets import PLACEMENT_REQUESTS, PLACEMENTS, Preset
from .oracle_harness import DerivativeHarness, OutputRef, SavedRef
from .oracle_pair import FAULTS, checkpoint_kinds

__all__ = ["MAX_PENDING", "machine_for", "explore"]

MAX_PENDING = 6  # live outputs at most, so examples stay cheap


def machine_for(
    config: Preset, *, on_example: Callable[[DerivativeHarness], None] | None = None, bound_cap: int = 2
) -> type:
    """A ``RuleBasedStateMachine`` class exploring op interleavings on ``config`` (see the module docstring).

    ``on_example`` sees each finished example's harness; ``bound_cap`` is the
    harness's (0 empties every stale cell: the coverage check's negative control).
    """
    forward_args = dict(
        placement=st.sampled_from(PLACEMENT_REQUESTS),
        bound=st.sampled_from((2, 1, 0)),
        correct=st.booleans(),
        lengths=st.lists(st.integers(1, max(2, config.seq_len)), min_size=1, max_size=3),
        seed=st.integers(0, 255),
    )

    class DerivativeMachine(RuleBasedStateMachine):
        outputs = Bundle("outputs")  # never backpropagated yet
        used = Bundle("used")  # went through a backward (consumed, retained, failed or retryable)
        saved = Bundle("saved")

        @initialize(
            target=outputs,
            kind=st.sampled_from(checkpoint_kinds(config)),
            placements=st.lists(st.sampled_from(PLACEMENTS), min_size=4, max_size=4),
            correct=st.lists(st.booleans(), min_size=4, max_size=4),
            seed=st.integers(0, 255),
        )
        def start(self, kind: str, placements: list[str], correct: list[bool], seed: int) -> Any:
            self.h = DerivativeHarness(config, kind=kind, bound_cap=bound_cap)
            made = [self.h.forward(p, 2, c, [3, 2], seed + i) for i, (p, c) in enumerate(zip(placements, correct))]
            self.h.train_step(seed + 10)
            self.h.backward(made[0] + made[1])  # staleness 1
            self.h.step()
            self.h.backward(made[2])  # staleness 2
            return multiple(*made[3])

        @precondition(lambda self: self.h.pending_outputs() < MAX_PENDING)
        @rule(target=outputs, **forward_args)
        def forward(self, placement: str, bound: int, correct: bool, lengths: list[int], seed: int) -> Any:
            return multiple(*self.h.forward(placement, bound, correct, lengths, seed))

        @precondition(lambda self: self.bundle("outputs"))
        @rule(
            target=used,
            chosen=st.lists(consumes(outputs), min_size=1, max_size=3, unique=True),
            retain_graph=st.booleans(),
            fault=st.none() | st.sampled_from(FAULTS),
        )
        def backward(self, chosen: list[OutputRef], retain_graph: bool, fault: str | None) -> Any:
            self.h.backward(chosen, retain_graph=retain_graph, fault=fault)
            return multiple(*chosen)

        @precondition(lambda self: self.bundle("used"))
        @rule(chosen=st.lists(used, min_size=1, max_size=2, unique=True), retain_graph=st.booleans())
        def backward_again(self, chosen: list[OutputRef], retain_graph: bool) -> None:
            self.h.backward(chosen, retain_graph=retain_graph)

        @precondition(lambda self: self.h.has_gradients())
        @rule(
            lr=st.sampled_from([None, 3e-3]),
            max_grad_norm=st.sampled_from([None, 1e-3, 1e3]),
            then_zero_grad=st.booleans(),
        )
        def step(self, lr: float | None, max_grad_norm: float | None, then_zero_grad: bool) -> None:
            self.h.step(lr=lr, max_grad_norm=max_grad_norm)
            if then_zero_grad:
                self.h.zero_grad()

        @precondition(lambda self: self.h.pending_outputs() > 0 and not self.h.has_gradients())
        @rule(seed=st.integers(0, 255))
        def train_step(self, seed: int) -> None:
            self.h.train_step(seed)

        @precondition(lambda self: self.h.has_gradients())
        @rule()
        def zero_grad(self) -> None:
            self.h.zero_grad()

        @precondition(lambda self: len(self.h.saved) < 2)
        @rule(target=saved)
        def save(self) -> SavedRef:
            return self.h.save()

        @rule(state=saved, discard_graphs=st.booleans())
        def load(self, state: SavedRef, discard_graphs: bool) -> None:
            self.h.load(state, discard_graphs=discard_graphs)

        @precondition(lambda self: self.h.pending_outputs() > 2)
        @rule(output=consumes(outputs))
        def drop(self, output: OutputRef) -> None:
            self.h.drop(output)

        @invariant()
        def agrees_with_oracle(self) -> None:
            self.h.check()

        def teardown(self) -> None:
            if on_example is not None and hasattr(self, "h"):
                on_example(self.h)

    DerivativeMachine.__name__ = DerivativeMachine.__qualname__ = "DerivativeMachine"
    return DerivativeMachine


def explore(
    config: Preset, profile: settings, *, on_example: Callable[[DerivativeHarness], None], bound_cap: int = 2
) -> str | None:
    """Run the state machine under ``profile``; ``None`` when it passed, else the failure and its shrunk op sequence."""
    try:
        run_state_machine_as_test(machine_for(config, on_example=on_example, bound_cap=bound_cap), settings=profile)
    except Exception as failure:  # noqa: BLE001 - hypothesis re-raises the shrunk failure
        notes = "\n".join(getattr(failure, "__notes__", []))
        return f"{type(failure).__name__}: {failure}\n{notes}"
    return None
