"""Importance correction inside the trainer (docs/semantics.md#importance-correction, NOTE [Importance correction]).

FP64 models throughout, so ``target_logprobs`` are FP64 and every expected
gradient is recomputed independently (``validation.oracle.plain_gradients``) to
1e-12 relative: the gradient at the *forward's* weights of a loss whose
per-token cotangent is multiplied by ``clip(exp(lp_current - lp_forward))``,
with ``lp_current`` from a plain forward at the current weights. The bounds
(0.85, 1.25) clip some tokens and leave others, so both branches are exercised;
bounds that exclude 1 prove that fresh records are left alone.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

import reference_trainer as rt
from reference_trainer.ranks import run_logical
from reference_trainer.testing import observe_host_reads
from tests.support import sequence, train_step
from validation.oracle import WeightsAt, plain_gradients, relative_error, snapshot_weights
from validation.trainers import trainer_with_policy

F64 = torch.float64
LOW, HIGH = 0.85, 1.25
TOLERANCE = 1e-12


def _trainer(kind: str, *, dropout: float = 0.0) -> rt.Trainer:
    lora = rt.LoRAConfig(rank=4) if kind == "lora" else None
    trainer = trainer_with_policy(
        rt.ModelConfig.tiny(dtype=F64, dropout=dropout), lora=lora, optimizer=rt.AdamWConfig(lr=5e-2)
    )
    if lora is not None:
        train_step(trainer, seed=100)  # lora_B starts at 0, where lora_A has no gradient
    return trainer


def _options(policy: str | None, low: float = LOW, high: float = HIGH) -> rt.ForwardOptions:
    """Forced ``retain``, so a backward runs no forward of its own except a correction's."""
    corrections = () if policy is None else (rt.ImportanceCorrection(clip_low=low, clip_high=high, policy=policy),)
    return rt.ForwardOptions(corrections=corrections, backward_state="retain")


def _advantages(seed: int) -> torch.Tensor:
    return torch.randn(9, generator=torch.Generator().manual_seed(seed), dtype=F64)


@contextmanager
def _count_forwards(trainer: rt.Trainer) -> Iterator[list[bool]]:
    """Each model forward appends whether grad mode was on."""
    calls: list[bool] = []
    handle = trainer.model.register_forward_pre_hook(lambda module, args: calls.append(torch.is_grad_enabled()))
    try:
        yield calls
    finally:
        handle.remove()


def _grads(trainer: rt.Trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in trainer.checkpoint("policy").named_parameters()}


def _plain_logprobs(trainer: rt.Trainer, weights: WeightsAt, seq, rng_state: torch.Tensor) -> torch.Tensor:
    """Token log-probs of ``seq`` at ``weights`` from a fresh FP64 model (plain autograd path)."""
    seen: list[torch.Tensor] = []

    def loss(outs: list[torch.Tensor]) -> torch.Tensor:
        seen.append(outs[0].detach())
        return outs[0].sum()

    plain_gradients(trainer.model.config, weights, [seq], loss, rng_state, dtype=F64)
    return seen[0]


def _expected(trainer, old_weights, lp_current, seq, adv, lp_forward, rng_state):
    """(gradient of the reweighted loss at the forward's weights, the unweighted one, the ratios)."""
    ratios = (lp_current - lp_forward).exp()
    weights = ratios.clamp(LOW, HIGH)
    config = trainer.model.config

    def corrected(outs):
        return -(outs[0] * adv * weights).sum()

    def plain(outs):
        return -(outs[0] * adv).sum()

    expected = plain_gradients(config, old_weights, [seq], corrected, rng_state, dtype=F64)
    uncorrected = plain_gradients(config, old_weights, [seq], plain, rng_state, dtype=F64)
    return expected, uncorrected, ratios


def _assert_matches(committed, expected, uncorrected) -> None:
    for name, grad in committed.items():
        assert relative_error(grad, expected[name]) <= TOLERANCE, name
    # Non-vacuous: the weights changed the gradient far beyond the tolerance.
    assert max(relative_error(committed[n], uncorrected[n]) for n in committed) > 1e-3


