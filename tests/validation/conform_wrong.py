"""Purpose-built wrong adapters, one per check, each with one realistic bug (and two broken ones).

Each subclasses a right adapter of ``validation.conform.adapters.plain`` and
changes one thing, so a check that catches it is shown not to be vacuous:
the right parent passes the same check.
"""

from __future__ import annotations

import copy
import os

import torch
from torch import Tensor

from validation.conform.adapters.plain import SnapshotAsyncAdapter, SyncAdapter


class UnmaskedLogprobs(SyncAdapter):
    """sync: masked targets (-100) are not zeroed; they count as token 0's log-prob."""

    name = "unmasked-logprobs"

    def forward(self, input_tokens: Tensor, target_tokens: Tensor) -> Tensor:
        logprobs = torch.log_softmax(self._model(input_tokens).float(), dim=-1)
        return logprobs.gather(-1, target_tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)


class ScaledNormGradient(SyncAdapter):
    """sync, splits: one small-gradient parameter's gradient is 5% short (a norm weight counted through a mean)."""

    name = "scaled-norm-gradient"

    def backward(self, loss: Tensor) -> None:
        loss.backward()
        dict(self._model.named_parameters())["model.layers.0.post_attention_layernorm.weight"].grad.mul_(0.95)


class DoubledLearningRate(SyncAdapter):
    """sync: the optimizer ignores spec.lr (steps at twice it)."""

    name = "doubled-lr"

    def start(self, spec) -> None:
        super().start(spec)
        for group in self._optimizer.param_groups:
            group["lr"] = 2 * spec.lr


def off_spec_adamw(optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW, **changed: object) -> type[SyncAdapter]:
    """sync: an optimizer that departs from the spec's AdamW in ``changed`` settings (or is another ``optimizer``)."""

    class OffSpecAdamW(SyncAdapter):
        name = f"off-spec-{optimizer.__name__}-{'-'.join(f'{k}={v}' for k, v in changed.items())}"

        def start(self, spec) -> None:
            super().start(spec)
            settings = {"lr": spec.lr, "betas": spec.betas, "eps": spec.eps, "weight_decay": spec.weight_decay}
            self._optimizer = optimizer(self._model.parameters(), **{**settings, **changed})

    return OffSpecAdamW


class MeanOverMicroBatches(SyncAdapter):
    """splits: ``.grad`` holds the mean of the backward calls since ``zero_grad`` (a per-micro-batch mean)."""

    name = "mean-over-micro-batches"

    def zero_grad(self) -> None:
        super().zero_grad()
        self._backwards = 0

    def start(self, spec) -> None:
        super().start(spec)
        self._backwards = 0

    def backward(self, loss: Tensor) -> None:
        before = [None if p.grad is None else p.grad.clone() for p in self._model.parameters()]
        self._model.zero_grad(set_to_none=True)
        loss.backward()
        self._backwards += 1
        for param, old in zip(self._model.parameters(), before):
            if old is not None and param.grad is not None:
                param.grad = old + (param.grad - old) / self._backwards


class OneStepOffPolicy(SnapshotAsyncAdapter):
    """sync: "staleness 0" that runs one step off-policy: a forward runs on the weights before the last step."""

    name = "one-step-off-policy"

    def start(self, spec) -> None:
        super().start(spec)
        self._previous = copy.deepcopy(self._model)

    def forward(self, input_tokens: Tensor, target_tokens: Tensor) -> Tensor:
        live, self._model = self._model, self._previous
        try:
            return super().forward(input_tokens, target_tokens)  # copies self._model: the previous weights
        finally:
            self._model = live

    def optim_step(self) -> None:
        self._previous = copy.deepcopy(self._model)
        super().optim_step()


class OneRecordAtATime(SyncAdapter):
    """splits: keeps one pending forward: a backward reaches only the latest forward's graph."""

    name = "one-record-at-a-time"

    def forward(self, input_tokens: Tensor, target_tokens: Tensor) -> Tensor:
        computed = super().forward(input_tokens, target_tokens)
        returned = computed.detach().requires_grad_(True)  # the trainer's record stands behind a leaf
        self._record = (returned, computed)
        return returned

    def backward(self, loss: Tensor) -> None:
        loss.backward()
        returned, computed = self._record
        computed.backward(returned.grad)


class SaveWithoutGradients(SyncAdapter):
    """resume: saves the model and optimizer but not the gradients accumulated since the last step."""

    name = "save-without-gradients"
    capabilities = frozenset({"save"})
    bitwise_resume = True

    def save(self, path: str) -> None:
        torch.save(
            {"model": self._model.state_dict(), "optimizer": self._optimizer.state_dict()},
            os.path.join(path, "state.pt"),
        )

    def load(self, path: str) -> None:
        state = torch.load(os.path.join(path, "state.pt"))
        self._model.load_state_dict(state["model"])
        self._optimizer.load_state_dict(state["optimizer"])


class Float16Logprobs(SyncAdapter):
    """sync: log-probs computed from logits rounded to float16 (a memory saving that costs accuracy)."""

    name = "float16-logprobs"

    def forward(self, input_tokens: Tensor, target_tokens: Tensor) -> Tensor:
        logits = self._model(input_tokens).to(torch.float16).float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, target_tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return logprobs * (target_tokens >= 0)


