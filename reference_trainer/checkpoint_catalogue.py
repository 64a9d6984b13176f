"""The trainer's named checkpoints: adding one, finding one by name, and the generations they take.

A :class:`CheckpointCatalogue` holds the checkpoints of one frozen base
model by name, in the order they were added, and the generation counter
every added or loaded checkpoint draws from (a save keeps it: NOTE [Resume]
in ``resume.py``). ``Trainer`` owns one and answers
its ``add_checkpoint``, ``checkpoint``, ``checkpoints`` and
``next_generation`` through it; ``checkpoint=`` and ``checkpoints=``
arguments are resolved here. Bad names and arguments are ``ConfigError``
and leave the catalogue as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, ValuesView

from .checkpoints import AdamWConfig, Checkpoint
from .errors import ConfigError
from .lora import LoRAConfig
from .model import DecoderLM

__all__ = ["CheckpointCatalogue"]


class CheckpointCatalogue:
    """The named checkpoints over ``model`` (the frozen base) and the generation the next one takes."""

    def __init__(self, model: DecoderLM) -> None:
        self._model = model
        self._checkpoints: dict[str, Checkpoint] = {}
        self.next_generation = 0
        """The generation the next added or loaded checkpoint takes (kept by saves, NOTE [Resume])."""

    def add(
        self,
        name: str,
        *,
        lora: LoRAConfig | None,
        full: bool,
        optimizer: AdamWConfig | None,
        seed: int | None,
    ) -> Checkpoint:
        """``Trainer.add_checkpoint``: a new checkpoint ``name``, a LoRA adapter (``lora=``) or a full copy
        (``full=True``), at a new generation; ``optimizer`` ``None`` is the default ``AdamWConfig()``."""
        if not isinstance(name, str) or not name:
            raise ConfigError("name", name, "a non-empty str")
        if name in self._checkpoints:
            raise ConfigError("name", name, f"a name not already used (existing: {sorted(self._checkpoints)})")
        if not isinstance(full, bool):
            raise ConfigError("full", full, "a bool")
        if (lora is None) == (not full):
            raise ConfigError("lora/full", (lora, full), "exactly one of lora=LoRAConfig(...) or full=True")
        if lora is not None and not isinstance(lora, LoRAConfig):
            raise ConfigError("lora", lora, "a LoRAConfig")
        optimizer = optimizer if optimizer is not None else AdamWConfig()
        if not isinstance(optimizer, AdamWConfig):
            raise ConfigError("optimizer", optimizer, "an AdamWConfig")
        checkpoint = Checkpoint(
            name, self._model, lora=lora, full=full, optimizer=optimizer, generation=self.new_generation(), seed=seed
        )
        self._checkpoints[name] = checkpoint
        return checkpoint

    def get(self, name: str) -> Checkpoint:
        """The checkpoint ``name``; a ``ConfigError`` listing the names for any other value."""
        if not isinstance(name, str) or name not in self._checkpoints:
            raise ConfigError("checkpoint", name, f"a checkpoint name, one of {sorted(self._checkpoints)}")
        return self._checkpoints[name]

    def by_name(self) -> dict[str, Checkpoint]:
        """A copy of the name -> checkpoint table, in the order they were added."""
        return dict(self._checkpoints)

    def values(self) -> ValuesView[Checkpoint]:
        """Every checkpoint, in the order they were added (a live view)."""
        return self._checkpoints.values()

    def new_generation(self) -> int:
        """The next generation, taken: an added or loaded checkpoint's."""
        self.next_generation += 1
        return self.next_generation - 1

    def select(self, checkpoint: str | None) -> Checkpoint:
        """The checkpoint a ``checkpoint=`` argument names; ``None`` is the only one, refused unless there is one."""
        if checkpoint is not None:
            return self.get(checkpoint)
        if len(self._checkpoints) != 1:
            raise ConfigError(
                "checkpoint",
                None,
                f"a checkpoint name (the trainer has {sorted(self._checkpoints) or 'none'}); "
                "add one with add_checkpoint or pass checkpoint=...",
            )
        return next(iter(self._checkpoints.values()))

    def selected(self, checkpoints: Iterable[str] | str | None) -> list[Checkpoint]:
        """The checkpoints a ``checkpoints=`` argument names, each once, in order (a str is one name; ``None``: all)."""
        if checkpoints is None:
            return list(self._checkpoints.values())
        names = [checkpoints] if isinstance(checkpoints, str) else checkpoints
        if not isinstance(names, Iterable):
            raise ConfigError("checkpoints", checkpoints, "None, a checkpoint name or an iterable of names")
        return list({id(c): c for c in map(self.get, names)}.values())
