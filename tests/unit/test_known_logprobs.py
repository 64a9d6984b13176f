"""The ``when_available`` cache with default options (NOTE [Importance correction] Rules 6-8).

A logical rank is corrected only with log-probs its own forwards computed
(so results do not depend on how many processes host the logical ranks);
the cache keeps only what a pending record can still use (its size does not
grow with the number of iterations); a forward with nothing older pending
reads no token keys on the host; and log-probs drawn with dropout masks are
never compared with log-probs of another forward.
"""

from __future__ import annotations

import gc

import pytest
import torch

import reference_trainer as rt
from reference_trainer.ranks import run_logical
from reference_trainer.testing import observe_host_reads
from tests.support import sequence


def _trainer(*, dropout: float = 0.0, lr: float = 1e-2) -> rt.Trainer:
    """Default trainer options: one ``ImportanceCorrection()`` with the ``when_available`` policy."""
    trainer = rt.Trainer(rt.DecoderLM(rt.ModelConfig.tiny(dropout=dropout), seed=0))
    trainer.add_checkpoint("policy", full=True, optimizer=rt.AdamWConfig(lr=lr))
    return trainer


def _item(seed: int) -> rt.ForwardInput:
    return rt.ForwardInput(*sequence(seed))


def _step(trainer: rt.Trainer, seed: int, lr: float | None = None) -> None:
    """A fresh forward/backward of other tokens and a step, so the revision moves."""
    out = trainer.forward(_item(seed))
    trainer.backward(-out.target_logprobs.sum())
    trainer.optim_step(lr=lr)
    trainer.zero_grad()


# --- defect 1: one cache per logical rank ------------------------------------------------------


def test_a_logical_rank_is_corrected_only_with_logprobs_its_own_forwards_computed() -> None:
    trainer = _trainer()
    shared = _item(1)  # both logical ranks forward these tokens
    kept = {}

    def first(view) -> None:
        kept[view.logical_rank] = view.forward(shared)  # pending across the step
        fresh = view.forward(_item(10 + view.logical_rank))
        view.backward(-fresh.target_logprobs.sum())

    def second(view) -> dict[int, bool]:
        if view.logical_rank == 0:  # logical rank 0 scores the shared tokens again at the current revision
            again = view.forward(shared)
            report = view.backward(-(kept[0].target_logprobs.sum() + again.target_logprobs.sum()))
        else:
            report = view.backward(-kept[1].target_logprobs.sum())
        return {r.staleness: r.correction is not None for r in report.records}

    run_logical(first, trainer, logical_dp=2)
    trainer.optim_step()
    trainer.zero_grad()
    corrected = run_logical(second, trainer, logical_dp=2)
    # Rank 0's own later forward corrects its stale record; rank 1 has none of its own. Two
    # processes (W=2) give the same: the dist test compares them (test_logical_invariance).
    assert corrected == [{1: True, 0: False}, {1: False}]


# --- defect 2: bounded by what can still be used --------------------------------------------------


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))  # type(): no proxy __class__


@pytest.mark.parametrize("repeated", [False, True], ids=["new-tokens", "a-repeated-row"])
def test_the_one_step_stale_loop_keeps_no_more_tensors_as_it_goes(repeated: bool) -> None:
    """Forward batch k, backward batch k-1, step: a record is always pending, so nothing is ever idle.

    With new tokens each batch nothing is usable; with one row repeated in every
    batch it is used every step (the loop is corrected), and only that row is kept.
    """
    trainer = _trainer()
    previous = None
    counts, corrected = {}, 0
    for k in range(20):
        batch = [_item(1000 + k)] + ([_item(1)] if repeated else [_item(2000 + k)])
        outputs = trainer.forward(batch)
        if previous is not None:
            report = trainer.backward(-sum(o.target_logprobs.sum() for o in previous))
            corrected += len(report.corrected)
            trainer.optim_step()
            trainer.zero_grad()
        previous = outputs
        del outputs
        if k in (6, 19):
            counts[k] = _live_tensors()
    assert counts[19] <= counts[6], f"tensors alive grew from {counts[6]} to {counts[19]} in 13 iterations"
    assert corrected == (18 if repeated else 0)  # every backward but the first, which is fresh


