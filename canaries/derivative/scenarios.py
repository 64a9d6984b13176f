"""The derivative canary's fixed scenarios and its logical-rank check.

Fixed :data:`SCENARIOS` exercise every feature at least once, cheaply and
deterministically, on a fresh :class:`~canaries.derivative.oracle_harness.DerivativeHarness`
each (the invariant checked after every op). ``stale_grid`` backpropagates a
record of every placement, with and without a correction, and one of every
other correction level, at staleness 1 and 2: the coverage floor the canary claims (NOTE [Derivative canary] Rule 6).
:func:`check_logical_normalisation` is Rule 7 of NOTE [Derivative canary]
(``canaries.derivative.canary``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import reference_trainer as rt
from reference_trainer.peers import select_backend
from reference_trainer.ranks import run_logical
from validation.world import run_ranks

from ..mutations.catalogue import active_mutations, call_mutated
from ..presets import Preset
from .oracle_harness import DerivativeHarness
from .oracle_pair import (
    FAULTS,
    NAME,
    TOLERANCES,
    CanaryFailure,
    Measurements,
    build_trainer,
    judge_gradients,
    sequences,
)

__all__ = ["LEVELS", "SCENARIOS", "run_scenario", "check_logical_normalisation"]

LEVELS = ("sequence", "geometric", "average")  # the correction levels beside the default "token" the grid covers


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
        h.backward(outs, fault=fault)
        h.backward(outs)  # retried (user_autograd) or refused (released)
    h.step()


def _non_finite(h: DerivativeHarness) -> None:
    """A NaN loss is refused on a first backward (no gradient yet) and on an accumulating one."""
    h.non_finite_backward(h.forward("retain", 2, False, [3], seed=55))
    h.backward(h.forward("retain", 2, False, [3], seed=56))
    h.non_finite_backward(h.forward("offload", 2, False, [3], seed=57))
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


def _stale_grid(h: DerivativeHarness) -> None:
    """Every placement, with and without a correction, and every other correction level (retained, two rows),
    backpropagated at staleness 2 and 1 in one backward (Rule 6)."""
    pending = []
    for age in (2, 1):
        grid = itertools.product(("retain", "offload", "replay"), (False, True))
        pending += [h.forward(p, 2, correct, [3], seed=90 + 10 * age + i) for i, (p, correct) in enumerate(grid)]
        pending += [
            h.forward("retain", 2, True, [3, 4], seed=96 + 10 * age + i, level=level) for i, level in enumerate(LEVELS)
        ]
        h.train_step(90 + age)
    h.backward([ref for refs in pending for ref in refs])
    h.step()
    h.zero_grad()


# Cheap scenarios first: a run stops at its first failure (the mutation suite runs one per injected bug).
SCENARIOS: dict[str, Callable[[DerivativeHarness], None]] = {
    "stale_exact": _stale_exact,
    "bounds": _bounds,
    "corrections": _corrections,
    "faults": _faults,
    "non_finite": _non_finite,
    "save_load": _save_load,
    "drops": _drops,
    "stale_grid": _stale_grid,
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


def run_scenario(config: Preset, name: str, *, kind: str = "lora", bound_cap: int = 2) -> Measurements:
    """One fixed scenario on a fresh harness of checkpoint ``kind``, the invariant checked after every op."""
    harness = DerivativeHarness(config, kind=kind, bound_cap=bound_cap)
    SCENARIOS[name](_EachOpChecked(harness))  # type: ignore[arg-type]
    return harness.measured


# --- logical ranks (Rule 7) -------------------------------------------------------------------


def check_logical_ranks(config: Preset, logical_dp: int) -> float:
    """:func:`check_logical_normalisation` on ``config.processes`` processes (spawned, NCCL for a CUDA preset)."""
    if config.processes == 1:
        return check_logical_normalisation(config, logical_dp)
    backend = select_backend(config.device, torch.cuda.is_available())
    # A mutation under test is active in the ranks too (the mutation suite's runs, NOTE [Mutation verdicts]).
    errors = run_ranks(
        call_mutated,
        config.processes,
        active_mutations(),
        check_logical_normalisation,
        config,
        logical_dp,
        backend=backend,
        timeout_s=600.0,
        dist_timeout_s=120.0,
    )
    return max(errors)


def _all_processes(hosted: list[Any]) -> list[Any]:
    """Every process's hosted results, in logical-rank order (the hosted ones alone without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return hosted
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, hosted)
    return [value for part in parts for value in part]


def check_logical_normalisation(config: Preset, logical_dp: int = 2) -> float:
    """Rank mode: the loss normalised by ``global_token_count`` gives the oracle's gradient.

    Each logical rank backpropagates ``-sum(adv . logprobs) / global token
    count``; the sum of the logical buffers over every process (what
    ``optim_step`` adds to ``.grad``) must match the oracle's gradient of the
    globally normalised loss. Returns the worst relative error. Runs on every
    process of a job (each checks the same sum). The dropout masks are drawn
    from seed 0 whatever the process's initial seed (NOTE [Derivative canary]
    Rule 7); the caller's RNG is restored.
    """
    with torch.random.fork_rng():
        torch.manual_seed(0)  # run_logical seeds the logical ranks' streams from rank 0's initial seed
        return _logical_normalisation(config, logical_dp)


def _logical_normalisation(config: Preset, logical_dp: int) -> float:
    trainer, oracle = build_trainer(config)
    vocab = config.model.vocab_size
    data = {rank: sequences(80 + rank, [3 + 2 * rank, 4 + rank], vocab) for rank in range(logical_dp)}
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

    states = _all_processes(run_logical(body, trainer, logical_dp=logical_dp))
    tokens = sum(int((t >= 0).sum()) for items in data.values() for _, t, _ in items)
    terms = []
    for rank, items in data.items():
        cpu_rng, cuda_rng = states[rank]
        record = oracle.forward(
            NAME,
            [(ids, t) for ids, t, _ in items],
            rng_state=cpu_rng,
            cuda_rng_state=cuda_rng,
            bound=2,
            correction=None,
        )
        terms += [(record, row, -a / tokens) for row, (_, _, a) in enumerate(items)]
    backward = oracle.backward(terms)
    expected = backward.increments[NAME]
    checkpoint = trainer.checkpoint(NAME)
    trainer.rank_gradients.flush([checkpoint])  # the logical-order sum over every process, into .grad
    found = {n: p.grad.double() for n, p in checkpoint.named_parameters() if n in expected}
    comparison = judge_gradients(found, expected, backward.baselines[NAME], TOLERANCES[config.model.dtype], None)
    if not comparison.passed:
        raise CanaryFailure(
            f"logical ranks (L={logical_dp}): gradient of the globally normalised loss: {comparison.describe()}"
        )
    return comparison.worst[1]