def _assert_stats(stats: rt.CorrectionStats, ratios: torch.Tensor, staleness: int) -> None:
    ratio = ratios.numpy()
    w = np.clip(ratio, LOW, HIGH)
    assert stats.tokens == w.size and stats.staleness == staleness
    assert stats.mean == pytest.approx(float(np.mean(w)), rel=TOLERANCE)
    assert stats.max == pytest.approx(float(np.max(w)), rel=TOLERANCE)
    assert stats.effective_sample_size == pytest.approx(float(np.sum(w) ** 2 / np.sum(w * w)), rel=TOLERANCE)
    clipped = int(np.count_nonzero((ratio < LOW) | (ratio > HIGH)))
    assert 0 < clipped < w.size, "choose bounds that clip some tokens and not others"
    assert stats.fraction_clipped == clipped / w.size
    # Raw (pre-clip) ratios beside the clipped ones, per token at token level (NOTE [Importance correction] Rule 10).
    assert (stats.level, stats.units, stats.max_log_ratio) == ("token", w.size, 20.0)
    for found, values in ((stats.raw, ratio), (stats.clipped, w)):
        assert (found.min, found.max, found.mean) == pytest.approx(
            (values.min(), values.max(), values.mean()), rel=TOLERANCE
        )
        assert found.quantiles == pytest.approx(
            {q: float(np.quantile(values, q)) for q in found.quantiles}, rel=TOLERANCE
        )
        assert sorted(found.quantiles) == [0.05, 0.25, 0.5, 0.75, 0.95]


# --- fresh records --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lora", "full"])
@pytest.mark.parametrize("policy", ["when_available", "always"])
def test_fresh_records_are_never_corrected(kind: str, policy: str) -> None:
    # Bounds [2, 3] exclude the fresh ratio 1: a correction applied by mistake would
    # at least double the gradient. A stale record of the same tokens is kept alive,
    # so when_available even has "current" log-probs it must not use.
    ids, tgt = sequence(1)
    adv = _advantages(1)
    grads = {}
    for label, options in (("corrected", _options(policy, 2.0, 3.0)), ("plain", _options(None))):
        trainer = _trainer(kind)
        stale = trainer.forward(rt.ForwardInput(ids, tgt), options=options)
        train_step(trainer, seed=200)
        fresh = trainer.forward(rt.ForwardInput(ids, tgt), options=options)
        with _count_forwards(trainer) as forwards:
            report = trainer.backward(-(fresh.target_logprobs * adv).sum())
        assert forwards == [], f"{label}: a fresh backward ran a forward"
        assert [r.staleness for r in report.records] == [0]
        assert report.records[0].correction is None and report.corrected == []
        grads[label] = _grads(trainer)
        del stale
    for name, grad in grads["corrected"].items():
        assert torch.equal(grad, grads["plain"][name]), f"{name}: a fresh gradient was reweighted"


# --- when_available -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_when_available_corrects_with_a_later_forwards_logprobs(kind: str) -> None:
    trainer = _trainer(kind)
    seq = sequence(1)
    adv = _advantages(1)
    rng_state = torch.get_rng_state()
    old_weights = snapshot_weights(trainer, "policy")
    old = trainer.forward(rt.ForwardInput(*seq), options=_options("when_available"))
    train_step(trainer, seed=200)
    cur_weights = snapshot_weights(trainer, "policy")
    new = trainer.forward(rt.ForwardInput(*seq), options=_options("when_available"))

    with _count_forwards(trainer) as forwards:
        report = trainer.backward(-(old.target_logprobs * adv).sum())

    assert forwards == [], "when_available never adds a forward"
    (record,) = report.records
    assert report.corrected == [record] and record.staleness == 1
    lp_forward = old.target_logprobs.detach()
    lp_current = _plain_logprobs(trainer, cur_weights, seq, rng_state)
    # The later forward's log-probs, which the trainer used, are the plain current ones.
    torch.testing.assert_close(new.target_logprobs.detach(), lp_current, rtol=TOLERANCE, atol=TOLERANCE)
    expected, uncorrected, ratios = _expected(trainer, old_weights, lp_current, seq, adv, lp_forward, rng_state)
    _assert_matches(_grads(trainer), expected, uncorrected)
    _assert_stats(record.correction, ratios, staleness=1)


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_when_available_without_a_later_forward_is_the_uncorrected_gradient(kind: str) -> None:
    # The later forward here is of *other* tokens: nothing is known about these ones.
    seq, other = sequence(1), sequence(2)
    adv = _advantages(1)
    grads = {}
    for label, options in (("when_available", _options("when_available")), ("plain", _options(None))):
        trainer = _trainer(kind)
        old = trainer.forward(rt.ForwardInput(*seq), options=options)
        train_step(trainer, seed=200)
        later = trainer.forward(rt.ForwardInput(*other), options=options)
        with _count_forwards(trainer) as forwards:
            report = trainer.backward(-(old.target_logprobs * adv).sum())
        assert forwards == []
        assert report.records[0].staleness == 1
        assert report.records[0].correction is None and report.corrected == []
        grads[label] = _grads(trainer)
        del later
    for name, grad in grads["when_available"].items():
        assert torch.equal(grad, grads["plain"][name]), name


