"""``optim_step`` and ``zero_grad``: AdamW, lr override, clipping, skips, BF16 masters.

See docs/semantics.md#transactions and docs/semantics.md#precision.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

import reference_trainer as rt
from tests.support import NO_CORRECTION, advantages, assert_grads_unchanged, grad_snapshot, sequence

# Not torch's defaults, so a trainer that ignored a setting would drift off the reference.
ADAMW = rt.AdamWConfig(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)


def _trainer(kind: str = "full", *, dtype: torch.dtype = torch.float32, name: str = "policy") -> rt.Trainer:
    trainer = rt.Trainer(rt.DecoderLM(rt.ModelConfig.tiny(dtype=dtype), seed=0))
    _add(trainer, name, kind)
    return trainer


def _add(trainer: rt.Trainer, name: str, kind: str) -> None:
    if kind == "lora":
        trainer.add_checkpoint(name, lora=rt.LoRAConfig(rank=4), optimizer=ADAMW, seed=1)
    else:
        trainer.add_checkpoint(name, full=True, optimizer=ADAMW)


def _commit(trainer: rt.Trainer, seed: int, *, checkpoint: str | None = None, scale: float = 1.0) -> None:
    """One forward/backward on fresh data; its gradient is committed to ``.grad``."""
    ids, tgt = sequence(seed)
    out = trainer.forward(rt.ForwardInput(ids, tgt), checkpoint=checkpoint, options=NO_CORRECTION)
    trainer.backward(-(out.target_logprobs * advantages(seed) * scale).sum())


def _params(trainer: rt.Trainer, name: str = "policy") -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.checkpoint(name).named_parameters()}


def _assert_params_equal(trainer: rt.Trainer, expected: dict[str, torch.Tensor], name: str = "policy") -> None:
    for n, p in trainer.checkpoint(name).named_parameters():
        assert torch.equal(p, expected[n]), f"{name}.{n}: parameter differs"


class _Reference:
    """An independent copy of a checkpoint's parameters stepped by ``torch.optim.AdamW``."""

    def __init__(self, trainer: rt.Trainer, name: str = "policy") -> None:
        self.params = {
            n: p.detach().clone().requires_grad_(True) for n, p in trainer.checkpoint(name).named_parameters()
        }
        self.optimizer = torch.optim.AdamW(
            list(self.params.values()), lr=ADAMW.lr, betas=ADAMW.betas, eps=ADAMW.eps, weight_decay=ADAMW.weight_decay
        )

    def step(
        self, trainer: rt.Trainer, *, lr: float | None = None, max_grad_norm: float | None = None, name: str = "policy"
    ) -> float | None:
        """Take the trainer's committed gradients, optionally clip, step; returns clip_grad_norm_'s norm."""
        for n, p in trainer.checkpoint(name).named_parameters():
            self.params[n].grad = None if p.grad is None else p.grad.clone()
        norm = None
        if max_grad_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(list(self.params.values()), max_grad_norm))
        group = self.optimizer.param_groups[0]
        group["lr"] = ADAMW.lr if lr is None else lr
        self.optimizer.step()
        return norm


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_fp32_step_is_bitwise_torch_adamw(kind: str) -> None:
    trainer = _trainer(kind)
    reference = _Reference(trainer)
    for step in range(3):
        _commit(trainer, seed=10 + step)
        reference.step(trainer)
        report = trainer.optim_step()
        trainer.zero_grad()
        assert report["policy"].stepped and report["policy"].revision == step + 1
        _assert_params_equal(trainer, {n: p.detach() for n, p in reference.params.items()})
    start = _params(_trainer(kind))
    moved = max(float((p.detach() - start[n]).abs().max()) for n, p in trainer.checkpoint("policy").named_parameters())
    assert moved > 1e-3, "non-vacuous: three steps must move the weights"


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_lr_override_applies_to_that_step_only(kind: str) -> None:
    trainer = _trainer(kind)
    reference = _Reference(trainer)
    for step, lr in enumerate([None, 1e-3, None]):
        _commit(trainer, seed=20 + step)
        reference.step(trainer, lr=lr)
        trainer.optim_step(lr=lr)
        trainer.zero_grad()
        _assert_params_equal(trainer, {n: p.detach() for n, p in reference.params.items()})
    assert trainer.checkpoint("policy").state_dict()["optimizer"]["param_groups"][0]["lr"] == ADAMW.lr


