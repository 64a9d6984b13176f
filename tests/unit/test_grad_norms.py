"""NOTE [Gradient norm]: one norm pass per backward, reused by ``optim_step`` only while exact."""

from __future__ import annotations

import gc
import weakref
from unittest import mock

import pytest
import torch

import reference_trainer as rt
from reference_trainer.grad_norms import KnownNorm, total_norm
from tests.support import NO_CORRECTION, advantages, sequence
from validation.trainers import trainer_with_policy


def _trainer(dtype: torch.dtype = torch.float32) -> rt.Trainer:
    trainer = trainer_with_policy(rt.ModelConfig.tiny(dtype=dtype), optimizer=rt.AdamWConfig(lr=1e-3))
    return trainer


def _backward(trainer: rt.Trainer, seed: int) -> None:
    ids, tgt = sequence(seed)
    out = trainer.forward(rt.ForwardInput(ids, tgt), options=NO_CORRECTION)
    trainer.backward(-(out.target_logprobs * advantages(seed)).sum())


def _grads(trainer: rt.Trainer) -> list[torch.Tensor]:
    return [p.grad for _, p in trainer.checkpoint("policy").named_parameters() if p.grad is not None]


def _fp64_norm(grads: list[torch.Tensor]) -> float:
    """The oracle: the L2 norm of every element, summed in FP64."""
    norm = float(sum((g.double() ** 2).sum() for g in grads) ** 0.5)
    assert norm > 0, "the oracle is vacuous: no gradient signal"
    return norm


class _NormPasses:
    """Counts fused norm passes (``torch.nn.utils.get_total_norm`` calls) inside the block."""

    def __enter__(self) -> _NormPasses:
        real = torch.nn.utils.get_total_norm
        self._patch = mock.patch("torch.nn.utils.get_total_norm", side_effect=real)
        self.calls = self._patch.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._patch.stop()

    @property
    def count(self) -> int:
        return self.calls.call_count


def test_one_backward_then_step_makes_one_norm_pass_and_reports_the_exact_norm() -> None:
    trainer = _trainer()
    _backward(trainer, 0)  # warm: the first step allocates optimizer state
    trainer.optim_step()
    trainer.zero_grad()
    with _NormPasses() as passes:
        _backward(trainer, 1)
        grads = [g.clone() for g in _grads(trainer)]
        report = trainer.optim_step()["policy"]
    assert passes.count == 1, f"expected the commit's norm to be reused by optim_step, found {passes.count} passes"
    assert report.grad_norm == float(total_norm(grads))  # bitwise what a fresh pass gives
    assert report.grad_norm == pytest.approx(_fp64_norm(grads), rel=1e-5)


def test_a_gradient_modified_in_place_after_the_commit_is_measured_again() -> None:
    trainer = _trainer()
    _backward(trainer, 0)
    first = next(iter(_grads(trainer)))
    first.mul_(3.0)  # moves the version counter: the commit's norm no longer applies
    with _NormPasses() as passes:
        report = trainer.optim_step()["policy"]
    assert passes.count == 1
    assert report.grad_norm == pytest.approx(_fp64_norm(_grads(trainer)), rel=1e-5)


def test_a_replaced_gradient_is_measured_again() -> None:
    trainer = _trainer()
    _backward(trainer, 0)
    param = next(p for _, p in trainer.checkpoint("policy").named_parameters())
    param.grad = param.grad * 2.0  # a different tensor object at the same version
    report = trainer.optim_step()["policy"]
    assert report.grad_norm == pytest.approx(_fp64_norm(_grads(trainer)), rel=1e-5)


def test_an_accumulated_gradient_is_measured_by_its_commit_and_reused_by_the_step() -> None:
    trainer = _trainer()
    with _NormPasses() as passes:
        _backward(trainer, 0)
        _backward(trainer, 1)
        summed = [g.clone() for g in _grads(trainer)]
        report = trainer.optim_step()["policy"]
    assert passes.count == 2, "one pass per commit; the second commit measured the sums the step needs"
    assert report.grad_norm == float(total_norm(summed))  # bitwise what a fresh pass gives
    assert report.grad_norm == pytest.approx(_fp64_norm(summed), rel=1e-5)


def test_clipping_uses_the_reused_norm_and_a_second_step_measures_the_clipped_gradients() -> None:
    trainer = _trainer()
    _backward(trainer, 0)
    norm = _fp64_norm(_grads(trainer))
    first = trainer.optim_step(max_grad_norm=norm / 4)["policy"]
    assert first.clipped and first.grad_norm == pytest.approx(norm, rel=1e-5)
    second = trainer.optim_step()["policy"]  # same .grad objects, clipped in place: versions moved
    assert second.grad_norm == pytest.approx(norm / 4, rel=1e-4)


def test_low_precision_parameters_measure_their_fp32_masters() -> None:
    trainer = _trainer(torch.bfloat16)
    _backward(trainer, 0)
    upcast = [g.float() for g in _grads(trainer)]
    report = trainer.optim_step()["policy"]
    assert report.grad_norm == float(total_norm(upcast))


def test_a_known_norm_keeps_no_gradient_alive() -> None:
    grad = torch.ones(4)
    norm = total_norm([grad])
    known = KnownNorm([grad], float(norm), norm.dtype, norm.device)
    ref = weakref.ref(grad)
    del grad
    gc.collect()
    assert ref() is None
    assert not known.matches([torch.ones(4)])


def test_a_gradient_set_that_shrank_is_measured_again_and_clipped_like_clip_grad_norm() -> None:
    """``.grad = None`` on the last parameter after the commit: the remaining tensors are a prefix of the
    measured ones, unmodified, so only the length tells the known norm does not apply (Rule 3)."""
    trainer = _trainer()
    _backward(trainer, 0)
    last = list(trainer.checkpoint("policy").parameters())[-1]
    assert last.grad is not None and last.grad.abs().sum() > 0, "the dropped gradient must carry signal"
    last.grad = None
    copies = []  # the independent oracle: fresh tensors holding copies of the remaining gradients
    for grad in _grads(trainer):
        copies.append(torch.zeros_like(grad, requires_grad=True))
        copies[-1].grad = grad.detach().clone()
    true_norm = float(torch.nn.utils.clip_grad_norm_(copies, max_norm=1.0))
    report = trainer.optim_step(max_grad_norm=1.0, lr=0.0)["policy"]
    assert report.grad_norm == pytest.approx(true_norm, rel=1e-6) and report.clipped
    for grad, expected in zip(_grads(trainer), copies, strict=True):
        torch.testing.assert_close(grad, expected.grad, rtol=1e-6, atol=0.0)