def test_when_available_ignores_logprobs_of_a_revision_that_is_no_longer_current() -> None:
    # Revision 0 forward, step, the same tokens at revision 1, step again: at revision 2
    # the revision-1 log-probs are not current, so nothing is corrected.
    seq = sequence(1)
    grads = {}
    for label, options in (("when_available", _options("when_available")), ("plain", _options(None))):
        trainer = _trainer("full")
        old = trainer.forward(rt.ForwardInput(*seq), options=options)
        train_step(trainer, seed=200)
        middle = trainer.forward(rt.ForwardInput(*seq), options=options)
        train_step(trainer, seed=201)
        report = trainer.backward(-(old.target_logprobs * _advantages(1)).sum())
        assert report.records[0].staleness == 2 and report.corrected == []
        grads[label] = _grads(trainer)
        del middle
    for name, grad in grads["when_available"].items():
        assert torch.equal(grad, grads["plain"][name]), name


# --- always -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_always_corrects_with_exactly_one_no_grad_forward(kind: str) -> None:
    trainer = _trainer(kind)
    seq = sequence(1)
    adv = _advantages(1)
    rng_state = torch.get_rng_state()
    old_weights = snapshot_weights(trainer, "policy")
    old = trainer.forward(rt.ForwardInput(*seq), options=_options("always"))
    train_step(trainer, seed=200)
    cur_weights = snapshot_weights(trainer, "policy")

    with _count_forwards(trainer) as forwards:
        report = trainer.backward(-(old.target_logprobs * adv).sum())

    assert forwards == [False], "expected exactly one forward, under no_grad"
    (record,) = report.records
    assert report.corrected == [record] and record.staleness == 1
    lp_forward = old.target_logprobs.detach()
    lp_current = _plain_logprobs(trainer, cur_weights, seq, rng_state)
    expected, uncorrected, ratios = _expected(trainer, old_weights, lp_current, seq, adv, lp_forward, rng_state)
    _assert_matches(_grads(trainer), expected, uncorrected)
    _assert_stats(record.correction, ratios, staleness=1)


def _dropout_run(policy: str, later_seed: int | None, *, eval_before_backward: bool = False):
    """Forward (seed 7) at revision 0, one step, optionally a later forward (``later_seed``), backward.

    ``eval_before_backward``: the caller puts the model in eval mode after the forward.
    """
    trainer = _trainer("full", dropout=0.1)
    seq = sequence(1)
    torch.manual_seed(7)
    rng_state = torch.get_rng_state()
    old_weights = snapshot_weights(trainer, "policy")
    old = trainer.forward(rt.ForwardInput(*seq), options=_options(policy))
    train_step(trainer, seed=200)
    cur_weights = snapshot_weights(trainer, "policy")
    later = None
    if later_seed is not None:
        torch.manual_seed(later_seed)
        before = torch.get_rng_state()
        later = trainer.forward(rt.ForwardInput(*seq), options=_options(policy))
        assert not torch.equal(torch.get_rng_state(), before), "dropout forwards draw from the RNG"
    if eval_before_backward:
        trainer.model.eval()
    torch.manual_seed(12345)
    ambient = torch.get_rng_state()
    report = trainer.backward(-(old.target_logprobs * _advantages(1)).sum())
    assert trainer.model.training is not eval_before_backward, "the backward left the caller's mode alone"
    assert torch.equal(torch.get_rng_state(), ambient), "the backward changed the caller's RNG"
    del later
    return trainer, report, old, (old_weights, cur_weights, seq, rng_state)


