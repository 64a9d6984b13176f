"""What a refused call must leave as it was: a trainer's state, snapshotted and compared.

:meth:`TrainerState.of` takes everything NOTE [Intersection checks] Rule 2
names (parameters, ``.grad`` objects and values, the logical-rank buffers,
the pending records and their placements, the caller's RNG, revisions,
generations and the optimizer state); :meth:`TrainerState.differences`
names what changed between two snapshots, one phrase each. The refused-call
checks of ``canaries.derivative.intersections`` take one before and one
after each call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import reference_trainer as rt
from reference_trainer.ranks import logical_gradients

__all__ = ["TrainerState"]


@dataclass
class TrainerState:
    """Everything a refused call must leave as it was (NOTE [Intersection checks] Rule 2)."""

    params: dict[str, torch.Tensor]
    grads: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]  # (object, value)
    buffers: dict[tuple[str, str], torch.Tensor]  # this process's shards of the pending logical-rank sums
    records: dict[int, tuple[str, Any, str, Any]]  # id -> (checkpoint, version, placement, usage)
    rng: torch.Tensor
    versions: dict[str, tuple[int, int]]
    optimizer: dict[str, Any]

    @classmethod
    def of(cls, trainer: rt.Trainer) -> TrainerState:
        checkpoints = trainer.checkpoints
        named = [(f"{c}.{n}", p) for c, ckpt in checkpoints.items() for n, p in ckpt.named_parameters()]
        return cls(
            params={n: p.detach().clone() for n, p in named},
            grads={n: (p.grad, None if p.grad is None else p.grad.detach().clone()) for n, p in named},
            buffers=logical_gradients(trainer),
            records={
                r.id: (
                    r.checkpoint.name,
                    r.version,
                    "replay" if r.ledger is None else r.ledger.placement.value,
                    r.usage,
                )
                for r in trainer.records
            },
            rng=torch.get_rng_state(),
            versions={c: (ckpt.revision, ckpt.generation) for c, ckpt in checkpoints.items()},
            optimizer={c: ckpt.state_dict().get("optimizer") for c, ckpt in checkpoints.items()},
        )

    def differences(self, after: TrainerState) -> list[str]:
        """What changed from ``self`` to ``after``, one phrase each (empty: nothing)."""
        found = []
        changed = [n for n in self.params if not torch.equal(self.params[n], after.params[n])]
        found += [f"parameters changed ({len(changed)}, first {changed[0]})"] if changed else []
        replaced = [n for n, (obj, _) in self.grads.items() if after.grads[n][0] is not obj]
        found += [f".grad objects replaced ({len(replaced)}, first {replaced[0]})"] if replaced else []
        values = [
            n
            for n, (_, v) in self.grads.items()
            if v is not None and after.grads[n][1] is not None and not torch.equal(v, after.grads[n][1])
        ]
        found += [f".grad values changed ({len(values)} of {len(self.grads)}, first {values[0]})"] if values else []
        if self.buffers.keys() != after.buffers.keys() or any(
            not torch.equal(v, after.buffers[k]) for k, v in self.buffers.items()
        ):
            found.append(f"logical-rank sums changed ({len(self.buffers)} tensors before, {len(after.buffers)} after)")
        if self.records != after.records:
            found.append(f"records or placements changed: {_placements(self.records)} -> {_placements(after.records)}")
        found += ["the global RNG advanced"] if not torch.equal(self.rng, after.rng) else []
        found += [f"revision/generation {self.versions} -> {after.versions}"] if self.versions != after.versions else []
        if not _same_nested(self.optimizer, after.optimizer):
            found.append("optimizer state changed")
        return found


def _placements(records: dict[int, tuple]) -> dict[int, str]:
    return {rid: entry[2] for rid, entry in records.items()}


def _same_nested(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_nested(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_nested(x, y) for x, y in zip(a, b))
    return a == b
