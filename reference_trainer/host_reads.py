"""The one place the trainer reads device values on the host.

NOTE [Host syncs]: on CUDA a host read waits for every queued kernel (a
stall), so the hot paths read rarely and only through :func:`read_on_host`,
which tests observe with ``testing.observe_host_reads``:

- a forward call reads once for the token-range check of its inputs, all
  inputs at once, and only for inputs on a device (inputs on the CPU are
  checked on the CPU, before the copy);
- the padded forward reads nothing: the trainer builds its masks right-padded,
  so ``DecoderLM.forward`` skips its padding check inside
  :func:`trusted_padding`;
- a forward made while an older record of its checkpoint (and logical rank)
  is pending with a ``"when_available"`` correction reads token keys once:
  its own and those of such records not read before, together (the log-prob
  cache of ``corrections.KnownLogprobs``, which reads each record's keys at
  most once); otherwise it reads nothing more;
- a backward reads once, accumulating or not: the fused norms of the
  gradients it will publish, one per checkpoint, read together
  (``commit.staged_norms``); they prove the gradients finite, and
  ``optim_step`` reuses them (NOTE [Gradient norm]). A replayed record adds
  its bitwise check and a stale record with an importance correction adds
  the correction's checks and statistics, and a record whose inputs carry
  behaviour revisions or log-probs one read of their lags (NOTE [Behaviour
  tokens] Rule 5).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from . import seams

__all__ = ["padding_trusted", "read_on_host", "trusted_padding"]

_TRUSTED = contextvars.ContextVar("trusted_right_padding", default=False)


def read_on_host(value: torch.Tensor, why: str) -> Any:
    """``value.tolist()`` (a Python scalar for a 0-d tensor): one transfer, one sync on a device."""
    seams.note_host_read(why, value.device)
    return value.tolist()


@contextmanager
def trusted_padding() -> Iterator[None]:
    """Inside the block the model trusts that attention masks are right-padded (the trainer built them)."""
    token = _TRUSTED.set(True)
    try:
        yield
    finally:
        _TRUSTED.reset(token)


def padding_trusted() -> bool:
    return _TRUSTED.get()