@pytest.mark.parametrize("eval_before_backward", [False, True], ids=["train", "eval-after-forward"])
def test_always_uses_the_forwards_dropout_masks_and_leaves_the_rng_alone(eval_before_backward: bool) -> None:
    """The forward's train mode is restored for the correction forward, whatever the model's mode at backward;
    ``when_available`` does not correct a record that drew masks."""
    trainer, report, old, (old_weights, cur_weights, seq, rng_state) = _dropout_run(
        "always", None, eval_before_backward=eval_before_backward
    )
    always, always_stats = _grads(trainer), report.records[0].correction
    assert report.corrected == report.records
    # Independent: plain forwards at both weights, both with the forward's dropout masks.
    lp_forward = old.target_logprobs.detach()
    lp_current = _plain_logprobs(trainer, cur_weights, seq, rng_state)
    expected, uncorrected, ratios = _expected(
        trainer, old_weights, lp_current, seq, _advantages(1), lp_forward, rng_state
    )
    _assert_matches(always, expected, uncorrected)
    _assert_stats(always_stats, ratios, staleness=1)

    # when_available pairs no forwards that drew dropout masks (Rule 8), even when the later one
    # happens to draw the same masks (same seed): its gradient is the uncorrected one.
    trainer, report, _, _ = _dropout_run("when_available", 7)
    assert report.corrected == []
    for name, grad in _grads(trainer).items():
        assert relative_error(grad, uncorrected[name]) <= TOLERANCE, name


# --- regressions -------------------------------------------------------------------


@pytest.mark.parametrize("later", ["wider", "narrower"])
def test_when_available_matches_tokens_across_batch_widths(later: str) -> None:
    trainer = _trainer("full")
    seq, long_seq = sequence(1), sequence(2, length=12)
    adv = _advantages(1)
    old_batch = [rt.ForwardInput(*seq)] + ([rt.ForwardInput(*long_seq)] if later == "narrower" else [])
    new_batch = [rt.ForwardInput(*seq)] + ([rt.ForwardInput(*long_seq)] if later == "wider" else [])
    old = trainer.forward(old_batch, options=_options("when_available"))
    train_step(trainer, seed=200)
    new = trainer.forward(new_batch, options=_options("when_available"))
    report = trainer.backward(-(old[0].target_logprobs * adv).sum())
    assert report.corrected == report.records
    expected_weights = (new[0].target_logprobs - old[0].target_logprobs).detach().exp().clamp(LOW, HIGH)
    assert report.records[0].correction.mean == pytest.approx(float(expected_weights.mean()), rel=TOLERANCE)


def _level_weights(lp_current, lp_forward, targets, level: str, high: float = 1e6) -> torch.Tensor:
    """Each token's weight at ``level`` (bounds ``[0, high]``), from the documented formulas over the unmasked
    targets (Rule 9)."""
    ratios = (lp_current - lp_forward).exp()[targets >= 0]
    unit = {
        "token": ratios,
        "sequence": ratios.prod(),
        "geometric": ratios.prod() ** (1 / ratios.numel()),
        "average": ratios.mean(),
    }[level]
    return torch.zeros_like(lp_current).masked_scatter(targets >= 0, (unit * torch.ones_like(ratios)).clamp(0.0, high))