class Float16StaleLogprobs(SnapshotAsyncAdapter):
    """stale: exact snapshots, but log-probs from logits rounded to float16: wrong at every revision, not stale."""

    name = "float16-stale-logprobs"

    def forward(self, input_tokens: Tensor, target_tokens: Tensor) -> Tensor:
        frozen = copy.deepcopy(self._model)
        frozen.zero_grad(set_to_none=True)
        self._pending.append(frozen)
        logits = frozen(input_tokens).to(torch.float16).float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, target_tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return logprobs * (target_tokens >= 0)


class RaisingStaleBackward(SyncAdapter):
    """stale: claims it, but a stale backward raises autograd's in-place error (a control that fires for no reason)."""

    name = "raising-stale-backward"
    capabilities = frozenset({"stale"})


class ResumedOneUlpOff(SaveWithoutGradients):
    """resume: claims bitwise, but ``load`` leaves each weight one ulp off (e.g. weights rebuilt from a master copy)."""

    name = "resumed-one-ulp-off"

    def save(self, path: str) -> None:
        grads = {name: p.grad for name, p in self._model.named_parameters()}
        torch.save(
            {"model": self._model.state_dict(), "optimizer": self._optimizer.state_dict(), "grads": grads},
            os.path.join(path, "state.pt"),
        )

    def load(self, path: str) -> None:
        super().load(path)
        grads = torch.load(os.path.join(path, "state.pt"))["grads"]
        with torch.no_grad():
            for name, param in self._model.named_parameters():
                param.grad = grads[name]
                param.copy_(torch.nextafter(param, torch.full_like(param, float("inf"))))


class NaNGradient(SnapshotAsyncAdapter):
    """sync, stale, splits: one parameter's gradient is NaN (a diverged layer); the step uses the true gradient."""

    name = "nan-gradient"

    def backward(self, loss: Tensor) -> None:
        super().backward(loss)
        first = next(self._model.parameters())
        self._true = first.grad.clone()
        first.grad.fill_(float("nan"))

    def optim_step(self) -> None:
        next(self._model.parameters()).grad = self._true
        super().optim_step()


class NoReduceAcrossProcesses(SyncAdapter):
    """processes: claims processes but each rank steps on its own rows' gradient (no sum over the group)."""

    name = "no-reduce"
    capabilities = frozenset({"processes"})


class RaisesAtStep(SyncAdapter):
    """sync: ``optim_step`` raises with a story over several lines whose cause is the last (as a spawned rank's is)."""

    name = "raises-at-step"

    def optim_step(self) -> None:
        raise RuntimeError(
            "a rank raised\n--- rank 1: exit code 1\nTraceback (most recent call last):\n"
            "ValueError: the optimizer state is on another device"
        )


class UnguardedAllReduce(SyncAdapter):
    """processes (right): sums gradients with ``dist.all_reduce`` unconditionally, as a world-size-agnostic trainer does."""

    name = "unguarded-all-reduce"
    capabilities = frozenset({"processes"})

    def backward(self, loss: Tensor) -> None:
        import torch.distributed as dist

        loss.backward()
        for param in self._model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)


class MissingBackward:
    """broken: no backward method."""

    name = "missing-backward"
    capabilities = frozenset()

    def start(self, spec) -> None: ...

    def module(self) -> torch.nn.Module: ...

    def forward(self, input_tokens: Tensor, target_tokens: Tensor) -> Tensor: ...

    def optim_step(self) -> None: ...

    def zero_grad(self) -> None: ...


class SaveClaimedWithoutLoad(SyncAdapter):
    """broken: claims "save" but has no save or load."""

    name = "save-claimed"
    capabilities = frozenset({"save"})


class FrozenModule(SyncAdapter):
    """broken: module() returns a model with nothing trainable (the trainer's weights live elsewhere)."""

    name = "frozen-module"

    def module(self) -> torch.nn.Module:
        frozen = copy.deepcopy(self._model)
        return frozen.requires_grad_(False)


class StartWithoutSpec(SyncAdapter):
    """broken: ``start`` takes no spec."""

    name = "start-without-spec"

    def start(self) -> None:  # type: ignore[override]
        pass


class BackwardWithoutLoss(SyncAdapter):
    """broken: ``backward`` takes no loss (the trainer keeps its own)."""

    name = "backward-without-loss"

    def backward(self) -> None:  # type: ignore[override]
        pass


class ModuleNotTheModel(SyncAdapter):
    """broken: ``module()`` returns a trainable module that is not the model forward runs (a bare head)."""

    name = "module-not-the-model"

    def module(self) -> torch.nn.Module:
        if not hasattr(self, "_head"):
            self._head = torch.nn.Linear(4, 3)
        return self._head


class SummedLogprobs(SyncAdapter):
    """broken: forward returns one log-prob per sequence (B,), not per token (B, T)."""

    name = "summed-logprobs"

    def forward(self, input_tokens: Tensor, target_tokens: Tensor) -> Tensor:
        return super().forward(input_tokens, target_tokens).sum(-1)


def raising_factory() -> SyncAdapter:
    """broken: the factory itself fails."""
    raise RuntimeError("no GPU\nsecond line")
