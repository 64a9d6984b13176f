"""Logical-rank scale: the gradient bytes logical ranks hold and move, over ``L`` and ``W``, full and LoRA.

One rank-mode step per layout on a tiny CPU model over gloo (the check is
about arithmetic and bytes, not about the preset's scale): each logical rank
forwards its own sequences and backpropagates its own loss. Read on every
process, through the harness's own witnesses:

- held: :func:`validation.memory.reachable_bytes` of ``trainer.rank_gradients``,
  sampled in every logical rank's ``fn`` just before its backward (the
  partial sums its process already folded this round) and after
  ``run_logical`` (at rest until ``optim_step``); bound
  ``(ceil(log2(L/W)) + 2) x`` the gradient bytes where ``L/W`` is a power of two;
- moved: ``rt.logical_traffic`` around the step, data collectives apart from
  control messages (metadata); bound ``2.2 x`` the gradient bytes received;
- bits: the parameters after the step equal for every ``W`` of one ``L``,
  and on one process ``.grad`` equals the pairwise tree (NOTE [Logical
  ranks] Rule 4, written again here) over each logical rank's gradient from
  a plain trainer.

A mutation active in the caller is applied again in the spawned ranks
(``canaries.mutations.catalogue.active_mutations``), so a bug in the
cross-process step shows.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch

import reference_trainer as rt
from validation.memory import reachable_bytes
from validation.trainers import trainer_with_policy
from validation.world import spawn_watched

from ..mutations.catalogue import active_mutations, applied

__all__ = ["HELD_CHECK", "BITS_CHECK", "MOVED_CHECK", "SCALE_CHECKS", "LAYOUTS", "scale_check", "scale_readings"]

SCALE_CHECKS = (
    "logical-rank scale: held gradient bytes <= (ceil(log2(L/W)) + 2) x gradient bytes",
    "logical-rank scale: bytes received per step <= 2.2 x gradient bytes (plus control)",
    "logical-rank scale: parameters equal for every W, .grad equal to the tree oracle on one process",
)
HELD_CHECK, MOVED_CHECK, BITS_CHECK = SCALE_CHECKS
LAYOUTS = {  # profile -> (logical_dp values, process counts); other profiles take "default"
    "quick": ((1, 2, 4, 8), (1, 2)),
    "default": ((1, 2, 4, 8, 16, 64), (1, 2, 4)),
}
MODEL_KINDS = ("full", "lora")
RECEIVED_FACTOR = 2.2


def _trainer(kind: str) -> rt.Trainer:
    return trainer_with_policy(rt.ModelConfig.tiny(dropout=0.0), lora=rt.LoRAConfig(rank=4) if kind == "lora" else None)


def _loss(trainer: rt.Trainer, logical_rank: int, forward: Any) -> torch.Tensor:
    """Logical rank ``logical_rank``'s loss on its own two sequences (``forward``: the view's or the trainer's)."""
    g = torch.Generator().manual_seed(1000 + logical_rank)
    vocab = rt.ModelConfig.tiny().vocab_size
    items = [rt.ForwardInput(torch.randint(0, vocab, (6 + (logical_rank + i) % 4,), generator=g)) for i in range(2)]
    outputs = forward(items)
    weights = [torch.randn(o.target_logprobs.shape, generator=g) for o in outputs]
    return -sum((o.target_logprobs * w).sum() for o, w in zip(outputs, weights)) / 100


