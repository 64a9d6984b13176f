"""The derivative canary's intersection checks: where two features meet.

Each feature alone is judged by the scenarios and the exploration
(``canaries.derivative.scenarios``, ``canaries.derivative.machine``); these
checks put two together, cheaply and deterministically, where the trainer's
own tests did not look. :data:`INTERSECTIONS` maps a check name to a function
of the preset (``canaries.derivative.canary`` runs them after the fixed scenarios);
the building blocks take a trainer factory so tests can feed them a broken
trainer (negative controls).

NOTE [Intersection checks]
  1. Logical ranks with the default options: a schedule of logical ranks
     sharing token content (rank r forwards at step k what rank r + 1 did at
     k - 1), backwards one step stale, corrections on (``when_available``,
     so without dropout: it pairs only maskless forwards), gives the same
     parameter bits, staleness and corrected flags per logical rank at W = 1
     and W = 2 (two gloo processes). With ``corrections=()`` the same
     comparison is the control that holds on any correct trainer.
  2. Refused calls change nothing: each call of :data:`REFUSED_CALLS`, made
     on a trainer holding everything at once (a live ``.grad`` one revision
     old, logical-rank buffers, a pending retained record, a memory limit),
     raises a ``TrainerError`` and leaves parameters, ``.grad`` (objects and
     values), buffers, pending records and placements, the caller's RNG,
     revisions, generations and optimizer state exactly as they were
     (:class:`TrainerState`).
  3. FP64 models keep FP64 arithmetic end to end: the stale scenario is
     judged by the FP64 oracle at FP64 tolerances, and ``optim_step(lr=0)``
     leaves the parameters bitwise unchanged and reports the FP64 norm of
     ``.grad`` (relative 1e-12).
  4. Committed gradients meeting a later call (a flush onto a live
     ``.grad``, a ``.grad`` dropped before the step, a load while another
     checkpoint is busy): NOTE [Gradient intersections] in
     ``canaries.derivative.gradients``, run last.
  5. ``when_available`` with dropout and unchanged weights (``lr=0``): a stale
     record whose tokens a later forward scored with other masks is not
     corrected, or only with every weight exactly 1 (NOTE [Importance
     correction] Rule 8).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import reference_trainer as rt
from reference_trainer.ranks import logical_gradients, run_logical
from validation.trainers import POLICY, trainer_with_policy
from validation.world import run_ranks

from ..mutations.catalogue import active_mutations, call_mutated
from ..presets import Preset
from .gradients import GRADIENT_INTERSECTIONS
from .oracle_pair import CanaryFailure, sequences
from .scenarios import run_scenario
from .trainer_state import TrainerState

__all__ = [
    "Busy",
    "busy_trainer",
    "plain_trainer",
    "admission_limit",
    "TrainerState",
    "REFUSED_CALLS",
    "check_refused_call",
    "logical_run",
    "check_logical_default_options",
    "check_fp64_lr0_step",
    "check_when_available_dropout",
    "fp64_preset",
    "tiny_model",
    "INTERSECTIONS",
]

TrainerFactory = Callable[..., rt.Trainer]  # (preset, memory_limit_bytes=...) -> a trainer with checkpoint "policy"
_VOCAB = rt.ModelConfig.tiny().vocab_size


def _digest(trainer: rt.Trainer) -> str:
    sha = hashlib.sha256()
    for name, param in trainer.checkpoint("policy").named_parameters():
        sha.update(name.encode())
        sha.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()[:16]


# --- Rule 1: logical ranks at W = 1 and W = 2 with the default options -----------------------

_STEPS = 3


def tiny_model(config: Preset, dtype: torch.dtype = torch.float32) -> rt.ModelConfig:
    """The shape every intersection check runs on, whatever the preset: tiny, with the preset's dropout.

    The intersections are about semantics, not scale; on a GPU preset the 8B shape in FP64 would not fit.
    """
    return rt.ModelConfig.tiny(dtype=dtype, dropout=config.model.dropout)


def _logical_trainer(config: Preset) -> rt.Trainer:
    # Without dropout: ``when_available`` never pairs forwards that drew masks (NOTE [Importance correction]
    # Rule 8), so with dropout the default options would correct nothing and the cache's scope could not show.
    return trainer_with_policy(tiny_model(config).replace(dropout=0.0), optimizer=rt.AdamWConfig(lr=1e-2))


def logical_run(config: Preset, logical_dp: int) -> dict[str, dict[str, Any]]:
    """The Rule 1 schedule on this process's logical ranks, with ``corrections=()`` (``"control"``) and with
    the default options (``"default"``): each the digest and, per (step, logical rank), the ``(staleness,
    corrected)`` of each record its stale backward consumed. The caller's RNG and thread count are restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bitwise comparisons across processes want one kernel schedule
    try:
        runs = {}
        for label, options in (("control", rt.ForwardOptions(corrections=())), ("default", None)):
            with torch.random.fork_rng():
                torch.manual_seed(0)  # run_logical seeds the logical ranks' streams from rank 0's initial seed
                runs[label] = _train_logical(config, logical_dp, options)
        return runs
    finally:
        torch.set_num_threads(threads)


