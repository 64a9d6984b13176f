"""A save's ``trainer.json``: its fields written, then read back and checked before anything is built.

Every field is checked for its type and range, and against the others (a
checkpoint's generation below the next one, an origin or a kept version at
no later revision than the checkpoint's), before ``Trainer.load`` touches
the model or the RNG (NOTE [Resume] Rule 6). A field that fails is a
:class:`CorruptSaveError` on ``trainer.json`` (problem ``"invalid"``) naming
the field, what it must be and what was found: the file's digest matched, so
whatever wrote it was not this trainer's ``save``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

from .adamw import AdamWConfig
from .checkpoints import CheckpointVersion
from .errors import ConfigError, CorruptSaveError, int_at_least
from .lora import LoRAConfig
from .options import UNSET, ForwardOptions, ImportanceCorrection

__all__ = ["TRAINER", "CheckpointMeta", "TrainerMeta", "check_revisions", "decode_meta", "encode_options"]

TRAINER = "trainer.json"


@dataclass(frozen=True)
class CheckpointMeta:
    """One checkpoint's entry, checked: how to build it and what its file's state must agree with."""

    name: str
    file: str
    lora: LoRAConfig | None
    optimizer: AdamWConfig
    generation: int
    origins: set[tuple[CheckpointVersion, int]]  # (forward version, staleness bound) of each committed gradient
    kept: dict[int, int]  # revision -> staleness bound of the versions pending forwards used (NOTE [Resume] Rule 2)


@dataclass(frozen=True)
class TrainerMeta:
    """``trainer.json``, checked."""

    model: dict[str, str]
    options: ForwardOptions | None
    next_generation: int
    checkpoints: list[CheckpointMeta]
    logical_dp: int | None
    lineage: frozenset[str]  # the saver's lineage and identity (NOTE [Resume] Rule 2)


class _Check:
    """Raises the ``CorruptSaveError`` for a field of ``trainer.json`` under ``path``."""

    def __init__(self, path: object) -> None:
        self.path = path

    def fail(self, field: str, expected: str, found: object) -> CorruptSaveError:
        return CorruptSaveError(self.path, TRAINER, "invalid", f"field {field} {expected}", repr(found)[:200])

    def that(self, ok: bool, field: str, expected: str, found: object) -> None:
        if not ok:
            raise self.fail(field, expected, found)

    def int(self, value: object, field: str, minimum: int, maximum: int | None = None) -> int:
        if not int_at_least(value, minimum) or (maximum is not None and value > maximum):
            raise self.fail(field, f"an int in [{minimum}, {'...' if maximum is None else maximum}]", value)
        return value

    def key(self, entry: dict[str, Any], key: str, where: str) -> Any:
        self.that(key in entry, f"{where}{key}", "present", sorted(entry))
        return entry[key]

    def built(self, field: str, make: Callable[[], Any], value: object) -> Any:
        """``make()``, its refusal (a bad keyword or value) raised as this field's."""
        try:
            return make()
        except (TypeError, ConfigError) as exc:
            raise self.fail(field, f"accepted ({exc})", value) from None


def decode_meta(path: object, data: bytes, files: set[str], format_: dict[str, Any]) -> TrainerMeta:
    """``trainer.json``'s bytes checked against each other and ``files`` (the save's file names); a save of another
    ``format_`` (another version wrote it) is a ``ConfigError``."""
    check = _Check(path)
    try:
        meta = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise check.fail("(the file)", "a JSON object", str(exc)) from None
    check.that(isinstance(meta, dict), "(the file)", "a JSON object", type(meta).__name__)
    if {k: meta.get(k) for k in format_} != format_:
        raise ConfigError("path", str(path), f"a save of {format_}", hint="it was written by another version")
    model = check.key(meta, "model", "")
    check.that(
        isinstance(model, dict) and all(isinstance(model.get(k), str) for k in ("config", "digest")),
        "model",
        "an object of strings 'config' and 'digest'",
        model,
    )
    next_generation = check.int(check.key(meta, "next_generation", ""), "next_generation", 0)
    entries = check.key(meta, "checkpoints", "")
    check.that(isinstance(entries, list), "checkpoints", "a list", entries)
    checkpoints = [_checkpoint(check, e, f"checkpoints[{i}].", next_generation, files) for i, e in enumerate(entries)]
    names = [c.name for c in checkpoints]
    check.that(len(set(names)) == len(names), "checkpoints", "distinct names", names)
    logical_dp = check.key(meta, "logical_dp", "")
    check.that(logical_dp is None or int_at_least(logical_dp, 1), "logical_dp", "null or an int >= 1", logical_dp)
    saved_lineage = meta.get("lineage", [])
    check.that(isinstance(saved_lineage, list), "lineage", "a list of trainer identities (strings)", saved_lineage)
    lineage = [*saved_lineage, *([meta["identity"]] if "identity" in meta else [])]
    check.that(all(isinstance(i, str) for i in lineage), "lineage/identity", "trainer identities (strings)", lineage)
    options = check.key(meta, "options", "")
    check.that(options is None or isinstance(options, dict), "options", "null or an object", options)
    return TrainerMeta(
        model,
        check.built("options", lambda: _decode_options(options), options),
        next_generation,
        checkpoints,
        logical_dp,
        frozenset(lineage),
    )