@pytest.mark.parametrize("max_grad_norm,clipped", [(1e-3, True), (1e6, False)])
def test_clipping_equals_clip_grad_norm(max_grad_norm: float, clipped: bool) -> None:
    trainer = _trainer("full")
    reference = _Reference(trainer)
    for step in range(2):
        _commit(trainer, seed=30 + step)
        unclipped = {n: p.grad.clone() for n, p in trainer.checkpoint("policy").named_parameters()}
        norm = reference.step(trainer, max_grad_norm=max_grad_norm)
        report = trainer.optim_step(max_grad_norm=max_grad_norm)["policy"]
        assert report.stepped and report.clipped is clipped
        assert report.grad_norm == norm
        assert (norm > max_grad_norm) is clipped, "the case must exercise what it claims"
        for n, p in trainer.checkpoint("policy").named_parameters():
            # The trainer clips .grad in place, like clip_grad_norm_.
            assert torch.equal(p.grad, reference.params[n].grad), f"{n}: clipped gradient differs"
            assert torch.equal(p, reference.params[n].detach()), f"{n}: parameter differs"
            if clipped:
                assert not torch.equal(p.grad, unclipped[n]) or not bool(unclipped[n].any())
        trainer.zero_grad()


def test_non_finite_norm_changes_nothing_clears_grads_and_is_reported() -> None:
    trainer = _trainer("full")
    _commit(trainer, seed=40)
    trainer.optim_step()  # revision 1, with optimizer state to protect
    trainer.zero_grad()
    # Every element is finite (commit would refuse otherwise) but the FP32 L2 norm overflows.
    _commit(trainer, seed=41, scale=1e19)
    grads = [p.grad for p in trainer.checkpoint("policy").parameters() if p.grad is not None]
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    params = _params(trainer)
    optimizer = trainer.checkpoint("policy").state_dict()["optimizer"]

    report = trainer.optim_step()["policy"]

    assert (report.stepped, report.clipped, report.revision) == (False, False, 1)
    assert report.grad_norm is not None and math.isinf(report.grad_norm)
    assert "non-finite" in report.reason
    _assert_params_equal(trainer, params)
    assert trainer.checkpoint("policy").revision == 1
    assert all(p.grad is None for p in trainer.checkpoint("policy").parameters())
    after = trainer.checkpoint("policy").state_dict()["optimizer"]
    for index, state in optimizer["state"].items():
        for key, value in state.items():
            assert torch.equal(after["state"][index][key], value), f"optimizer state {index}.{key} changed"
    # The checkpoint is usable again, and the cleared gradient is not applied later.
    assert trainer.optim_step()["policy"].reason == "no gradients"
    _commit(trainer, seed=42)
    assert trainer.optim_step()["policy"].revision == 2


def test_accumulation_that_overflows_is_refused_and_keeps_the_earlier_gradients() -> None:
    trainer = _trainer("full")
    # 1e36 is about the largest scale whose single backward stays finite here; about 75 of
    # them overflow the accumulated embedding gradient.
    for count in range(1, 200):
        before = grad_snapshot(trainer)
        try:
            _commit(trainer, seed=95, scale=1e36)
        except rt.GradientCommitError:
            assert_grads_unchanged(trainer, before)
            break
        for n, p in trainer.checkpoint("policy").named_parameters():
            assert bool(torch.isfinite(p.grad).all()), f"backward {count} published a non-finite accumulated {n}.grad"
    else:
        pytest.fail("no accumulation overflowed: the case was not exercised")
    assert count > 1, "the first backward alone must be finite, or this tests staging, not accumulation"


def _two_checkpoints() -> rt.Trainer:
    trainer = _trainer("full", name="a")
    _add(trainer, "b", "lora")
    return trainer


def test_checkpoint_without_gradients_is_skipped_while_another_steps() -> None:
    trainer = _two_checkpoints()
    b_before = _params(trainer, "b")
    _commit(trainer, seed=50, checkpoint="a")
    report = trainer.optim_step()
    assert set(report.checkpoints) == {"a", "b"}
    assert report["a"] == rt.CheckpointStep(
        stepped=True, reason=None, grad_norm=report["a"].grad_norm, clipped=False, revision=1
    )
    assert report["b"] == rt.CheckpointStep(
        stepped=False, reason="no gradients", grad_norm=None, clipped=False, revision=0
    )
    assert trainer.checkpoint("a").revision == 1 and trainer.checkpoint("b").revision == 0
    _assert_params_equal(trainer, b_before, "b")
    assert trainer.checkpoint("b").state_dict()["optimizer"]["state"] == {}, "b's AdamW never stepped"