def _train_logical(config: Preset, logical_dp: int, options: rt.ForwardOptions | None) -> dict[str, Any]:
    trainer = _logical_trainer(config)
    pending: dict[tuple[int, int], tuple] = {}
    flags: dict[str, list[tuple[int, bool]]] = {}
    for step in range(_STEPS):

        def body(view: Any, step: int = step) -> None:
            rank = view.logical_rank
            data = sequences(500 + step + rank, [6, 4], _VOCAB)  # rank r + 1's of the step before
            outs = view.forward([rt.ForwardInput(ids, t) for ids, t, _ in data], options=options)
            count = view.global_token_count([t >= 0 for _, t, _ in data])
            pending[(step, rank)] = (outs, [a for _, _, a in data], count)
            stale = pending.pop((step - 1, rank), None)
            if stale is not None:
                outputs, advantages, tokens = stale
                loss = -sum((o.target_logprobs * a).sum() for o, a in zip(outputs, advantages)) / tokens
                report = view.backward(loss)
                flags[f"{step}/{rank}"] = [(r.staleness, r.correction is not None) for r in report.records]

        run_logical(body, trainer, logical_dp=logical_dp)
        trainer.optim_step()
        trainer.zero_grad()
    return {"digest": _digest(trainer), "flags": flags}


def _compare(label: str, one: dict[str, Any], two: list[dict[str, Any]], logical_dp: int) -> None:
    what = f"logical ranks L={logical_dp} ({'default options' if label == 'default' else 'corrections=()'})"
    if not any(staleness > 0 for records in one["flags"].values() for staleness, _ in records):
        raise CanaryFailure(f"{what}: expected stale backwards, found none in {one['flags']}")
    flags_two = dict(sorted((k, v) for part in two for k, v in part["flags"].items()))
    if flags_two != one["flags"]:
        raise CanaryFailure(
            f"{what}: (staleness, corrected) per step/logical rank: expected W=1's {one['flags']} "
            f"at W={len(two)} too, found {flags_two}"
        )
    digests = {part["digest"] for part in two}
    if digests != {one["digest"]}:
        raise CanaryFailure(
            f"{what}: parameter digest: expected W=1's {one['digest']} at W={len(two)}, found {sorted(digests)}"
        )