@pytest.mark.parametrize("level", ["sequence", "geometric", "average"])
def test_each_level_commits_the_gradient_of_its_reweighted_loss(level: str) -> None:
    trainer = _trainer("full")
    ids, tgt = sequence(1)
    tgt = tgt.clone()
    tgt[3] = -1  # a masked target takes no part in the sequence's ratio
    adv = _advantages(1)
    rng_state = torch.get_rng_state()
    old_weights = snapshot_weights(trainer, "policy")
    correction = rt.ImportanceCorrection(clip_low=0.0, clip_high=1e6, policy="always", level=level)
    old = trainer.forward(rt.ForwardInput(ids, tgt), options=rt.ForwardOptions(corrections=correction))
    for seed in (200, 201):
        train_step(trainer, seed=seed)
    cur_weights = snapshot_weights(trainer, "policy")
    report = trainer.backward(-(old.target_logprobs * adv).sum())

    lp_current = _plain_logprobs(trainer, cur_weights, (ids, tgt), rng_state)
    weights = _level_weights(lp_current, old.target_logprobs.detach(), tgt, level)
    config = trainer.model.config
    expected = plain_gradients(
        config, old_weights, [(ids, tgt)], lambda o: -(o[0] * adv * weights).sum(), rng_state, dtype=F64
    )
    token = _level_weights(lp_current, old.target_logprobs.detach(), tgt, "token")
    per_token = plain_gradients(
        config, old_weights, [(ids, tgt)], lambda o: -(o[0] * adv * token).sum(), rng_state, dtype=F64
    )
    _assert_matches(_grads(trainer), expected, per_token)  # and not the token level's gradient
    stats = report.records[0].correction
    assert (stats.level, stats.units, stats.tokens, stats.staleness) == (level, 1, ids.numel() - 1, 2)
    assert stats.clipped.mean == pytest.approx(float(weights[0]), rel=TOLERANCE)


def test_a_huge_step_gives_finite_gradients_at_every_level_and_the_masked_target_none() -> None:
    # A step of lr = 3 (every weight moves by about 3) makes the targets very unlikely; after the forward one of
    # lr = 0.3 makes them likely again: token log-ratios up to about 110, about 300 summed over the sequence.
    # Clip off (1e30): only the bound e**20 holds them.
    ids, tgt = sequence(3)
    tgt = tgt.clone()
    tgt[4] = -1
    item = rt.ForwardInput(ids, tgt)

    def push(trainer: rt.Trainer, sign: float, lr: float) -> None:
        out = trainer.forward(item, options=rt.ForwardOptions(corrections=()))
        trainer.backward(sign * out.target_logprobs.sum())
        trainer.optim_step(lr=lr)
        trainer.zero_grad()

    for level in ("token", "sequence", "geometric", "average"):
        grads = []
        for masked_advantage in (0.0, 1e30):  # what the loss puts on the masked target must not matter
            trainer = trainer_with_policy(rt.ModelConfig.tiny(dropout=0.0))
            push(trainer, 1.0, 3.0)
            correction = rt.ImportanceCorrection(clip_high=1e30, policy="always", level=level)
            old = trainer.forward(item, options=rt.ForwardOptions(corrections=correction))
            push(trainer, -1.0, 0.3)
            adv = torch.ones(ids.numel())
            adv[4] = masked_advantage
            report = trainer.backward(-(old.target_logprobs * adv).sum())
            stats = report.records[0].correction
            assert stats.raw.max == pytest.approx(math.exp(20.0), rel=1e-6), (level, stats.raw)  # the bound was hit
            assert all(math.isfinite(v) for v in (stats.mean, stats.max, stats.raw.mean, stats.clipped.max))
            grads.append(_grads(trainer))
            assert all(bool(torch.isfinite(g).all()) for g in grads[-1].values()), level
        assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0]), level


def test_masked_target_positions_are_not_corrected_tokens() -> None:
    trainer = _trainer("full")
    ids, _ = sequence(1)
    out = trainer.forward(rt.ForwardInput(ids), options=_options("always", 2.0, 3.0))  # last target masked
    train_step(trainer, seed=200)
    report = trainer.backward(-(out.target_logprobs * _advantages(1)).sum())
    stats = report.records[0].correction
    assert stats.tokens == ids.numel() - 1


# --- The ``when_available`` cache with default options (NOTE [Importance correction] Rules 6-8).
#
# A logical rank is corrected only with log-probs its own forwards computed
# (so results do not depend on how many processes host the logical ranks);
# the cache keeps only what a pending record can still use (its size does not
# grow with the number of iterations); a forward with nothing older pending
# reads no token keys on the host; and log-probs drawn with dropout masks are
# never compared with log-probs of another forward.