def _checkpoint(check: _Check, entry: object, where: str, next_generation: int, files: set[str]) -> CheckpointMeta:
    if not isinstance(entry, dict):
        raise check.fail(where[:-1], "an object", entry)
    name = check.key(entry, "name", where)
    check.that(isinstance(name, str) and bool(name), f"{where}name", "a non-empty string", name)
    file = check.key(entry, "file", where)
    check.that(file in files and file != TRAINER, f"{where}file", f"one of the save's files {sorted(files)}", file)
    lora, optimizer = check.key(entry, "lora", where), check.key(entry, "optimizer", where)
    generation = check.int(check.key(entry, "generation", where), f"{where}generation", 0, next_generation - 1)
    origins = _triples(check, entry.get("origins"), f"{where}origins", 3)
    for forward_generation, _, _ in origins:
        check.that(forward_generation == generation, f"{where}origins", f"forwards of generation {generation}", origins)
    kept = _triples(check, entry.get("kept", []), f"{where}kept", 2)
    return CheckpointMeta(
        name=name,
        file=file,
        lora=None if lora is None else check.built(f"{where}lora", lambda: LoRAConfig(**lora), lora),
        optimizer=check.built(f"{where}optimizer", lambda: AdamWConfig(**optimizer), optimizer),
        generation=generation,
        origins={(CheckpointVersion(name, g, r), bound) for g, r, bound in origins},
        kept={revision: bound for revision, bound in kept},
    )


def _triples(check: _Check, value: object, field: str, width: int) -> list[tuple[int, ...]]:
    """A list of ``width``-long lists of ints >= 0."""
    if not isinstance(value, list) or not all(
        isinstance(item, list) and len(item) == width and all(int_at_least(x, 0) for x in item) for item in value
    ):
        raise check.fail(field, f"a list of {width} ints >= 0 each", value)
    return [tuple(item) for item in value]


def check_revisions(path: object, index: int, spec: CheckpointMeta, revision: int) -> None:
    """The entry's origins and kept versions against its file's ``revision``: none later; kept ones still in bound."""
    check = _Check(path)
    for version, _ in spec.origins:
        check.that(
            version.revision <= revision,
            f"checkpoints[{index}].origins",
            f"revisions <= the checkpoint's revision {revision}",
            version.revision,
        )
    for kept, bound in spec.kept.items():
        check.that(
            kept < revision and revision - kept <= bound,
            f"checkpoints[{index}].kept",
            f"revisions below the checkpoint's revision {revision}, within their bound",
            [kept, bound],
        )


def encode_options(options: ForwardOptions | None) -> dict[str, Any] | None:
    if options is None:
        return None
    encoded = {
        f.name: getattr(options, f.name) for f in fields(ForwardOptions) if getattr(options, f.name) is not UNSET
    }
    for name in ("corrections", "behaviour_corrections"):
        if name in encoded:
            encoded[name] = [asdict(c) for c in encoded[name]]
    return encoded


def _decode_options(encoded: dict[str, Any] | None) -> ForwardOptions | None:
    if encoded is None:
        return None
    for name in ("corrections", "behaviour_corrections"):
        if name in encoded:
            encoded = {**encoded, name: tuple(ImportanceCorrection(**c) for c in encoded[name])}
    return ForwardOptions(**encoded)