def check_logical_default_options(config: Preset, logical_dp: int = 2) -> int:
    """Rule 1: W=1 and W=2 (or the preset's process count, when more) agree with ``corrections=()`` (the
    control, first) and with the default options; the number of stale records compared."""
    processes = max(2, config.processes)
    logical_dp = -(-max(logical_dp, processes) // processes) * processes
    one = logical_run(config, logical_dp)
    two = run_ranks(
        call_mutated,
        processes,
        active_mutations(),
        logical_run,
        config,
        logical_dp,
        timeout_s=300.0,
        dist_timeout_s=60.0,
    )
    for label in ("control", "default"):
        _compare(label, one[label], [part[label] for part in two], logical_dp)
    return sum(staleness > 0 for records in one["default"]["flags"].values() for staleness, _ in records)


# --- Rule 2: refused calls change nothing -------------------------------------------------------


def _item(seed: int, length: int, config: Preset, options: rt.ForwardOptions | None = None) -> rt.ForwardInput:
    ((ids, targets, _),) = sequences(seed, [length], _VOCAB)
    return rt.ForwardInput(ids, targets, options=options)


_STRICT = rt.ForwardOptions(max_gradient_staleness=0)
_RETAIN = rt.ForwardOptions(backward_state="retain")


@dataclass
class Busy:
    """A trainer holding everything at once (Rule 2), and the pending outputs that keep its records alive."""

    trainer: rt.Trainer
    config: Preset
    outputs: list[Any]


def busy_trainer(config: Preset, make: TrainerFactory, *, memory_limit_bytes: int | None = None) -> Busy:
    """A full FP32 checkpoint with: a strict (bound 0) ``.grad`` one revision old, logical-rank buffers of
    both logical ranks, and one pending retained record (NOTE [Intersection checks] Rule 2)."""
    trainer = make(config, memory_limit_bytes=memory_limit_bytes)
    out = trainer.forward(_item(700, 6, config), options=_STRICT)
    trainer.backward(-out.target_logprobs.sum())
    trainer.optim_step()  # .grad stays: its origin is now one revision old for a bound of 0

    def body(view: Any) -> None:
        (outs,) = [view.forward([_item(710 + view.logical_rank, 5, config)])]
        view.backward(-outs[0].target_logprobs.sum())

    run_logical(body, trainer, logical_dp=2)
    pending = trainer.forward([_item(720, 6, config)])  # auto: retained while the limit allows
    return Busy(trainer, config, pending)


def plain_trainer(config: Preset, **limits: Any) -> rt.Trainer:
    return trainer_with_policy(tiny_model(config), optimizer=rt.AdamWConfig(lr=1e-2), **limits)


def _two_group_forward(busy: Busy) -> Any:
    """Group 1 (auto) makes room by demoting the pending record; group 2 (forced retain) is refused."""
    c = busy.config
    # Group 2 saves twice what group 1 does: no plan of the whole call fits it.
    return busy.trainer.forward([_item(730, 6, c), _item(731, 12, c, _RETAIN)])


def _bad_state_load(busy: Busy) -> None:
    state = busy.trainer.checkpoint("policy").state_dict()
    name = next(iter(state["parameters"]))
    state["parameters"][name] = state["parameters"][name][:1].clone()  # wrong shape
    busy.trainer.load_checkpoint("policy", state, discard_graphs=True)


def _bad_optimizer_load(busy: Busy) -> None:
    state = busy.trainer.checkpoint("policy").state_dict()  # a copy: the live AdamW state is not touched
    slots = state["optimizer"]["state"]
    first = next(iter(slots))
    slots[first] = {k: v for k, v in slots[first].items() if k != "exp_avg"}  # an AdamW state that cannot step
    busy.trainer.load_checkpoint("policy", state, discard_graphs=True)


REFUSED_CALLS: dict[str, Callable[[Busy], Any]] = {
    "optim_step over a stale live .grad with logical-rank buffers pending": lambda b: b.trainer.optim_step(),
    "forward whose second option group is refused by admission": _two_group_forward,
    "load_checkpoint of a wrong-shape state (discard_graphs=True)": _bad_state_load,
    "load_checkpoint of an AdamW state without exp_avg (discard_graphs=True)": _bad_optimizer_load,
    "load_checkpoint while records and gradients are pending": lambda b: b.trainer.load_checkpoint(
        "policy", b.trainer.checkpoint("policy").state_dict()
    ),
    "optim_step(lr=-1)": lambda b: b.trainer.optim_step(lr=-1.0),
    "forward with an out-of-range token": lambda b: b.trainer.forward(rt.ForwardInput(torch.tensor([1, _VOCAB]))),
    "forward of an unknown checkpoint": lambda b: b.trainer.forward(_item(740, 3, b.config), checkpoint="nope"),
    "zero_grad of an unknown checkpoint": lambda b: b.trainer.zero_grad(checkpoints=["nope"]),
}


def admission_limit(config: Preset, make: TrainerFactory) -> int:
    """A device limit one byte under what retaining group 1 of :func:`_two_group_forward` needs on a busy
    trainer: group 1 fits only by demoting the pending record, and group 2 (forced retain) not at all."""
    busy = busy_trainer(config, make)
    first = busy.trainer.forward([_item(730, 6, config)])
    return first[0].decision.predicted_bytes - 1


def check_refused_call(config: Preset, name: str, make: TrainerFactory = plain_trainer) -> str:
    """Rule 2 for one refused call: it raises a ``TrainerError`` and changes nothing; the error's type."""
    busy = busy_trainer(config, make, memory_limit_bytes=admission_limit(config, make))
    placements = {entry[2] for entry in TrainerState.of(busy.trainer).records.values()}
    if (
        placements != {"retain"}
        or not logical_gradients(busy.trainer)
        or not busy.trainer.checkpoint("policy").has_gradients()
    ):
        raise CanaryFailure(
            f"refused call {name!r}: expected a busy trainer (a retained record, logical-rank "
            f"buffers, a live .grad), found placements {placements}"
        )
    before = TrainerState.of(busy.trainer)
    try:
        REFUSED_CALLS[name](busy)
    except rt.TrainerError as error:
        error.__traceback__ = None
        refused = type(error).__name__
    else:
        raise CanaryFailure(f"{name}: expected a TrainerError (refused), found success")
    changed = before.differences(TrainerState.of(busy.trainer))
    if changed:
        raise CanaryFailure(
            f"{name}: refused with {refused}; expected the state unchanged, found: " + "; ".join(changed)
        )
    return refused


# --- Rule 3: FP64 models ---------------------------------------------------------------------------


def fp64_preset(config: Preset) -> Preset:
    """``config`` with the tiny model in FP64 (the oracle's own precision), on the preset's device."""
    return dataclasses.replace(config, model=tiny_model(config, torch.float64), oracle_layers=None)


def check_fp64_lr0_step(config: Preset) -> float:
    """Rule 3: ``optim_step(lr=0)`` on an FP64 full checkpoint leaves every parameter bitwise unchanged and
    reports the FP64 norm of ``.grad``; the norm's relative error."""
    trainer = trainer_with_policy(tiny_model(config, torch.float64))
    checkpoint = trainer.checkpoint(POLICY)
    out = trainer.forward([_item(750, 7, config), _item(751, 4, config)])
    trainer.backward(-sum(o.target_logprobs.sum() for o in out))
    before = {n: p.detach().clone() for n, p in checkpoint.named_parameters()}
    expected = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in checkpoint.parameters()])))
    report = trainer.optim_step(lr=0.0)["policy"]
    changed = [n for n, p in checkpoint.named_parameters() if not torch.equal(p.detach(), before[n])]
    if changed:
        raise CanaryFailure(
            f"FP64 optim_step(lr=0): expected every parameter bitwise unchanged, found "
            f"{len(changed)} of {len(before)} changed (first {changed[0]})"
        )
    error = abs(report.grad_norm - expected) / expected
    if error > 1e-12:
        raise CanaryFailure(
            f"FP64 optim_step: grad norm: expected the FP64 norm {expected!r}, found "
            f"{report.grad_norm!r} (relative error {error:.2e})"
        )
    return error


