"""Weight publication: a checkpoint's weights at one version, and how an engine stages them.

NOTE [Weight publication]
  1. A publication is a checkpoint's trainable tensors at one version, copied
     when made (a LoRA adapter's factors with its ``LoRAConfig``, or a full
     checkpoint's parameters), with its ``CheckpointVersion``; ``nbytes`` is
     what crosses to the engine.
  2. All or nothing: the engine checks every tensor (names, shapes, finite
     values) and stages each into a new tensor, calling the
     ``"weight_publication"`` fault seam with its index. A failure raises
     :class:`PublicationError` naming the tensor, and the served tensors were
     never written, so the previous version is served bitwise; only a
     complete staging is switched in, by one assignment.
  3. Compare-and-set: ``expected`` must be the live version, else
     :class:`VersionConflictError` (``None`` skips that check); whatever
     ``expected``, a publication must be newer (same checkpoint name, larger
     ``(generation, revision)``) than what the engine serves or holds
     pending. A refused publication changes nothing.
  4. Modes for generations in flight: ``"inflight"`` switches now, each
     running generation's KV cache rebuilt at the new weights before its next
     token, so every token's behaviour log-prob is exactly its version's.
     ``"drain"`` switches when the last running generation finishes or is
     cancelled (at once when none runs); starting one while a drained
     publication waits is an ``EngineBusyError``. Each token records the
     revision that drew it.
  5. Cost: the tensors, bytes and seconds of the apply are reported, a
     measurement, never a check.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .. import seams
from ..checkpoints import Checkpoint, CheckpointVersion
from ..errors import PublicationError, VersionConflictError
from ..lora import LoRAConfig, adapter_shapes
from ..model import DecoderLM

__all__ = ["MODES", "WeightPublication", "PublicationReport", "ServedWeights", "publication_of", "stage", "check_newer"]

MODES = ("drain", "inflight")


@dataclass(frozen=True, eq=False)
class WeightPublication:
    """A checkpoint's weights at ``version`` (Rule 1): ``tensors`` by name, ``lora`` for an adapter (else full)."""

    version: CheckpointVersion
    tensors: Mapping[str, torch.Tensor]
    lora: LoRAConfig | None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True, kw_only=True)
class PublicationReport:
    """One publication's outcome: ``switched`` now (else it waits for a drain), its size and time (Rule 5)."""

    version: CheckpointVersion
    previous: CheckpointVersion | None
    mode: str
    switched: bool
    tensors: int
    nbytes: int
    seconds: float


@dataclass(frozen=True, eq=False)
class ServedWeights:
    """What an engine serves: a version and its staged tensors (``decoder.``-prefixed names for a full
    checkpoint, adapter names for a LoRA one); never written after staging (Rule 2)."""

    version: CheckpointVersion
    tensors: Mapping[str, torch.Tensor]
    lora: LoRAConfig | None


def publication_of(checkpoint: Checkpoint) -> WeightPublication:
    """Copies of ``checkpoint``'s live trainable tensors at its current version (Rule 1)."""
    tensors = {name: param.detach().clone() for name, param in checkpoint.named_parameters()}
    return WeightPublication(version=checkpoint.version, tensors=tensors, lora=checkpoint.lora_config)


def check_newer(
    publication: WeightPublication, live: CheckpointVersion | None, expected: CheckpointVersion | None
) -> None:
    """Rule 3: raise ``VersionConflictError`` unless ``publication`` may replace ``live``."""
    version = publication.version
    if expected is not None and expected != live:
        raise VersionConflictError(
            f"publication of {version}: expected the engine to serve {expected}, found {live}; "
            "read engine.version and publish again",
            version=version,
            live=live,
        )
    if live is None:
        return
    newer = version.name == live.name and (version.generation, version.revision) > (live.generation, live.revision)
    if not newer:
        raise VersionConflictError(
            f"publication of {version}: expected a newer version of checkpoint {live.name!r} than {live} "
            "(a larger (generation, revision)), found an older, equal or other checkpoint's; publish after a step",
            version=version,
            live=live,
        )


def _expected_shapes(model: DecoderLM, lora: LoRAConfig | None) -> dict[str, tuple[int, ...]]:
    if lora is not None:
        return adapter_shapes(model, lora)
    return {name: tuple(param.shape) for name, param in model.named_parameters()}


def stage(publication: WeightPublication, model: DecoderLM, dtype: torch.dtype) -> ServedWeights:
    """New tensors of ``dtype`` on the model's device for every published tensor, or ``PublicationError`` (Rule 2)."""
    version = publication.version
    expected = _expected_shapes(model, publication.lora)
    if set(publication.tensors) != set(expected):
        missing, extra = (
            sorted(set(expected) - set(publication.tensors)),
            sorted(set(publication.tensors) - set(expected)),
        )
        raise PublicationError(
            f"publication of {version}: expected the tensors the engine's model takes, found {len(missing)} missing "
            f"{missing[:3]} and {len(extra)} unexpected {extra[:3]}; publish a checkpoint of the engine's base model",
            version=version,
        )
    device = model.lm_head.weight.device
    prefix = "" if publication.lora is not None else "decoder."
    staged: dict[str, torch.Tensor] = {}
    for index, name in enumerate(expected):
        tensor = publication.tensors[name]
        if tuple(tensor.shape) != expected[name] or not tensor.dtype.is_floating_point:
            raise PublicationError(
                f"publication of {version}: tensor {name!r} expected a floating tensor of shape {expected[name]}, "
                f"found {tensor.dtype} {tuple(tensor.shape)}; nothing was applied",
                version=version,
                tensor=name,
            )
        try:
            seams.maybe_fail("weight_publication", index)
            copy = tensor.detach().to(device=device, dtype=dtype, copy=True)
        except Exception as exc:
            raise PublicationError(
                f"publication of {version} failed at tensor {index} ({name!r}): {exc}; "
                "nothing was applied, the engine serves what it served",
                version=version,
                tensor=name,
            ) from exc
        if not bool(torch.isfinite(copy).all()):
            raise PublicationError(
                f"publication of {version}: tensor {name!r} expected finite values in {dtype}, found "
                f"non-finite ones; nothing was applied",
                version=version,
                tensor=name,
            )
        staged[prefix + name] = copy
    return ServedWeights(version=version, tensors=staged, lora=publication.lora)
