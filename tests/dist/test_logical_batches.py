"""The previous logical batch (inputs, outputs, graphs) is dead before the next physical micro-batch is pulled.

The source iterator is the witness: at every pull it checks weak references
to everything the previous logical batch held. Negative controls show the
witness fires when a reference survives.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import dist_scenarios as ds
import pytest
import torch

import reference_trainer as rt
from reference_trainer.ranks import LogicalBatch, logical_batches


class Witness:
    """Weak references to the last logical batch's pieces; ``source()`` checks them before each pull."""

    def __init__(self, trainer: rt.Trainer) -> None:
        self.trainer = trainer
        self.watched: list[tuple[str, weakref.ref]] = []
        self.pulls = 0

    def watch(self, batch: LogicalBatch) -> None:
        self.watched = [("logical batch", weakref.ref(batch))]
        for index, output in enumerate(batch.outputs):
            self.watched.append((f"output {index}", weakref.ref(output.target_logprobs)))
            record = self.trainer.records.get(output.record_id)
            if record is not None:  # pending graphs: the record and its graph root
                self.watched.append((f"graph record {record.id}", weakref.ref(record)))
                self.watched.append((f"graph root of record {record.id}", weakref.ref(record.root)))
        for index, item in enumerate(batch.micro_batches):
            self.watched.append((f"micro-batch {index} tokens", weakref.ref(item.input_tokens)))

    def source(self, count: int, *, skip: tuple[str, ...] = ()) -> Iterator[rt.ForwardInput]:
        for i in range(count):
            alive = [name for name, ref in self.watched if ref() is not None and not name.startswith(skip)]
            assert not alive, f"before pulling micro-batch {i}, the previous logical batch still holds {alive}"
            self.pulls += 1
            yield rt.ForwardInput(torch.arange(1, 5 + i % 3) % 64)


def train_on(batches: Iterator[LogicalBatch], trainer: rt.Trainer, witness: Witness, keep: list[Any] | None = None) -> None:
    for batch in batches:
        batch.outputs = trainer.forward(list(batch.micro_batches))
        # Backpropagate half: the other half's graphs stay pending until the batch is released.
        batch.loss = -sum(o.target_logprobs.sum() for o in batch.outputs[: len(batch.outputs) // 2])
        trainer.backward(batch.loss)
        witness.watch(batch)
        if keep is not None:
            keep.append(batch.outputs)
        del batch  # the caller's own reference; the generator must hold none


def test_previous_batch_its_outputs_and_graphs_are_dead_before_the_next_pull() -> None:
    trainer = ds.make_trainer()
    witness = Witness(trainer)
    train_on(logical_batches(witness.source(8), size=4), trainer, witness)
    assert witness.pulls == 8
    assert trainer.live_records() == 0


def test_a_batch_kept_by_the_loop_variable_is_emptied_before_the_next_pull() -> None:
    trainer = ds.make_trainer()
    witness = Witness(trainer)
    shells = []
    for batch in logical_batches(witness.source(9), size=3):  # no del: the loop variable keeps the batch
        batch.outputs = trainer.forward(list(batch.micro_batches))
        witness.watch(batch)
        witness.watched = [(n, r) for n, r in witness.watched if n != "logical batch"]
        shells.append(batch)  # the object may live on; what it held may not
    assert witness.pulls == 9 and len(shells) == 3
    assert all(shell.released for shell in shells)
    assert trainer.live_records() == 0
    with pytest.raises(rt.ConfigError, match="released"):
        shells[0].outputs  # noqa: B018


def test_witness_fires_when_the_generator_keeps_the_previous_batch() -> None:
    """Negative control: the pre-fix iterator held the yielded batch in a local while pulling the next one."""

    def leaky(source: Iterator[Any], size: int) -> Iterator[LogicalBatch]:
        previous = None
        while True:
            pulled = [item for _, item in zip(range(size), source)]
            if not pulled:
                return
            previous = LogicalBatch(0, pulled)  # noqa: F841 - the leak under test
            yield previous

    trainer = ds.make_trainer()
    witness = Witness(trainer)
    with pytest.raises(AssertionError, match="still holds"):
        train_on(leaky(witness.source(8), 4), trainer, witness)


def test_witness_fires_when_the_caller_keeps_the_outputs() -> None:
    """Negative control: outputs the caller keeps outside the batch keep their graphs alive."""
    trainer = ds.make_trainer()
    witness = Witness(trainer)
    with pytest.raises(AssertionError, match="output"):
        train_on(logical_batches(witness.source(8), size=4), trainer, witness, keep=[])


def test_short_last_batch_drop_last_and_shards() -> None:
    batches = [b.micro_batches for b in logical_batches(range(7), size=3)]
    assert batches == [[0, 1, 2], [3, 4, 5], [6]]
    assert [b.micro_batches for b in logical_batches(range(7), size=3, drop_last=True)] == [[0, 1, 2], [3, 4, 5]]
    generator = logical_batches(range(5), size=5)  # dropping the generator would release its batch
    batch = next(generator)
    assert [batch.shard(rank, 2) for rank in range(2)] == [[0, 1, 2], [3, 4]]
    with pytest.raises(rt.ConfigError):
        logical_batches(range(3), size=0)


def test_closing_the_generator_releases_the_last_batch() -> None:
    batches = logical_batches(range(6), size=2)
    first = next(batches)
    first.outputs = ["anything"]
    batches.close()
    assert first.released