def _unusable_rows_schedule(trainer: rt.Trainer) -> list[int]:
    """A stale record of X stays pending; X is scored again at revision 1, then the revision moves
    on, then other tokens Y are forwarded and backpropagated; then X is scored at revision 2 and the
    stale record backpropagated. Tensors alive after Y's forward, after its backward and after the
    stale record's backward, relative to the start."""
    stale = trainer.forward(_item(1))
    _step(trainer, seed=50)
    start = _live_tensors()
    again = trainer.forward(_item(1))  # usable by the stale record while revision 1 is current
    trainer.backward(-again.target_logprobs.sum())
    del again
    trainer.optim_step()  # revision 2: X's revision-1 log-probs can never be used
    trainer.zero_grad()
    other = trainer.forward(_item(2))  # nothing pending has Y's tokens: none of its rows is usable
    counts = [_live_tensors()]
    trainer.backward(-other.target_logprobs.sum())
    del other
    counts.append(_live_tensors())
    again = trainer.forward(_item(1))  # X at revision 2: usable by the stale record ...
    trainer.backward(-stale.target_logprobs.sum())  # ... which uses it and is gone: nothing can use it now
    counts.append(_live_tensors())
    del again, stale
    return [c - start for c in counts]


def test_rows_no_pending_record_can_use_are_not_kept() -> None:
    """Against a twin without corrections run through the same schedule: no extra tensor is alive,
    neither the revision-1 rows of X, nor a copy of Y's rows, nor X's rows once their last user is gone."""
    plain = rt.Trainer(rt.DecoderLM(rt.ModelConfig.tiny(), seed=0), options=rt.ForwardOptions(corrections=()))
    plain.add_checkpoint("policy", full=True, optimizer=rt.AdamWConfig(lr=1e-2))
    assert _unusable_rows_schedule(_trainer()) == _unusable_rows_schedule(plain)


# --- let-through: no token keys read without an older record pending ------------------------------


def test_same_revision_forwards_with_default_options_read_no_token_keys() -> None:
    """Two micro-batches per step, both pending at one revision, then one backward: nothing older is
    pending at any forward, so no forward reads its token keys (a GPU sync each on a device)."""
    trainer = _trainer()
    with observe_host_reads() as reads:
        for k in range(4):
            first, second = trainer.forward(_item(2 * k)), trainer.forward(_item(2 * k + 1))
            trainer.backward(-(first.target_logprobs.sum() + second.target_logprobs.sum()))
            trainer.optim_step()
            trainer.zero_grad()
    assert [why for why, _ in reads if why == "token keys"] == []


# --- defect 12: dropout masks ------------------------------------------------------------------------


def _stale_then_again(trainer: rt.Trainer, lr: float | None) -> tuple[rt.BackwardReport, torch.Tensor]:
    """Forward X, step (``lr``), forward X again, backward the stale X; returns the report and the
    later forward's log-ratio over the stale one's."""
    old = trainer.forward(_item(1))
    _step(trainer, seed=50, lr=lr)
    new = trainer.forward(_item(1))
    report = trainer.backward(-old.target_logprobs.sum())
    return report, (new.target_logprobs - old.target_logprobs).detach()


def test_when_available_never_compares_logprobs_drawn_with_dropout_masks() -> None:
    """Unchanged weights (lr=0), dropout on: any weight but 1 would be dropout noise, so nothing is corrected."""
    trainer = _trainer(dropout=0.1)
    report, log_ratio = _stale_then_again(trainer, lr=0.0)
    assert bool((log_ratio != 0).any()), "the two forwards drew different masks"
    assert report.records[0].staleness == 1 and report.corrected == []


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout-in-eval-mode"])
def test_when_available_corrects_logprobs_drawn_without_masks(dropout: float) -> None:
    # lr=0: the same weights give the same log-probs, so every weight is exactly 1.
    trainer = _trainer(dropout=dropout)
    trainer.model.eval()
    report, log_ratio = _stale_then_again(trainer, lr=0.0)
    assert bool((log_ratio == 0).all())
    (stats,) = [r.correction for r in report.corrected]
    assert stats.mean == 1.0 and stats.max == 1.0 and stats.fraction_clipped == 0.0
    # lr > 0: the weights are the clipped ratios of the later forward over the stale one.
    trainer = _trainer(dropout=dropout)
    trainer.model.eval()
    report, log_ratio = _stale_then_again(trainer, lr=None)
    (stats,) = [r.correction for r in report.corrected]
    weights = log_ratio.double().exp().clamp(0.0, 5.0)
    assert stats.tokens == weights.numel() and float(weights.std()) > 1e-3
    assert stats.mean == pytest.approx(float(weights.mean()), rel=1e-6)
    assert stats.max == pytest.approx(float(weights.max()), rel=1e-6)