# --- Rule 5: when_available and dropout ----------------------------------------------------------------


def check_when_available_dropout(config: Preset) -> int:
    """Rule 5: with dropout on and unchanged weights (``lr=0``), a stale record of the default options is not
    corrected, or only with every weight 1; the number of records the stale backward consumed."""
    trainer = trainer_with_policy(rt.ModelConfig.tiny(dropout=0.1), optimizer=rt.AdamWConfig(lr=0.0))  # masks drawn
    stale = trainer.forward(_item(760, 7, config))
    trainer.backward(-trainer.forward(_item(761, 5, config)).target_logprobs.sum())
    trainer.optim_step()  # revision 1, the weights unchanged
    fresh = trainer.forward(_item(760, 7, config))  # the stale record's tokens, other dropout masks
    report = trainer.backward(-stale.target_logprobs.sum())
    for record in report.records:
        stats = record.correction
        if record.staleness != 1 or (stats is not None and (stats.mean, stats.max) != (1.0, 1.0)):
            raise CanaryFailure(
                f"when_available with dropout, lr=0: expected a record one step stale, uncorrected "
                f"or with weights 1, found staleness {record.staleness}, weights {stats}"
            )
    del fresh
    return len(report.records)


def _fp64_scenario(config: Preset) -> Any:
    return run_scenario(fp64_preset(config), "stale_exact", kind="full")


INTERSECTIONS: dict[str, Callable[[Preset], Any]] = {
    "intersection: logical ranks give the same bits and corrections at W=1 and W=2 (default options)": check_logical_default_options,
    **{
        f"intersection: refused {name} changes nothing": (lambda config, name=name: check_refused_call(config, name))
        for name in REFUSED_CALLS
    },
    "intersection: FP64 stale scenario matches the FP64 oracle at FP64 tolerance": _fp64_scenario,
    "intersection: FP64 optim_step(lr=0) changes no parameter and reports the FP64 norm": check_fp64_lr0_step,
    "intersection: when_available with dropout and unchanged weights reweights nothing": check_when_available_dropout,
    **GRADIENT_INTERSECTIONS,  # NOTE [Gradient intersections]
}
