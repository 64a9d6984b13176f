"""A trainer written outside this project, behind the conformance suite's adapter protocol (docs/conform.md).

    PYTHONPATH=examples rtv conform --adapter conform_adapter:make_adapter

``TinyTokenModel`` stands for "your model": token and position embeddings and
an output head, so position t's logits depend on tokens up to t only. The
adapter builds it and a ``torch.optim.AdamW`` from the spec, claims
``"save"`` (a ``torch.save`` of the model's and optimizer's states and the
pending gradients, so a resumed run is bitwise the same) and nothing else: the suite reports *stale* and
*processes* as not applicable. It imports nothing of the harness but the
spec's fields, which it reads by name.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn


class TinyTokenModel(nn.Module):
    """``(B, T)`` ids -> ``(B, T, V)`` logits: embeddings of the token and its position, then a linear head."""

    def __init__(self, vocab_size: int, hidden_size: int, max_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, hidden_size)
        self.positions = nn.Embedding(max_len, hidden_size)
        self.head = nn.Linear(hidden_size, vocab_size)

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.head(torch.tanh(self.tokens(input_ids) + self.positions(positions)))  # (B, T, V)


class TinyTrainerAdapter:
    """The adapter: every call of the protocol, ``save`` and ``load`` included."""

    name = "tiny-token-model"
    capabilities = frozenset({"save"})
    bitwise_resume = True
    notes = "ignores layers and heads (one embedding layer and a head)"

    def start(self, spec) -> None:
        torch.manual_seed(spec.seed)
        dtype = getattr(torch, spec.dtype)
        self._model = TinyTokenModel(spec.vocab_size, spec.hidden_size, spec.seq_len).to(dtype)
        self._optimizer = torch.optim.AdamW(
            self._model.parameters(), lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay
        )

    def module(self) -> nn.Module:
        return self._model

    def forward(self, input_tokens: Tensor, target_tokens: Tensor) -> Tensor:
        logits = self._model(input_tokens)  # (B, T, V) in the spec's dtype
        # Promote only upward (bfloat16 -> float32); never downcast: float64 log-probs stay float64.
        logprobs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        picked = logprobs.gather(-1, target_tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return picked * (target_tokens != -100)  # (B, T); masked targets: 0, no gradient

    def backward(self, loss: Tensor) -> None:
        loss.backward()

    def optim_step(self) -> None:
        self._optimizer.step()

    def zero_grad(self) -> None:
        self._optimizer.zero_grad(set_to_none=True)

    def save(self, path: str) -> None:
        # The gradients accumulated since the last step are part of the state: a save between backward and
        # optim_step that dropped them would resume to other weights (the resume check catches that).
        grads = {name: p.grad for name, p in self._model.named_parameters()}
        torch.save(
            {"model": self._model.state_dict(), "optimizer": self._optimizer.state_dict(), "grads": grads},
            os.path.join(path, "state.pt"),
        )

    def load(self, path: str) -> None:
        state = torch.load(os.path.join(path, "state.pt"))
        self._model.load_state_dict(state["model"])
        self._optimizer.load_state_dict(state["optimizer"])
        for name, param in self._model.named_parameters():
            param.grad = state["grads"][name]


def make_adapter() -> TinyTrainerAdapter:
    """The factory ``rtv conform --adapter conform_adapter:make_adapter`` calls."""
    return TinyTrainerAdapter()