def _default_trainer(*, dropout: float = 0.0, lr: float = 1e-2) -> rt.Trainer:
    """Default trainer options: one ``ImportanceCorrection()`` with the ``when_available`` policy."""
    trainer = trainer_with_policy(rt.ModelConfig.tiny(dropout=dropout), optimizer=rt.AdamWConfig(lr=lr))
    return trainer


def _item(seed: int) -> rt.ForwardInput:
    return rt.ForwardInput(*sequence(seed))


def _step(trainer: rt.Trainer, seed: int, lr: float | None = None) -> None:
    """A fresh forward/backward of other tokens and a step, so the revision moves."""
    out = trainer.forward(_item(seed))
    trainer.backward(-out.target_logprobs.sum())
    trainer.optim_step(lr=lr)
    trainer.zero_grad()


# --- one cache per logical rank (NOTE [Importance correction] Rule 7) --------------------------


def test_a_logical_rank_is_corrected_only_with_logprobs_its_own_forwards_computed() -> None:
    trainer = _default_trainer()
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


# --- bounded by what can still be used (NOTE [Importance correction] Rule 7) ----------------------


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))  # type(): no proxy __class__


@pytest.mark.parametrize("repeated", [False, True], ids=["new-tokens", "a-repeated-row"])
def test_the_one_step_stale_loop_keeps_no_more_tensors_as_it_goes(repeated: bool) -> None:
    """Forward batch k, backward batch k-1, step: a record is always pending, so nothing is ever idle.

    With new tokens each batch nothing is usable; with one row repeated in every
    batch it is used every step (the loop is corrected), and only that row is kept.
    """
    trainer = _default_trainer()
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
    plain = trainer_with_policy(optimizer=rt.AdamWConfig(lr=1e-2), options=rt.ForwardOptions(corrections=()))
    assert _unusable_rows_schedule(_default_trainer()) == _unusable_rows_schedule(plain)


# --- no token keys read without an older record pending (NOTE [Importance correction] Rule 7) ---------


def test_same_revision_forwards_with_default_options_read_no_token_keys() -> None:
    """Two micro-batches per step, both pending at one revision, then one backward: nothing older is
    pending at any forward, so no forward reads its token keys (a GPU sync each on a device)."""
    trainer = _default_trainer()
    with observe_host_reads() as reads:
        for k in range(4):
            first, second = trainer.forward(_item(2 * k)), trainer.forward(_item(2 * k + 1))
            trainer.backward(-(first.target_logprobs.sum() + second.target_logprobs.sum()))
            trainer.optim_step()
            trainer.zero_grad()
    assert [why for why, _ in reads if why == "token keys"] == []


# --- dropout masks (NOTE [Importance correction] Rule 8) ----------------------------------------------


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
    trainer = _default_trainer(dropout=0.1)
    report, log_ratio = _stale_then_again(trainer, lr=0.0)
    assert bool((log_ratio != 0).any()), "the two forwards drew different masks"
    assert report.records[0].staleness == 1 and report.corrected == []


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout-in-eval-mode"])
def test_when_available_corrects_logprobs_drawn_without_masks(dropout: float) -> None:
    # lr=0: the same weights give the same log-probs, so every weight is exactly 1.
    trainer = _default_trainer(dropout=dropout)
    trainer.model.eval()
    report, log_ratio = _stale_then_again(trainer, lr=0.0)
    assert bool((log_ratio == 0).all())
    (stats,) = [r.correction for r in report.corrected]
    assert stats.mean == 1.0 and stats.max == 1.0 and stats.fraction_clipped == 0.0
    # lr > 0: the weights are the clipped ratios of the later forward over the stale one.
    trainer = _default_trainer(dropout=dropout)
    trainer.model.eval()
    report, log_ratio = _stale_then_again(trainer, lr=None)
    (stats,) = [r.correction for r in report.corrected]
    weights = log_ratio.double().exp().clamp(0.0, 5.0)
    assert stats.tokens == weights.numel() and float(weights.std()) > 1e-3
    assert stats.mean == pytest.approx(float(weights.mean()), rel=1e-6)
    assert stats.max == pytest.approx(float(weights.max()), rel=1e-6)