def tree(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The oracle: ``tree(left) + tree(right)``, ``left`` the largest power of two below ``len(parts)``."""
    if len(parts) == 1:
        return parts[0]
    half = 1 << ((len(parts) - 1).bit_length() - 1)
    left, right = tree(parts[:half]), tree(parts[half:])
    return {n: left[n] + right[n] for n in left}


def _grads(trainer: rt.Trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in trainer.checkpoint("policy").named_parameters() if p.grad is not None}


def _one_layout(kind: str, logical_dp: int, oracle: bool) -> dict[str, Any]:
    trainer = _trainer(kind)
    held: list[int] = []

    def body(view: Any) -> None:
        loss = _loss(trainer, view.logical_rank, view.forward)
        held.append(reachable_bytes(trainer.rank_gradients))
        view.backward(loss)

    rt.run_logical(body, trainer, logical_dp=logical_dp)
    held.append(reachable_bytes(trainer.rank_gradients))
    trainer.optim_step()
    moved = rt.logical_traffic(trainer)  # this trainer's first layout: everything it ever sent or received
    params = trainer.checkpoint("policy").named_parameters()
    grad_bytes = sum(p.numel() * p.element_size() for _, p in trainer.checkpoint("policy").named_parameters())
    reading = {
        "grad_bytes": grad_bytes,
        "held_peak": max(held),
        "held_rest": held[-1],
        "received": sum(c.received for k, c in moved.items() if k != "control"),
        "control_received": moved["control"].received if "control" in moved else 0,
        "digest": hashlib.sha256(b"".join(p.detach().numpy().tobytes() for _, p in params)).hexdigest(),
    }
    if oracle:
        expected = tree([_plain_gradients(kind, rank) for rank in range(logical_dp)])
        found = _grads(trainer)
        reading["oracle_equal"] = found.keys() == expected.keys() and all(
            torch.equal(found[n], expected[n]) for n in found
        )
    return reading


def _plain_gradients(kind: str, logical_rank: int) -> dict[str, torch.Tensor]:
    trainer = _trainer(kind)
    trainer.backward(_loss(trainer, logical_rank, trainer.forward))
    return _grads(trainer)


def scale_readings(cases: list[tuple[str, int]], mutations: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Every ``(kind, L)`` case's reading on this process (every process of a job runs it); one intra-op thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    try:
        with applied(mutations):
            with torch.random.fork_rng():
                torch.manual_seed(0)
                return {
                    f"{kind}-L{logical_dp}": _one_layout(kind, logical_dp, oracle=world == 1)
                    for kind, logical_dp in cases
                }
    finally:
        torch.set_num_threads(threads)


def scale_check(profile: str, verdicts: Any) -> dict[str, Any]:
    """Run every layout of ``profile`` (W=1 here, W>1 spawned on gloo) and judge the three checks."""
    sizes, worlds = LAYOUTS.get(profile, LAYOUTS["default"])
    readings: dict[int, dict[str, dict[str, Any]]] = {}
    for world in worlds:
        cases = [(kind, size) for kind in MODEL_KINDS for size in sizes if size % world == 0]
        if world == 1:
            readings[1] = scale_readings(cases)
        else:
            ranks = spawn_watched(
                scale_readings, world, cases, active_mutations(), timeout_s=600.0, dist_timeout_s=120.0
            )
            readings[world] = _worst_rank(ranks)
    held_bad, moved_bad, bits_bad, rows = [], [], [], []
    for world, per_case in readings.items():
        for case, r in per_case.items():
            size = int(case.rsplit("L", 1)[1])
            per = size // world
            row = {"case": case, "W": world, **{k: v for k, v in r.items() if k != "digest"}}
            rows.append(row)
            if per & (per - 1) == 0:
                allowed = (math.ceil(math.log2(per)) + 2) * r["grad_bytes"]
                if r["held_peak"] > allowed:
                    held_bad.append(f"{case} W={world}: {r['held_peak']} > {allowed}")
                if r["received"] > RECEIVED_FACTOR * r["grad_bytes"]:
                    moved_bad.append(f"{case} W={world}: {r['received']} > {RECEIVED_FACTOR} x {r['grad_bytes']}")
            if world > 1 and r["digest"] != readings[1][case]["digest"]:
                bits_bad.append(f"{case}: W={world} differs from W=1 (or its processes disagree)")
            if r.get("oracle_equal") is False:
                bits_bad.append(f"{case}: .grad differs from the tree oracle")
    count = sum(len(v) for v in readings.values())
    verdicts.check(HELD_CHECK, not held_bad, "; ".join(held_bad) or f"{count} layouts within the bound")
    verdicts.check(MOVED_CHECK, not moved_bad, "; ".join(moved_bad) or f"{count} layouts within the bound")
    verdicts.check(BITS_CHECK, not bits_bad, "; ".join(bits_bad) or f"{count} layouts bitwise equal")
    return {"layouts": rows}


def _worst_rank(ranks: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per case: the largest held and received bytes over the processes; a digest only if every process agrees."""
    merged = {}
    for case in ranks[0]:
        readings = [r[case] for r in ranks]
        digests = {r["digest"] for r in readings}
        merged[case] = {
            **readings[0],
            "digest": digests.pop() if len(digests) == 1 else None,
            **{k: max(r[k] for r in readings) for k in ("held_peak", "held_rest", "received", "control_received")},
        }
    return merged
