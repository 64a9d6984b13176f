"""The adapter protocol: the only calls through which the conformance suite drives a trainer.

An adapter wraps one trainer behind the calls of :class:`Adapter`; the suite
(``validation.conform.suite``) builds it with a factory (a callable taking no
argument, named ``package.module:factory`` on the command line), starts it
from a :class:`ConformSpec` and judges it only through these calls, against
its own FP64 copy of ``module()`` (``validation.conform.oracle``). The full
contract, call by call, is in docs/conform.md#the-adapter-protocol.

Optional attributes an adapter may carry besides the protocol's:
``notes`` (a string: what it ignores of the spec, how it does what it
claims) and ``bitwise_resume`` (``True``: a resumed run must end bitwise
equal to the uninterrupted one, not only within tolerance).

:func:`require_protocol` refuses an adapter that cannot be driven (a missing
method, one whose signature does not take the suite's arguments, an unknown
capability) with :class:`AdapterError`, before any check
runs; the suite raises the same error for a call that returns the wrong
type or shape. Either names the adapter, what was expected and found, and
the fix, and ``rtv conform`` prints it as one line and exits 2.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from validation.errors import SetupError

__all__ = ["Adapter", "AdapterError", "CAPABILITIES", "ConformSpec", "METHODS", "require_protocol", "logits_of"]

CAPABILITIES = frozenset({"stale", "save", "processes"})
METHODS = ("start", "module", "forward", "backward", "optim_step", "zero_grad")  # every adapter
SAVE_METHODS = ("save", "load")  # adapters claiming "save"
ARGUMENTS = {
    "start": ("spec",),
    "module": (),
    "forward": ("input_tokens", "target_tokens"),
    "backward": ("loss",),
    "optim_step": (),
    "zero_grad": (),
    "save": ("path",),
    "load": ("path",),
}  # what the suite passes
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class ConformSpec:
    """The job every adapter is started with: a tiny decoder, its AdamW settings, the seed, the dtype, the bound.

    Shape fields (``vocab_size``, ``hidden_size``, ``layers``, ``heads``)
    describe a Qwen3-style decoder; an adapter may ignore those it cannot
    honour and say so in its ``notes``. ``seq_len`` and ``batch`` shape every
    batch the suite feeds (``(batch, seq_len)`` token ids). ``dtype`` names
    the parameters' dtype (a key of :data:`DTYPES`); the tolerances derive
    from it (``validation.conform.oracle.tolerance``). ``max_staleness``: the
    largest k the *stale* check backpropagates a forward after (>= 1).
    """

    vocab_size: int = 32
    hidden_size: int = 16
    layers: int = 1
    heads: int = 2
    seq_len: int = 8
    batch: int = 4
    lr: float = 1e-2
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    seed: int = 0
    dtype: str = "float32"
    max_staleness: int = 2

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "layers", "heads", "seq_len", "max_staleness"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SetupError(
                    f"ConformSpec.{name}: expected an int >= 1, found {value!r}", fix=f"give {name} a positive int"
                )
        if not isinstance(self.batch, int) or self.batch < 2:
            raise SetupError(
                f"ConformSpec.batch: expected an int >= 2 (the splits check needs two rows), found {self.batch!r}",
                fix="give batch an int >= 2",
            )
        if self.hidden_size % self.heads:
            raise SetupError(
                f"ConformSpec: hidden_size {self.hidden_size} is not a multiple of heads {self.heads}",
                fix="pick heads dividing hidden_size",
            )
        if self.dtype not in DTYPES:
            raise SetupError(
                f"ConformSpec.dtype: expected one of {sorted(DTYPES)}, found {self.dtype!r}",
                fix="name a floating dtype",
            )
        if not (math.isfinite(self.lr) and self.lr > 0 and self.eps >= 0 and self.weight_decay >= 0):
            raise SetupError(
                f"ConformSpec: expected lr > 0, eps >= 0, weight_decay >= 0, found lr={self.lr}, "
                f"eps={self.eps}, weight_decay={self.weight_decay}",
                fix="give finite, sign-correct values",
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@runtime_checkable
class Adapter(Protocol):
    """What the suite calls (docs/conform.md#the-adapter-protocol has each call's contract)."""

    name: str
    capabilities: frozenset[str]  # any of CAPABILITIES; gradients and splits are always checked

    def start(self, spec: ConformSpec) -> None: ...  # build model + optimizer from the spec, seeded

    def module(self) -> torch.nn.Module: ...  # the live model: module(ids (B,T)) -> logits (B,T,V) or .logits

    def forward(self, input_tokens: Tensor, target_tokens: Tensor) -> Tensor: ...  # (B,T) target log-probs

    def backward(self, loss: Tensor) -> None: ...  # gradients land in module()'s .grad

    def optim_step(self) -> None: ...  # AdamW with spec.lr, spec.betas, spec.eps, spec.weight_decay

    def zero_grad(self) -> None: ...

    def save(self, path: str) -> None: ...  # only with "save"

    def load(self, path: str) -> None: ...  # only with "save": continue a fresh adapter from the save


class AdapterError(SetupError):
    """An adapter the suite cannot drive (exit 2): the message names the adapter, what is wrong and the fix."""

    def __init__(self, adapter: str, cause: str, *, fix: str) -> None:
        super().__init__(f"adapter {adapter!r} is broken: {cause}", fix=fix)

    def one_line(self) -> str:
        """The cause and the fix on one line (``rtv conform`` prints it so)."""
        return " ".join(f"{self.cause}; fix: {self.fix}".split())


def adapter_name(adapter: Any) -> str:
    return str(getattr(adapter, "name", type(adapter).__name__))


def require_protocol(adapter: Any) -> None:
    """Raise :class:`AdapterError` unless ``adapter`` has a name, known capabilities and every method they need."""
    name = adapter_name(adapter)
    capabilities = getattr(adapter, "capabilities", None)
    if not isinstance(capabilities, (set, frozenset)) or not capabilities <= CAPABILITIES:
        raise AdapterError(
            name,
            f"expected capabilities a frozenset of {sorted(CAPABILITIES)}, found {capabilities!r}",
            fix="set capabilities = frozenset({...}) with only the capabilities it has",
        )
    needed = METHODS + (SAVE_METHODS if "save" in capabilities else ())
    missing = [method for method in needed if not callable(getattr(adapter, method, None))]
    if missing:
        raise AdapterError(
            name,
            f"missing method {', '.join(missing)} (needed: {', '.join(needed)})",
            fix=f"define {', '.join(f'{m}()' for m in missing)} as in docs/conform.md#the-adapter-protocol"
            + (", or drop 'save' from capabilities" if set(missing) <= set(SAVE_METHODS) else ""),
        )
    for method in needed:
        _require_arguments(name, method, getattr(adapter, method))


def _require_arguments(name: str, method: str, bound: Any) -> None:
    """:class:`AdapterError` unless ``bound`` accepts the positional arguments the suite passes it."""
    try:
        signature = inspect.signature(bound)
    except (TypeError, ValueError):  # a callable inspect cannot read (a builtin): the call itself will tell
        return
    expected = ARGUMENTS[method]
    try:
        signature.bind(*expected)
    except TypeError:
        wanted = f"{method}({', '.join(expected)})"
        raise AdapterError(
            name,
            f"{method}({', '.join(signature.parameters)}) cannot be called as {wanted}",
            fix=f"define {wanted} as in docs/conform.md#the-adapter-protocol",
        ) from None


def logits_of(adapter: Any, output: Any, ids: Tensor, vocab: int | None = None) -> Tensor:
    """The logits tensor of ``module()(ids)``'s ``output`` (a tensor or an object with ``.logits``), shape-checked."""
    logits = getattr(output, "logits", output)
    batch, width = ids.shape
    if (
        not isinstance(logits, Tensor)
        or logits.dim() != 3
        or tuple(logits.shape[:2]) != (batch, width)
        or (vocab is not None and logits.shape[2] < vocab)
    ):
        found = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise AdapterError(
            adapter_name(adapter),
            f"module()(input_ids {tuple(ids.shape)}) returned {found}; expected "
            f"logits ({batch}, {width}, vocab) or an object with .logits of that shape",
            fix="return the model whose call maps (B, T) token ids to (B, T, V) logits from module()",
        )
    return logits
