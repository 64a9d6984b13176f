"""The *resume* check: a job saved between any two calls and continued from ``load`` ends where it would have.

The job is :data:`RESUME_STEPS` steps of ``forward, backward, optim_step,
zero_grad``. Hypothesis (``hypothesis.find``, derandomized, no database)
picks the call after which the job saves; a fresh adapter from the factory
is started, ``load``s the save and runs the rest. A forward pending at the
save (saved between a forward and its backward) is made again by the suite
on the fresh adapter, as with any trainer whose save does not hold graphs.
The parameters at the end must equal the uninterrupted run's: bitwise when
the adapter sets ``bitwise_resume = True``, else within the tolerance
(NOTE [Conformance oracle] Rules 3-4). Hypothesis shrinks a failure to the
earliest call it finds, which the reason names.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, find, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from .checks import FAILED, PASSED, Verdict
from .jobs import Driven, make_batch, started
from .oracle import compare, snapshot, tolerance
from .protocol import ConformSpec

__all__ = ["RESUME_STEPS", "CALLS", "resume"]

RESUME_STEPS = 3
CALLS = ("forward", "backward", "optim_step", "zero_grad")  # one step of the job
EXAMPLES = 8  # save points hypothesis tries (of RESUME_STEPS * len(CALLS) - 1)
_SETTINGS = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    phases=(Phase.generate, Phase.shrink),
    suppress_health_check=list(HealthCheck),
)


class _Job:
    """The job's calls on one adapter, from call ``first`` to call ``last`` (exclusive)."""

    def __init__(self, spec: ConformSpec) -> None:
        self.spec = spec
        self.pending: torch.Tensor | None = None

    def run(self, driven: Driven, first: int, last: int) -> None:
        for index in range(first, last):
            step, call = divmod(index, len(CALLS))
            batch = make_batch(self.spec, step)
            if CALLS[call] == "forward":
                self.pending = driven.step_loss(batch, batch.active)
            elif CALLS[call] == "backward":
                driven.adapter.backward(self.pending)
                self.pending = None
            else:
                getattr(driven.adapter, CALLS[call])()

    def remake_pending(self, driven: Driven, saved_after: int) -> None:
        """On the resumed adapter: the forward whose backward had not come at the save, made again."""
        step, call = divmod(saved_after - 1, len(CALLS))
        if CALLS[call] == "forward":
            batch = make_batch(self.spec, step)
            self.pending = driven.step_loss(batch, batch.active)


def _calls() -> int:
    return RESUME_STEPS * len(CALLS)


def _resumed(factory: Callable[[], Any], spec: ConformSpec, point: int) -> dict[str, torch.Tensor]:
    """The parameters at the end of the job saved after call ``point`` and continued on a fresh adapter."""
    job, first = _Job(spec), started(factory, spec)
    job.run(first, 0, point)
    with tempfile.TemporaryDirectory(prefix="rtv-conform-") as folder:
        first.adapter.save(folder)
        second = started(factory, spec)
        second.adapter.load(folder)
    job.remake_pending(second, point)
    job.run(second, point, _calls())
    return snapshot(second.module())


def resume(factory: Callable[[], Any], spec: ConformSpec) -> Verdict:
    """The check (module docstring)."""
    whole = started(factory, spec)
    _Job(spec).run(whole, 0, _calls())
    expected = snapshot(whole.module())
    bitwise = bool(getattr(whole.adapter, "bitwise_resume", False))
    tol = 0.0 if bitwise else tolerance(spec.torch_dtype)
    tried: dict[int, float] = {}

    def differs(point: int) -> bool:
        tried[point] = compare(_resumed(factory, spec, point), expected, tol).error
        return tried[point] > tol

    try:
        point = find(st.integers(1, _calls() - 1), differs, settings=_SETTINGS)
    except NoSuchExample:
        return Verdict(
            "resume",
            PASSED,
            f"saved after each of calls {sorted(tried)} of {_calls()}: "
            f"{'bitwise equal' if bitwise else f'within {tol:.3g}'}, worst error {max(tried.values()):.3g}",
            {"save_points": sorted(tried), "bitwise": bitwise},
        )
    step, call = divmod(point - 1, len(CALLS))
    comparison = compare(_resumed(factory, spec, point), expected, tol)
    return Verdict(
        "resume",
        FAILED,
        f"saved after call {point} (step {step}'s {CALLS[call]}) and continued from load, "
        f"the parameters differ from the uninterrupted run's ({'bitwise claimed' if bitwise else 'tolerance'}"
        f"): {comparison.worst()}",
        {"worst": comparison.evidence(), "save_point": point, "bitwise": bitwise},
    )
