"""The suite's own FP64 model of an adapter's ``module()``: gradients at weight snapshots the suite took itself.

NOTE [Conformance oracle]
  1. The oracle is a deep copy of ``module()`` taken right after ``start``,
     its parameters cast to FP64; buffers keep the dtype the module gives
     them (a rotary table a Qwen3-style model keeps in FP32 on purpose stays
     the model's own constant, not a precision the oracle may change). It
     never reads an adapter's numbers: only the weights the
     suite snapshots (``snapshot``: a copy of every ``requires_grad``
     parameter of ``module()``, by name) and the tokens and loss the suite
     itself made.
  2. ``gradients(weights, batches)`` runs the FP64 copy at ``weights``
     (``torch.func.functional_call``; frozen parameters and buffers are the
     copy's, which no step changes) on each ``(input, target)`` batch, forms
     the suite's loss (``suite_loss``) and returns its FP64 gradient with
     respect to the snapshot's names.
  3. A comparison (``compare``) is the worst element over all parameters:
     ``max |found - oracle| / scale`` with ``scale`` per parameter tensor:
     its largest ``|oracle|`` element, floored at ``SCALE_FLOOR`` (1e-3) of
     the largest over all parameters (a parameter whose gradient is small is
     judged at its own size, one that is all but zero not at rounding noise),
     so one number judges a whole gradient or weight set; the worst
     element's parameter, index, found and oracle values are kept as evidence.
     A NaN or infinite element is an infinite error that names it.
  4. The tolerance derives from the parameters' dtype alone
     (``tolerance``): the smaller of ``1024 * eps`` and ``sqrt(eps)``
     (float32 1.2e-4, float64 2.3e-13, bfloat16 0.088, float16 0.031).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from .protocol import AdapterError, adapter_name, logits_of

__all__ = ["WorstElement", "FP64Oracle", "compare", "suite_loss", "snapshot", "tolerance", "token_logprobs64"]

MASKED = -100  # a target the suite masks: log-prob 0, no gradient
SCALE_FLOOR = 1e-3  # Rule 3: a parameter's scale is at least this fraction of the largest oracle element


def tolerance(dtype: torch.dtype) -> float:
    """Rule 4: the smaller of ``1024 * eps(dtype)`` and ``sqrt(eps(dtype))``."""
    eps = torch.finfo(dtype).eps
    return min(1024 * eps, math.sqrt(eps))


def trainable(module: torch.nn.Module) -> dict[str, Tensor]:
    """``module``'s ``requires_grad`` parameters by name (the weights the suite judges)."""
    return {name: p for name, p in module.named_parameters() if p.requires_grad}


def snapshot(module: torch.nn.Module) -> dict[str, Tensor]:
    """Rule 1: an FP64 copy of every trainable parameter of ``module`` now."""
    return {name: p.detach().to(torch.float64).clone() for name, p in trainable(module).items()}


def token_logprobs64(logits: Tensor, targets: Tensor) -> Tensor:
    """``log softmax(logits)[target]`` per position in FP64; a negative target gives 0."""
    logp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(targets >= 0, picked, torch.zeros_like(picked))


def suite_loss(logprobs: Tensor, advantages: Tensor, active_total: int) -> Tensor:
    """The suite's loss of one call's log-probs: ``-sum(logprobs * advantages) / active_total``.

    ``active_total`` is the unmasked token count of the whole step's batch, so
    losses of any split of the batch add up to the whole batch's loss.
    """
    return -(logprobs * advantages.to(logprobs.dtype)).sum() / active_total


@dataclass(frozen=True)
class WorstElement:
    """Rule 3: the worst element of ``found`` against the oracle, relative to its parameter's ``scale``."""

    error: float
    tolerance: float
    parameter: str
    index: tuple[int, ...]
    found: float
    oracle: float
    scale: float

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance

    def worst(self) -> str:
        return (
            f"worst element {self.parameter}{list(self.index)}: found {self.found:.6g}, oracle {self.oracle:.6g} "
            f"(error {self.error:.3g} of the parameter's scale {self.scale:.3g}; tolerance {self.tolerance:.3g})"
        )

    def evidence(self) -> dict[str, Any]:
        return {**asdict(self), "index": list(self.index), "ok": self.ok}


def compare(found: Mapping[str, Tensor | None], oracle: Mapping[str, Tensor], tol: float) -> WorstElement:
    """Rule 3 over the oracle's names; a missing or ``None`` found tensor counts as zeros.

    A non-finite element (NaN or inf, found or oracle) is an infinite error
    that names that element, so it never passes.
    """
    overall = max((float(t.abs().max()) for t in oracle.values() if t.numel()), default=0.0)
    worst = WorstElement(0.0, tol, "", (), 0.0, 0.0, 1.0)
    for name, expected in oracle.items():
        if not expected.numel():
            continue
        got = found.get(name)
        got64 = torch.zeros_like(expected) if got is None else got.detach().to(torch.float64).reshape(expected.shape)
        scale = max(float(expected.abs().max()), SCALE_FLOOR * overall) or 1.0
        finite = torch.isfinite(got64) & torch.isfinite(expected)
        error = torch.where(finite, (got64 - expected).abs() / scale, torch.full_like(expected, math.inf)).flatten()
        flat = int(error.argmax())
        if float(error[flat]) >= worst.error:
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), expected.shape))
            worst = WorstElement(
                float(error[flat]),
                tol,
                name,
                index,
                float(got64.flatten()[flat]),
                float(expected.flatten()[flat]),
                scale,
            )
    return worst


class FP64Oracle:
    """Rules 1-2: the FP64 copy of an adapter's ``module()`` and its gradients at a snapshot's weights."""

    def __init__(self, adapter: Any) -> None:
        self._adapter = adapter
        self._model = copy.deepcopy(adapter.module())
        self._model.requires_grad_(False)
        for param in self._model.parameters():
            if param.is_floating_point():
                param.data = param.data.to(torch.float64)

    def logprobs(self, weights: Mapping[str, Tensor], ids: Tensor, targets: Tensor) -> Tensor:
        """FP64 ``(B, T)`` target log-probs of the copy at ``weights``."""
        try:
            output = torch.func.functional_call(self._model, dict(weights), (ids,))
        except Exception as error:  # module() is not the model forward runs: a broken adapter
            raise AdapterError(
                adapter_name(self._adapter),
                f"module()(input_ids {tuple(ids.shape)}) raised "
                f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}",
                fix="return the model whose call maps (B, T) token ids to (B, T, V) logits (the one "
                "forward runs) from module()",
            ) from error
        return token_logprobs64(logits_of(self._adapter, output, ids), targets)

    def gradients(
        self, weights: Mapping[str, Tensor], batches: Sequence[tuple[Tensor, Tensor, Tensor]], active_total: int
    ) -> dict[str, Tensor]:
        """The FP64 gradient of the suite's loss summed over ``(ids, targets, advantages)`` batches at ``weights``."""
        leaves = {name: w.detach().clone().requires_grad_(True) for name, w in weights.items()}
        loss = torch.stack(
            [suite_loss(self.logprobs(leaves, ids, targets), adv, active_total) for ids, targets, adv in batches]
        ).sum()
        grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        return {name: torch.zeros_like(leaves[name]) if g is None else g for name, g in zip(leaves, grads)}
