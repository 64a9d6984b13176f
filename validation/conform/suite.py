"""The suite: every check on one adapter, named by a shipped name or ``package.module:factory``.

:func:`conform` resolves the adapter (:func:`resolve`), refuses one that
cannot be driven (:class:`~validation.conform.protocol.AdapterError`, exit 2)
and runs :data:`CHECKS` in order, each on a fresh adapter from the factory.
A check whose capability the adapter does not claim (:data:`REQUIRES`) is
*not applicable*, never passed. An exception an adapter raises inside a
check (a trainer that cannot do what the check asks) fails that check with
its type and message; a protocol violation (a missing method, a wrong
return type or shape) stops the suite as a broken adapter.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from .adapters import SHIPPED
from .checks import FAILED, NOT_APPLICABLE, PASSED, Verdict, splits, stale, sync
from .processes import processes
from .protocol import AdapterError, ConformSpec, adapter_name, require_protocol
from .resume import resume

__all__ = [
    "AdapterReport",
    "CHECKS",
    "REQUIRES",
    "conform",
    "load_adapter_factory",
    "probe",
    "require_distinct_names",
    "resolve",
]

CHECKS = ("sync", "stale", "splits", "resume", "processes")
REQUIRES = {"stale": "stale", "resume": "save", "processes": "processes"}  # check -> the capability it needs
_BY_FACTORY = {"sync": sync, "stale": stale, "splits": splits, "resume": resume}  # processes takes the path


@dataclass(frozen=True)
class AdapterReport:
    """One adapter's verdicts, with what it claimed and said of itself."""

    name: str
    path: str
    capabilities: tuple[str, ...]
    notes: str
    verdicts: tuple[Verdict, ...]

    @property
    def passed(self) -> bool:
        """Every applicable check passed (and at least one ran)."""
        ran = [v for v in self.verdicts if v.status != NOT_APPLICABLE]
        return bool(ran) and all(v.status == PASSED for v in ran)

    def verdict(self, check: str) -> Verdict:
        return next(v for v in self.verdicts if v.check == check)


def resolve(adapter: str) -> str:
    """A shipped adapter's name, or ``package.module:factory`` as given: its factory path."""
    if adapter in SHIPPED:
        return SHIPPED[adapter][0]
    module, colon, factory = adapter.partition(":")
    if not colon or not module or not factory.isidentifier():
        raise AdapterError(
            adapter,
            f"expected a shipped adapter ({', '.join(SHIPPED)}) or package.module:factory",
            fix="pass --adapter package.module:factory (a callable returning an Adapter), or a name "
            "rtv conform --list shows",
        )
    return adapter


def load_adapter_factory(path: str) -> Callable[[], Any]:
    """The callable ``path`` names; :class:`AdapterError` for a module that is not there or fails to import, or a
    name that is not there."""
    module_name, _, name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise AdapterError(
            path,
            f"cannot import {module_name} ({error})",
            fix="put its folder on PYTHONPATH (or install it) and check the module name",
        ) from error
    except Exception as error:  # a module that fails at import (SyntaxError, its own raise) is broken
        raise AdapterError(
            path,
            f"importing {module_name} raised {type(error).__name__}: {error}",
            fix=f"make {module_name} import cleanly (python -c 'import {module_name}')",
        ) from error
    factory = getattr(module, name, None)
    if not callable(factory):
        raise AdapterError(
            path,
            f"{module_name} has no callable {name!r}",
            fix=f"define {name}() returning an Adapter in {module_name}",
        ) from None
    return cast(Callable[[], Any], factory)


def _run_check(check: str, factory: Callable[[], Any], path: str, spec: ConformSpec) -> Verdict:
    try:
        return processes(path, spec) if check == "processes" else _BY_FACTORY[check](factory, spec)
    except AdapterError:
        raise
    except Exception as error:  # noqa: BLE001 - the adapter's own failure is this check's verdict
        return Verdict(
            check,
            FAILED,
            f"the adapter raised {type(error).__name__}: {_gist(str(error))}",
            {"raised": type(error).__name__, "message": str(error)},
        )


def _gist(message: str) -> str:
    """A message's first line, and its last (a traceback's exception, a spawned rank's cause) when it has more."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return (
        ""
        if not lines
        else lines[0]
        if len(lines) == 1
        else f"{lines[0]} ... {lines[-1]} (whole message in the evidence)"
    )


def probe(adapter: str) -> tuple[str, Callable[[], Any], Any]:
    """``(path, factory, adapter)`` for ``adapter``: its factory called once, the result checked against the protocol."""
    path = resolve(adapter)
    factory = load_adapter_factory(path)
    try:
        probed = factory()
    except Exception as error:
        raise AdapterError(
            path,
            f"the factory raised {type(error).__name__}: {error}",
            fix="make the factory return an Adapter without arguments (build the model in start)",
        ) from error
    require_protocol(probed)
    return path, factory, probed


def require_distinct_names(adapters: Sequence[str]) -> None:
    """:class:`AdapterError` (before any check runs) when two of ``adapters`` carry one name: the record's checks
    are named ``"<adapter> <check>"``, so the second would overwrite the first's."""
    seen: dict[str, str] = {}
    for adapter in adapters:
        name = adapter_name(probe(adapter)[2])
        if name in seen:
            raise AdapterError(
                adapter,
                f"its name {name!r} is also {seen[name]!r}'s (the record names each check '<adapter> <check>')",
                fix="name each adapter once, or give each a distinct name",
            )
        seen[name] = adapter


def conform(
    adapter: str,
    spec: ConformSpec,
    *,
    checks: Sequence[str] = CHECKS,
    progress: Callable[[str, Verdict], None] | None = None,
) -> AdapterReport:
    """Run ``checks`` (in :data:`CHECKS` order) on the adapter ``adapter`` names; ``progress`` sees each verdict."""
    path, factory, probed = probe(adapter)
    verdicts = []
    for check in (c for c in CHECKS if c in checks):
        needed = REQUIRES.get(check)
        if needed is not None and needed not in probed.capabilities:
            verdict = Verdict(check, NOT_APPLICABLE, f"the adapter does not claim {needed!r}")
        else:
            verdict = _run_check(check, factory, path, spec)
        verdicts.append(verdict)
        if progress is not None:
            progress(adapter_name(probed), verdict)
    return AdapterReport(
        adapter_name(probed),
        path,
        tuple(sorted(probed.capabilities)),
        str(getattr(probed, "notes", "")),
        tuple(verdicts),
    )