def test_step_report_fields_of_a_successful_step() -> None:
    trainer = _trainer("lora")
    _commit(trainer, seed=55)
    grads = [p.grad.clone() for p in trainer.checkpoint("policy").parameters() if p.grad is not None]
    report = trainer.optim_step()
    assert isinstance(report, rt.StepReport) and set(report.checkpoints) == {"policy"}
    step = report["policy"]
    assert isinstance(step, rt.CheckpointStep)
    assert step.stepped is True and step.reason is None and step.clipped is False
    assert step.grad_norm == float(torch.nn.utils.get_total_norm(grads)) and step.grad_norm > 0
    assert step.revision == trainer.checkpoint("policy").revision == 1


def test_selected_checkpoints_step_alone() -> None:
    trainer = _two_checkpoints()
    _commit(trainer, seed=60, checkpoint="a")
    _commit(trainer, seed=61, checkpoint="b")
    b_params, b_grads = _params(trainer, "b"), grad_snapshot(trainer, "b")
    report = trainer.optim_step(checkpoints=["a"])
    assert set(report.checkpoints) == {"a"} and report["a"].stepped
    assert (trainer.checkpoint("a").revision, trainer.checkpoint("b").revision) == (1, 0)
    _assert_params_equal(trainer, b_params, "b")
    assert_grads_unchanged(trainer, b_grads, "b")
    assert trainer.optim_step(checkpoints=["b"])["b"].revision == 1


def test_a_checkpoint_named_twice_steps_once_per_call() -> None:
    trainer = _trainer("full")
    reference = _Reference(trainer)
    _commit(trainer, seed=62)
    reference.step(trainer)
    report = trainer.optim_step(checkpoints=["policy", "policy"])
    assert list(report.checkpoints) == ["policy"] and report["policy"].revision == 1
    assert trainer.checkpoint("policy").revision == 1
    _assert_params_equal(trainer, {n: p.detach() for n, p in reference.params.items()})  # one AdamW step


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"lr": -1e-3}, "lr"),
        ({"lr": math.nan}, "lr"),
        ({"lr": math.inf}, "lr"),
        ({"lr": True}, "lr"),
        ({"lr": "1e-3"}, "lr"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
        ({"max_grad_norm": math.nan}, "max_grad_norm"),
        ({"max_grad_norm": math.inf}, "max_grad_norm"),
        ({"max_grad_norm": True}, "max_grad_norm"),
        ({"checkpoints": ["nope"]}, "checkpoint"),
    ],
)
def test_bad_step_arguments_are_config_errors_and_change_nothing(kwargs: dict, field: str) -> None:
    trainer = _trainer("full")
    _commit(trainer, seed=70)
    params, grads = _params(trainer), grad_snapshot(trainer)
    with pytest.raises(rt.ConfigError) as info:
        trainer.optim_step(**kwargs)
    assert info.value.field == field
    _assert_params_equal(trainer, params)
    assert_grads_unchanged(trainer, grads)
    assert trainer.checkpoint("policy").revision == 0


def test_bf16_checkpoint_keeps_fp32_masters_and_fp32_has_none() -> None:
    assert "master_parameters" not in _trainer("full").checkpoint("policy").state_dict()
    trainer = _trainer("full", dtype=torch.bfloat16)
    checkpoint = trainer.checkpoint("policy")
    masters = checkpoint.state_dict()["master_parameters"]
    assert set(masters) == {n for n, _ in checkpoint.named_parameters()}
    assert all(m.dtype == torch.float32 for m in masters.values())
    reference = {n: m.clone().requires_grad_(True) for n, m in masters.items()}
    optimizer = torch.optim.AdamW(
        list(reference.values()), lr=ADAMW.lr, betas=ADAMW.betas, eps=ADAMW.eps, weight_decay=ADAMW.weight_decay
    )

    for step in range(2):
        _commit(trainer, seed=80 + step)
        for n, p in checkpoint.named_parameters():
            assert p.dtype == torch.bfloat16 and p.grad.dtype == torch.bfloat16
            reference[n].grad = p.grad.float()
        optimizer.step()
        trainer.optim_step()
        trainer.zero_grad()

    masters = checkpoint.state_dict()["master_parameters"]
    for n, p in checkpoint.named_parameters():
        assert torch.equal(masters[n], reference[n].detach()), f"{n}: master differs from FP32 AdamW"
        assert torch.equal(p, masters[n].to(torch.bfloat16)), f"{n}: BF16 parameter is not its rounded master"
    below_bf16 = sum(int((m != m.to(torch.bfloat16).float()).sum()) for m in masters.values())
    assert below_bf16 > 0, "the masters must hold precision the BF16 parameters cannot"


