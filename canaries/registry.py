"""The canary spine: one interface, one registry.

A canary is a module ``canaries.<name>`` with one entry point::

    def run(preset: str, profile: str, out_dir: Path) -> Path

``preset`` is one of :data:`PRESET_NAMES` (a GPU preset on a machine without CUDA
either runs its CPU stand-in and says so in the evidence, or raises
``validation.errors.SetupError`` when it cannot); ``profile`` is one of
:data:`PROFILES` (``quick`` for ``rtv run`` and the test suite, ``default``
for ``rtv canary NAME``, ``nightly`` for deep runs). It writes one
write-once evidence record (``validation.evidence.make_record`` at
``validation.evidence.evidence_path``) and returns its path; a failed check
is a ``passed: false`` record, never an exception.

Adding a canary is one module plus one line in :data:`CANARIES`. Modules are
imported only when a canary runs, so ``rtv --help`` stays instant.
``rtv canary``, ``rtv run`` and the mutation suite all go through here.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from validation.errors import SetupError

__all__ = ["Canary", "CANARIES", "PRESET_NAMES", "PROFILES", "canary"]

# The names of ``canaries.presets.PRESETS``, written here so ``rtv --help`` needs no torch
# (tests/canaries/test_cli.py checks they agree).
PRESET_NAMES = ("cpu", "gpu", "gpu-8b")
PROFILES = ("quick", "default", "nightly")


@dataclass(frozen=True, kw_only=True)
class Canary:
    """A registered canary: its CLI name, its module, a one-line summary.

    ``enforced``: whether ``rtv run`` fails (exit 1) when this canary's
    evidence says failed. Correctness canaries are enforced; comparisons
    whose verdicts are shown rather than gated (throughput) are not, unless
    the user asks with ``--gate``. ``takes_gate``: the module's ``run``
    also accepts ``gate=True`` (enforce its comparisons, not only show them).
    ``takes_checks``: the module's ``run`` also accepts ``checks=`` (the
    names of the only checks to run; the mutation suite's focused runs,
    NOTE [Mutation verdicts] Rule 4).
    """

    name: str
    module: str
    summary: str
    enforced: bool = True
    takes_gate: bool = False
    takes_checks: bool = False

    def run(
        self, preset: str, profile: str, out_dir: Path, *, gate: bool = False, checks: Sequence[str] | None = None
    ) -> Path:
        """Run the canary (only ``checks``, when given); returns its evidence path (see the module docstring)."""
        if preset not in PRESET_NAMES:
            raise SetupError(f"unknown preset {preset!r}", fix=f"use one of {', '.join(PRESET_NAMES)}")
        if profile not in PROFILES:
            raise SetupError(f"unknown profile {profile!r}", fix=f"use one of {', '.join(PROFILES)}")
        if gate and not self.takes_gate:
            raise SetupError(f"canary {self.name!r} has no gate option", fix="run it without gate")
        if checks is not None and not self.takes_checks:
            raise SetupError(f"canary {self.name!r} runs all its checks", fix="run it without checks=")
        options: dict[str, object] = {"gate": True} if gate else {}
        if checks is not None:
            options["checks"] = tuple(checks)
        return importlib.import_module(self.module).run(preset, profile, Path(out_dir), **options)


CANARIES: dict[str, Canary] = {
    c.name: c
    for c in (
        Canary(name="derivative", module="canaries.derivative.canary",
               summary="exact stale gradients against an FP64 oracle (stateful op interleavings)", takes_checks=True),
        Canary(name="memory", module="canaries.memory.canary",
               summary="no saved state, graph or staging outlives its backward; admission stays under the limit",
               takes_checks=True),
        Canary(name="mutations", module="canaries.mutations.canary",
               summary="every deliberately injected bug is caught by the canaries"),
        Canary(name="learning", module="canaries.learning.canary",
               summary="stale, corrected and relocated backwards learn as well as strict training (paired TOST across seeds)",
               takes_gate=True),
        Canary(name="benchmark", module="canaries.benchmark.canary",
               summary="throughput of the versioned step against plain PyTorch (ABBA blocks; shown, enforced with --gate)",
               enforced=False),
    )
}


def canary(name: str) -> Canary:
    """The registered canary ``name``; :class:`SetupError` naming the registered ones otherwise."""
    try:
        return CANARIES[name]
    except KeyError:
        raise SetupError(f"unknown canary {name!r}", fix=f"use one of {', '.join(CANARIES)}") from None