# --- when_available pairs forwards of one autocast state (NOTE [Importance correction] Rule 7) ---------------


@pytest.mark.parametrize(
    ("old_autocast", "new_autocast", "paired"),
    [
        (None, torch.bfloat16, False),
        (torch.bfloat16, None, False),
        (torch.bfloat16, torch.float16, False),
        (torch.bfloat16, torch.bfloat16, True),
        (None, None, True),
    ],
)
def test_when_available_pairs_a_forward_only_with_a_later_one_of_its_autocast_state(
    old_autocast: torch.dtype | None, new_autocast: torch.dtype | None, paired: bool
) -> None:
    """An FP32 forward and an autocast one of the same tokens score them with different roundings: their ratio is
    not the weights' change, so only forwards of one autocast state (on or off, and its dtype) pair."""
    trainer = trainer_with_policy(optimizer=rt.AdamWConfig(lr=5e-2))
    seq = sequence(1)

    def forward() -> rt.ForwardOutput:
        return trainer.forward(rt.ForwardInput(*seq), options=_options("when_available", 0.0, 1e6))

    with torch.autocast("cpu", dtype=old_autocast or torch.bfloat16, enabled=old_autocast is not None):
        old = forward()
    train_step(trainer, seed=200)
    with torch.autocast("cpu", dtype=new_autocast or torch.bfloat16, enabled=new_autocast is not None):
        new = forward()
    report = trainer.backward(-(old.target_logprobs * _advantages(1).float()).sum())
    assert report.records[0].staleness == 1
    assert (report.corrected != []) is paired, f"corrected: {report.corrected}"
    del new


# --- a weight that overflows the cotangent's dtype is named (NOTE [Importance correction] Rule 3) ------------


def test_an_importance_weight_that_overflows_the_fp32_cotangent_is_named_with_the_option_that_allowed_it() -> None:
    """``clip_low = clip_high = 1e300`` is allowed (FP64 weights, Rule 3), but 1e300 times an FP32 cotangent is not
    an FP32 number: the backward names the weight, the dtype and the option, not the loss, and commits nothing."""
    trainer = trainer_with_policy(optimizer=rt.AdamWConfig(lr=5e-2))
    correction = rt.ImportanceCorrection(clip_low=1e300, clip_high=1e300, policy="always")
    old = trainer.forward(rt.ForwardInput(*sequence(1)), options=rt.ForwardOptions(corrections=(correction,)))
    train_step(trainer, seed=200)
    with pytest.raises(rt.GradientCommitError, match=r"importance weight 1e\+300 overflowed torch\.float32") as info:
        trainer.backward(-old.target_logprobs.sum())
    assert "clip_low=1e+300" in str(info.value) and "check the loss" not in str(info.value), str(info.value)
    assert all(p.grad is None for p in trainer.checkpoint("policy").parameters()), "a refused backward committed"


@pytest.mark.parametrize("scale", [math.nan, math.inf], ids=["nan", "inf"])
def test_a_non_finite_loss_under_a_correction_is_refused_as_the_loss_not_as_a_weight_overflow(scale: float) -> None:
    """A cotangent that is already non-finite before any weight is applied is the loss's fault (Rule 3 names only a
    weight that made a finite cotangent non-finite): the commit refuses the non-finite gradient, and commits nothing."""
    trainer = trainer_with_policy(optimizer=rt.AdamWConfig(lr=5e-2))
    correction = rt.ImportanceCorrection(policy="always")
    old = trainer.forward(rt.ForwardInput(*sequence(1)), options=rt.ForwardOptions(corrections=(correction,)))
    train_step(trainer, seed=200)
    with pytest.raises(rt.GradientCommitError, match="expected a finite gradient, found non-finite values") as info:
        trainer.backward(-old.target_logprobs.sum() * scale)
    assert "check the loss" in str(info.value) and "overflowed" not in str(info.value), str(info.value)
    assert all(p.grad is None for p in trainer.checkpoint("policy").parameters()), "a refused backward committed"