class _NewUpcasts(TorchFunctionMode):
    """Counts calls that return a new FP32 tensor converted from a BF16 tensor of the same shape."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sources = [a for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16]
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and not any(out is a for a in args):
            self.count += any(s.shape == out.shape for s in sources)
        return out


def test_bf16_master_gradients_are_allocated_once_not_every_step() -> None:
    trainer = _trainer("full", dtype=torch.bfloat16)
    upcasts = []
    for step in range(2):
        _commit(trainer, seed=60 + step)
        with _NewUpcasts() as mode:
            assert trainer.optim_step()["policy"].stepped
        upcasts.append(mode.count)
        trainer.zero_grad()
    # Upcasting with .float() / .to() makes a new FP32 tensor per parameter per step; copy_ into the buffers none.
    assert upcasts == [0, 0], f"new FP32 tensors upcast from BF16 gradients, per step: {upcasts}"


def test_zero_grad_sets_every_grad_to_none() -> None:
    trainer = _two_checkpoints()
    _commit(trainer, seed=90, checkpoint="a")
    _commit(trainer, seed=91, checkpoint="b")
    trainer.zero_grad(checkpoints=["b"])
    assert all(p.grad is None for p in trainer.checkpoint("b").parameters())
    assert all(p.grad is not None for p in trainer.checkpoint("a").parameters())
    trainer.zero_grad()
    for name in ("a", "b"):
        assert all(p.grad is None for p in trainer.checkpoint(name).parameters()), name
    assert not any(report.stepped for report in trainer.optim_step().checkpoints.values())


def test_bf16_norm_and_clipping_run_in_fp32_on_the_masters() -> None:
    trainer = _trainer("full", dtype=torch.bfloat16)
    _commit(trainer, seed=51)
    names = [n for n, _ in trainer.checkpoint("policy").named_parameters()]
    grads = [p.grad.clone() for p in trainer.checkpoint("policy").parameters()]
    masters = trainer.checkpoint("policy").state_dict()["master_parameters"]
    fp32_norm = torch.nn.utils.get_total_norm([g.float() for g in grads])
    assert float(fp32_norm) != float(torch.nn.utils.get_total_norm(grads)), "non-vacuous: BF16 rounds the norm"
    max_norm = float(fp32_norm) / 4
    step = trainer.optim_step(max_grad_norm=max_norm)["policy"]
    assert step.grad_norm == float(fp32_norm) and step.clipped
    # Independent FP32 replica: clip the upcast gradients, step AdamW on the masters.
    replica = [masters[n].clone().requires_grad_(True) for n in names]
    for tensor, grad in zip(replica, grads):
        tensor.grad = grad.float()
    torch.nn.utils.clip_grad_norm_(replica, max_norm)
    optimizer = torch.optim.AdamW(
        replica, lr=ADAMW.lr, betas=ADAMW.betas, eps=ADAMW.eps, weight_decay=ADAMW.weight_decay
    )
    optimizer.step()
    after = trainer.checkpoint("policy").state_dict()["master_parameters"]
    for name, tensor in zip(names, replica):
        assert torch.equal(after[name], tensor.detach()), name


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_fp64_lr_zero_step_leaves_every_parameter_bitwise_unchanged(kind: str) -> None:
    """FP64 is not lower precision: no FP32 master may round it (docs/semantics.md#precision)."""
    trainer = _trainer(kind, dtype=torch.float64)
    _commit(trainer, seed=45)
    params = _params(trainer)
    assert trainer.optim_step(lr=0.0)["policy"].stepped
    _assert_params_equal(trainer, params)
    assert "master_parameters" not in trainer.checkpoint("policy").state_dict()


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_fp64_norm_clipping_and_step_equal_torch_on_an_fp64_copy(kind: str) -> None:
    """Bitwise, not within a tolerance: the oracle runs the same FP64 ops (get_total_norm,
    clip by that norm, AdamW) on the same FP64 tensors, so any FP32 detour shows in the last bits."""
    trainer = _trainer(kind, dtype=torch.float64)
    reference = _Reference(trainer)
    for step in range(2):
        _commit(trainer, seed=46 + step)
        norm = reference.step(trainer, max_grad_norm=1e-3)
        report = trainer.optim_step(max_grad_norm=1e-3)["policy"]
        assert report.clipped and report.grad_norm == norm
        for n, p in trainer.checkpoint("policy").named_parameters():
            assert p.dtype == p.grad.dtype == torch.float64
            assert torch.equal(p.grad, reference.params[n].grad), f"{n}: clipped FP64 gradient differs"
            assert torch.equal(p, reference.params[n].detach()), f"{n}: FP64 parameter differs"
        trainer.zero_grad()
