"""The derivative canary: random and fixed op sequences, every op judged against the FP64 oracle.

The judging is ``canaries.oracle_harness`` (NOTE [Derivative canary]); this
module feeds it ops. Fixed :data:`SCENARIOS` exercise every feature at least
once, cheaply and deterministically (the mutation suite runs them). A
hypothesis ``RuleBasedStateMachine`` (:func:`machine_for`) explores random
interleavings and shrinks a failure to a minimal op sequence, printed as
``state.forward(...)`` / ``state.backward(...)`` lines.
:func:`check_logical_normalisation` is the logical-rank check (Rule 6 below).
:func:`run` is the entry point: it writes a write-once evidence record.

NOTE [Derivative canary] (continued)
  6. Logical ranks (rank mode, W = 1, L = 2): the gradient buffers of a loss
     normalised by ``global_token_count`` sum to the oracle's gradient of the
     globally normalised loss.
  7. Profiles: ``scenarios`` (fixed scenarios and the logical check only),
     ``ci`` (plus a derandomized exploration, seconds) and ``nightly``
     (random exploration, minutes).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, settings
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

import reference_trainer as rt
from reference_trainer.ranks import logical_gradients, run_logical
from validation.evidence import make_record, write_once

from .oracle_harness import (
    FAULTS,
    LR,
    NAME,
    PLACEMENTS,
    TOLERANCES,
    CanaryFailure,
    DerivativeHarness,
    Measurements,
    OutputRef,
    SavedRef,
    build_trainer,
    judge_gradients,
    sequences,
)
from .presets import Preset, preset

__all__ = [
    "PROFILES",
    "SCENARIOS",
    "run_scenario",
    "check_logical_normalisation",
    "machine_for",
    "CanaryResult",
    "judge",
    "run",
    "write_evidence",
]

MAX_PENDING = 8  # live outputs at most, so examples stay cheap

# No "explain" phase: it re-runs the shrunk failure many times to list covered lines (slow, and noise here).
_PHASES = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)

PROFILES: dict[str, settings | None] = {
    # The fixed scenarios only (no exploration): what the mutation suite runs.
    "scenarios": None,
    "ci": settings(
        max_examples=40,
        stateful_step_count=15,
        derandomize=True,
        database=None,
        phases=_PHASES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    ),
    "nightly": settings(
        max_examples=300,
        stateful_step_count=30,
        database=None,
        phases=_PHASES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    ),
}


# --- fixed scenarios ------------------------------------------------------------------------


def _stale_exact(h: DerivativeHarness) -> None:
    """Every placement at staleness 0, 1 and 2, steps in between (clipped and not), a retained graph."""
    old = [h.forward(p, 2, False, [5, 3], seed=i) for i, p in enumerate(("retain", "offload", "replay"))]
    middle = h.forward("replay", 2, False, [4], seed=10)
    h.backward(old[0][:1])  # fresh; the record's second output gets a zero cotangent
    h.step()
    h.backward(old[1][1:])  # staleness 1
    h.backward(middle)  # staleness 1, replayed
    h.step(max_grad_norm=1e-3)
    h.backward(old[2] + old[1][:1])  # old[1] was consumed: refused, old[2] untouched
    h.backward(old[2], retain_graph=True)  # staleness 2
    h.backward(old[2])  # again, through the retained graph
    h.backward(old[2])  # consumed: refused
    h.step(lr=3e-3)
    h.zero_grad()


def _bounds(h: DerivativeHarness) -> None:
    """Staleness one beyond the bound is refused at backward (bounds 0, 1, 2) and at optim_step."""
    pending = {bound: h.forward("retain", bound, False, [4], seed=20 + bound) for bound in (0, 1, 2)}
    for step in range(3):
        h.backward(h.forward("offload", 2, False, [3], seed=30 + step))
        h.step()
        h.zero_grad()
        h.backward(pending[step])  # staleness step + 1 > bound: refused
    h.backward(h.forward("replay", 0, False, [3], seed=33))
    h.step()
    h.step()  # the bound-0 gradient is one revision old now: refused


def _corrections(h: DerivativeHarness) -> None:
    """An "always" correction reweights stale records only; none for fresh ones or without a correction."""
    fresh = h.forward("retain", 2, True, [6, 2], seed=40)
    stale = h.forward("replay", 2, True, [5], seed=41)
    plain = h.forward("offload", 2, False, [5], seed=42)
    h.backward(fresh)
    h.step()
    h.backward(stale + plain)
    h.step()


def _faults(h: DerivativeHarness) -> None:
    """A fault at every stage commits nothing; only a failure before the model backward leaves records retryable."""
    h.backward(h.forward("retain", 2, False, [4], seed=50))  # gradients that must stay unchanged
    for i, fault in enumerate(FAULTS):
        outs = h.forward(("retain", "offload", "replay")[i % 3], 2, True, [3, 4], seed=51 + i)
        h.faulty_backward(outs, fault)
        h.backward(outs)  # retried (user_autograd) or refused (released)
    h.step()


def _save_load(h: DerivativeHarness) -> None:
    """Load refuses a busy checkpoint, starts a new generation with discard_graphs, and restores exactly."""
    saved = h.save()
    pending = h.forward("retain", 2, False, [4], seed=60)
    h.backward(h.forward("replay", 2, False, [4], seed=61))
    h.step()
    h.load(saved, discard_graphs=False)  # busy: refused
    h.load(saved, discard_graphs=True)
    h.backward(pending)  # replaced
    h.load(saved, discard_graphs=False)  # nothing pending now
    h.backward(h.forward("offload", 1, False, [3], seed=62))
    h.step()


def _drops(h: DerivativeHarness) -> None:
    """Dropping every output of a record releases it; dropping one of two does not. No gradient: no step."""
    h.step()
    outs = h.forward("retain", 2, False, [3, 3], seed=70)
    h.drop(outs[0])
    h.backward(outs[1:])
    for ref in h.forward("offload", 2, False, [2, 5], seed=71):
        h.drop(ref)


SCENARIOS: dict[str, Callable[[DerivativeHarness], None]] = {
    "stale_exact": _stale_exact,
    "bounds": _bounds,
    "corrections": _corrections,
    "faults": _faults,
    "save_load": _save_load,
    "drops": _drops,
}


class _EachOpChecked:
    """A harness whose every op is followed by the invariant, as the state machine does."""

    def __init__(self, harness: DerivativeHarness) -> None:
        self._harness = harness

    def __getattr__(self, name: str) -> Any:
        op = getattr(self._harness, name)

        def checked(*args: Any, **kwargs: Any) -> Any:
            result = op(*args, **kwargs)
            self._harness.check()
            return result

        return checked


def run_scenario(config: Preset, name: str) -> Measurements:
    """One fixed scenario on a fresh harness, the invariant checked after every op."""
    harness = DerivativeHarness(config)
    SCENARIOS[name](_EachOpChecked(harness))  # type: ignore[arg-type]
    return harness.measured


# --- logical ranks (Rule 6) -------------------------------------------------------------------


def check_logical_normalisation(config: Preset, logical_dp: int = 2) -> float:
    """Rank mode at W = 1: the loss normalised by ``global_token_count`` gives the oracle's gradient.

    Each logical rank backpropagates ``-sum(adv . logprobs) / global token
    count``; the sum of the logical buffers must match the oracle's gradient
    of the globally normalised loss. Returns the worst relative error.
    """
    trainer, oracle = build_trainer(config)
    vocab = config.model.vocab_size
    data = {lr: sequences(80 + lr, [3 + 2 * lr, 4 + lr], vocab) for lr in range(logical_dp)}
    options = rt.ForwardOptions(corrections=(), backward_state="retain")

    device = torch.device(config.device)

    def body(view: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        items = data[view.logical_rank]
        rng = torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        outs = view.forward([rt.ForwardInput(ids, t) for ids, t, _ in items], options=options)
        count = view.global_token_count([t >= 0 for _, t, _ in items])
        loss = -sum((o.target_logprobs * a.to(o.target_logprobs.device)).sum() for o, (_, _, a) in zip(outs, items))
        view.backward(loss / count)
        return rng

    states = run_logical(body, trainer, logical_dp=logical_dp)
    tokens = sum(int((t >= 0).sum()) for items in data.values() for _, t, _ in items)
    terms = []
    for lr, items in data.items():
        cpu_rng, cuda_rng = states[lr]
        record = oracle.forward(NAME, [(ids, t) for ids, t, _ in items], rng_state=cpu_rng, cuda_rng_state=cuda_rng,
                                bound=2, correction=None)
        terms += [(record, row, -a / tokens) for row, (_, _, a) in enumerate(items)]
    backward = oracle.backward(terms)
    expected = backward.increments[NAME]
    buffers = logical_gradients(trainer)
    found = {n: sum(buffers[lr][(NAME, n)].double() for lr in range(logical_dp)) for n in expected}
    comparison = judge_gradients(found, expected, backward.baselines[NAME], TOLERANCES[config.model.dtype], None)
    if not comparison.passed:
        raise CanaryFailure(f"logical ranks (L={logical_dp}): gradient of the globally normalised loss: "
                            f"{comparison.describe()}")
    return comparison.worst[1]


# --- the state machine -------------------------------------------------------------------------


def machine_for(config: Preset, *, on_example: Callable[[DerivativeHarness], None] | None = None) -> type:
    """A ``RuleBasedStateMachine`` class exploring random op interleavings on ``config``.

    Rules are the harness's ops; the invariant is :meth:`DerivativeHarness.check`.
    ``on_example`` sees each finished example's harness (progress, measurements).
    """
    forward_args = dict(
        placement=st.sampled_from(PLACEMENTS),
        bound=st.integers(0, 2),
        correct=st.booleans(),
        lengths=st.lists(st.integers(1, max(2, config.seq_len)), min_size=1, max_size=3),
        seed=st.integers(0, 255),
    )

    class DerivativeMachine(RuleBasedStateMachine):
        outputs = Bundle("outputs")  # never backpropagated yet
        used = Bundle("used")  # went through a backward (consumed, retained, failed or retryable)
        saved = Bundle("saved")

        def __init__(self) -> None:
            super().__init__()
            self.h = DerivativeHarness(config)

        @initialize(target=outputs, **forward_args)
        def first_forward(self, placement: str, bound: int, correct: bool, lengths: list[int], seed: int) -> Any:
            return multiple(*self.h.forward(placement, bound, correct, lengths, seed))

        @precondition(lambda self: self.h.pending_outputs() < MAX_PENDING)
        @rule(target=outputs, **forward_args)
        def forward(self, placement: str, bound: int, correct: bool, lengths: list[int], seed: int) -> Any:
            return multiple(*self.h.forward(placement, bound, correct, lengths, seed))

        @precondition(lambda self: self.bundle("outputs"))
        @rule(target=used, chosen=st.lists(consumes(outputs), min_size=1, max_size=3, unique=True),
              retain_graph=st.booleans(), fault=st.none() | st.sampled_from(FAULTS))
        def backward(self, chosen: list[OutputRef], retain_graph: bool, fault: str | None) -> Any:
            self.h.backward(chosen, retain_graph=retain_graph, fault=fault)
            return multiple(*chosen)

        @precondition(lambda self: self.bundle("used"))
        @rule(chosen=st.lists(used, min_size=1, max_size=2, unique=True), retain_graph=st.booleans())
        def backward_again(self, chosen: list[OutputRef], retain_graph: bool) -> None:
            self.h.backward(chosen, retain_graph=retain_graph)

        @precondition(lambda self: self.h.has_gradients())
        @rule(lr=st.sampled_from([None, 3e-3]), max_grad_norm=st.sampled_from([None, 1e-3, 1e3]),
              then_zero_grad=st.booleans())
        def step(self, lr: float | None, max_grad_norm: float | None, then_zero_grad: bool) -> None:
            self.h.step(lr=lr, max_grad_norm=max_grad_norm)
            if then_zero_grad:
                self.h.zero_grad()

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

        @rule(output=consumes(outputs))
        def drop(self, output: OutputRef) -> None:
            self.h.drop(output)

        @invariant()
        def agrees_with_oracle(self) -> None:
            self.h.check()

        def teardown(self) -> None:
            if on_example is not None:
                on_example(self.h)

    DerivativeMachine.__name__ = DerivativeMachine.__qualname__ = "DerivativeMachine"
    return DerivativeMachine


# --- judging and evidence ------------------------------------------------------------------------


@dataclass
class CanaryResult:
    """What one canary run found: per-check verdicts, failures (with op sequences), measurements."""

    checks: dict[str, bool] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    measured: Measurements = field(default_factory=Measurements)
    examples: int = 0
    worst_logical_error: float = 0.0
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(self.checks.values())


def judge(
    config: Preset,
    *,
    profile: str = "ci",
    echo: Callable[[str], None] = lambda line: None,
    stop_early: bool = False,
) -> CanaryResult:
    """Run the scenarios, the logical-rank check and (unless ``profile="scenarios"``) the state machine.

    ``stop_early``: return at the first failed check (the mutation suite only needs one).
    """
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; expected one of {sorted(PROFILES)}")
    result = CanaryResult()
    if not config.cuda_checks:
        why = "preset swapped to CPU (no CUDA device)" if config.swapped else "CPU preset"
        result.skipped["cuda_rng_unchanged_by_backward"] = why
    for name in SCENARIOS:
        try:
            result.measured.merge(run_scenario(config, name))
            result.checks[f"scenario:{name}"] = True
        except Exception as failure:  # noqa: BLE001 - fail closed: a crash is a failure too
            result.checks[f"scenario:{name}"] = False
            result.failures[f"scenario:{name}"] = f"{type(failure).__name__}: {failure}"
        echo(f"scenario {name:12} {'PASS' if result.checks[f'scenario:{name}'] else 'FAIL'}")
        if stop_early and not result.passed:
            return result
    try:
        result.worst_logical_error = check_logical_normalisation(config, max(2, config.logical_dp))
        result.checks["logical_global_normalisation"] = True
    except Exception as failure:  # noqa: BLE001
        result.checks["logical_global_normalisation"] = False
        result.failures["logical_global_normalisation"] = f"{type(failure).__name__}: {failure}"
    echo(f"logical ranks        {'PASS' if result.checks['logical_global_normalisation'] else 'FAIL'}")
    if PROFILES[profile] is None or (stop_early and not result.passed):
        return result
    result.checks["state_machine"] = _explore(config, PROFILES[profile], result, echo)
    return result


def _explore(config: Preset, profile: settings, result: CanaryResult, echo: Callable[[str], None]) -> bool:
    shrinking = []

    def on_example(harness: DerivativeHarness) -> None:
        # After the first failure hypothesis replays variants of it (shrinking); an empty example was rejected.
        if harness.failed and not shrinking:
            shrinking.append(True)
            echo("failure found; shrinking it to a minimal op sequence ...")
        if shrinking or not harness.measured.ops:
            return
        result.examples += 1
        result.measured.merge(harness.measured)
        m = harness.measured
        echo(f"example {result.examples:4}: {m.ops:3} ops, {m.backwards:2} backwards, {m.steps:2} steps, "
             f"worst gradient error {m.worst_gradient_error:.2e}")

    machine = machine_for(config, on_example=on_example)
    try:
        run_state_machine_as_test(machine, settings=profile)
    except Exception as failure:  # noqa: BLE001 - hypothesis re-raises the shrunk failure
        notes = "\n".join(getattr(failure, "__notes__", []))
        result.failures["state_machine"] = f"{type(failure).__name__}: {failure}\n{notes}"
        echo("state machine FAIL, minimal op sequence:\n" + notes)
        return False
    return True


def run(
    preset_name: str = "cpu",
    *,
    profile: str = "ci",
    out_dir: Path,
    mutation: str | None = None,
) -> Path:
    """Run the derivative canary on ``preset(preset_name).on_this_machine()``; returns the evidence path.

    ``mutation`` names a deliberately injected bug from ``canaries.mutations``
    (applied for the whole run; the canary must then fail). Prints one line
    per scenario and per example, then the path.
    """
    config = preset(preset_name).on_this_machine()
    if mutation is not None:
        from .mutations import mutation as lookup

        context = lookup(mutation).apply()
    else:
        context = nullcontext()
    started = time.perf_counter()
    echo = lambda line: print(line, flush=True)  # noqa: E731
    with context:
        result = judge(config, profile=profile, echo=echo)
    path = write_evidence(result, config, profile=profile, mutation=mutation, out_dir=Path(out_dir),
                          seconds=time.perf_counter() - started)
    print(f"derivative canary {'PASSED' if result.passed else 'FAILED'}: {path}", flush=True)
    return path


def write_evidence(
    result: CanaryResult, config: Preset, *, profile: str, mutation: str | None, out_dir: Path, seconds: float
) -> Path:
    m = result.measured
    record = make_record(
        "derivative-canary",
        config={"preset": config.describe(), "profile": profile, "mutation": mutation,
                "tolerances": TOLERANCES[config.model.dtype].__dict__, "learning_rate": LR},
        checks=result.checks,
        measurements={
            "examples": result.examples,
            "ops": m.ops,
            "backwards": m.backwards,
            "optimizer_steps": m.steps,
            "errors_predicted_and_matched": m.errors_predicted,
            "stale_records_backpropagated": m.stale_records,
            "corrected_records": m.corrected_records,
            "worst_gradient_relative_l2": m.worst_gradient_error,
            "worst_gradient_error_over_threshold": m.worst_gradient_margin,
            "worst_logprob_relative_l2": m.worst_logprob_error,
            "worst_step_relative_l2": m.worst_step_error,
            "worst_logical_relative_l2": result.worst_logical_error,
            "min_reference_norm": None if math.isinf(m.min_reference_norm) else m.min_reference_norm,
            "failures": result.failures,
            "skipped_checks": result.skipped,
            "seconds": round(seconds, 3),
        },
    )
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    suffix = f"-{mutation}" if mutation else ""
    return write_once(out_dir / f"derivative-{config.name}{suffix}-{stamp}-{os.getpid()}.json", record)


if __name__ == "__main__":  # python -m canaries.derivative [preset] [profile]
    args = sys.argv[1:]
    run(args[0] if args else "cpu", profile=args[1] if len(args) > 1 else "ci", out_dir=Path("rtv-out"))
