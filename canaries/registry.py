"""The canary spine: one interface, one registry, one way a canary's evidence is written.

A canary is a module ``canaries.<name>.canary`` that supplies only what is its own::

    def judge(run: CanaryRun) -> Judged

``run`` (``canaries.request.CanaryRun``) is the whole request, resolved once
by the caller: the ``Preset`` as it runs on this machine (a GPU preset on a
machine without CUDA is its CPU stand-in, and the canary says so in the
evidence or raises ``validation.errors.SetupError`` when it cannot), the
profile (:data:`PROFILES`: ``quick`` for ``rtv run`` and the test suite,
``default`` for ``rtv canary NAME``, ``nightly`` for deep runs), ``gate``,
``checks`` (a canary that runs only whole calls ``run.runs_every_check``)
and ``echo``, where its lines go. A canary never resolves a preset itself
(tests/test_architecture.py's ``resolve`` rule). :func:`judge` returns a
:class:`Judged`: the record's kind and config, its checks (the
``validation.evidence.Checks`` collector, made with ``echo=run.echo`` so each
verdict is shown as it is made, details and skips included) and its
measurements. A failed check is a failed check in there, never an exception.

:meth:`Canary.run` does the part every canary shares, once: it calls
``judge``, writes one schema-2 write-once record
(``validation.evidence.make_record``) at
``validation.evidence.evidence_path(out_dir, "<name>-<preset>")``, shows
the verdict and the path through ``run.echo``, and returns the path.
:meth:`Canary.record` is that tail alone, for callers that judge with
options of their own (``rtv bench``'s clock and threads, the smoke's seed,
the learning canary's tiny test plans). :meth:`Canary.record_raised` writes,
through that same tail, the failed record of a run whose ``judge`` raised
(``rtv run`` keeps going after it, ``canaries.suite``): kind
``reports.kinds.RAISED_KIND``, one failed check ``<name> ran to completion``
and the error in the measurements, with a hang's diagnosis.

Adding a canary is its folder ``canaries/<name>/`` with ``canary.py``
defining ``judge(run)``, plus one line in :data:`CANARIES` (docs/harness.md,
"Adding a canary"). Modules are imported only when a canary runs, so
``rtv --help`` stays instant. ``rtv canary``, ``rtv run`` and the mutation
suite all go through here.
"""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from validation.errors import SetupError
from validation.evidence import Checks, evidence_path, make_record, write_once

from .request import PROFILES, CanaryRun, echo_line

__all__ = ["Canary", "CANARIES", "Judged", "PRESET_NAMES", "PROFILES", "canary"]

TRACEBACK_FRAMES = 8  # the innermost frames a raised canary's record keeps

# The names of ``canaries.presets.PRESETS``, written here so ``rtv --help`` needs no torch
# (tests/canaries/test_cli.py checks they agree).
PRESET_NAMES = ("cpu", "gpu", "gpu-8b")


@dataclass(frozen=True)
class Judged:
    """What a canary's ``judge`` found: the record's ``kind`` and ``config``, its ``checks``, its ``measurements``."""

    kind: str
    config: Mapping[str, Any]
    checks: Checks
    measurements: Mapping[str, Any]


@dataclass(frozen=True, kw_only=True)
class Canary:
    """A registered canary: its CLI name, its module, a one-line summary.

    ``enforced``: whether ``rtv run`` fails (exit 1) when this canary's
    evidence says failed. Correctness canaries are enforced; comparisons
    whose verdicts are shown rather than gated (throughput) are not, unless
    the user asks with ``--gate``.
    """

    name: str
    module: str
    summary: str
    enforced: bool = True

    def run(self, run: CanaryRun, out_dir: Path) -> Path:
        """Judge ``run`` and write its record; returns the path (module docstring)."""
        return self.record(run.preset.name, self._judge()(run), out_dir, echo=run.echo)

    def record(
        self, preset_name: str, judged: Judged, out_dir: Path, *, echo: Callable[[str], None] = echo_line
    ) -> Path:
        """Write ``judged`` as one schema-2 record of this canary on preset ``preset_name``; show the verdict
        and the path through ``echo``; return the path."""
        if preset_name not in PRESET_NAMES:
            raise SetupError(f"unknown preset {preset_name!r}", fix=f"use one of {', '.join(PRESET_NAMES)}")
        if not isinstance(judged, Judged):
            raise SetupError(
                f"canary {self.name!r}: expected judge to return a Judged, found {type(judged).__name__}",
                fix=f"return canaries.registry.Judged(kind, config, checks, measurements) from {self.module}.judge",
            )
        record = make_record(judged.kind, config=judged.config, checks=judged.checks, measurements=judged.measurements)
        path = write_once(evidence_path(Path(out_dir), f"{self.name}-{preset_name}"), record)
        ran = [c for c in judged.checks if not c.skipped]
        failed = [c for c in ran if not c.ok]
        verdict = "PASSED" if record["passed"] else f"FAILED ({len(failed)} of {len(ran)} checks)"
        echo(f"{self.name} canary: {verdict}; {len(judged.checks) - len(ran)} skipped")
        echo(f"wrote {path}")
        return path

    def record_raised(self, run: CanaryRun, error: BaseException, out_dir: Path) -> Path:
        """Write the failed record of this canary's run ``run`` that raised ``error`` before it had a verdict; return
        the path (module docstring). Written by :meth:`record`, so it is named, verified and shown like any record.

        ``config``: the canary, the preset and the profile. The one check, ``<name> ran to completion``, fails with
        ``raised <Type>: <first line of the message>``. ``measurements``: ``error`` (the type's name), ``message``
        (all of it), ``traceback`` (the :data:`TRACEBACK_FRAMES` innermost frames, innermost last) and, for a
        ``validation.hangs.HangDetected``, its ``diagnosis`` as written and ``dumps``, the dump folder relative to
        ``out_dir`` when it lies inside it (the run folder's ``hangs/ranks-*``), else as the diagnosis names it.
        """
        from reports.kinds import RAISED_KIND  # imports pandas: only once a canary raised

        first_line = (str(error).splitlines() or [""])[0]
        checks = Checks(echo=run.echo)
        checks.check(f"{self.name} ran to completion", False, f"raised {type(error).__name__}: {first_line}")
        config = {"canary": self.name, "preset": run.preset.name, "profile": run.profile}
        judged = Judged(RAISED_KIND, config, checks, _raised_measurements(error, Path(out_dir)))
        return self.record(run.preset.name, judged, out_dir, echo=run.echo)

    def _judge(self) -> Callable[[CanaryRun], Judged]:
        """The module's ``judge``; :class:`SetupError` for a module without one (an old-style ``run`` included)."""
        module = importlib.import_module(self.module)
        judge = getattr(module, "judge", None)
        if not callable(judge):
            found = "an old-style run(preset, profile, out_dir)" if hasattr(module, "run") else "no judge"
            raise SetupError(
                f"canary {self.name!r}: expected {self.module}.judge(run: CanaryRun) -> Judged, found {found}",
                fix="give the module judge(run) returning canaries.registry.Judged; the registry writes the record",
            )
        return judge


def _raised_measurements(error: BaseException, out_dir: Path) -> dict[str, Any]:
    """:meth:`Canary.record_raised`'s measurements of ``error``."""
    from validation.hangs import HangDetected

    frames = traceback.extract_tb(error.__traceback__)[-TRACEBACK_FRAMES:]
    measured: dict[str, Any] = {
        "error": type(error).__name__,
        "message": str(error),
        "traceback": [f"{frame.filename}:{frame.lineno} in {frame.name}: {frame.line}" for frame in frames],
    }
    if isinstance(error, HangDetected):
        folder = Path(error.diagnosis["folder"])
        inside = folder.resolve().is_relative_to(out_dir.resolve())
        dumps = folder.resolve().relative_to(out_dir.resolve()).as_posix() if inside else str(folder)
        measured |= {"diagnosis": error.diagnosis, "dumps": dumps}
    return measured


CANARIES: dict[str, Canary] = {
    c.name: c
    for c in (
        Canary(
            name="derivative",
            module="canaries.derivative.canary",
            summary="exact stale gradients against an FP64 oracle (stateful op interleavings)",
        ),
        Canary(
            name="memory",
            module="canaries.memory.canary",
            summary="no saved state, graph or staging outlives its backward; admission stays under the limit",
        ),
        Canary(
            name="resume",
            module="canaries.resume.canary",
            summary="a job killed by SIGKILL between any two trainer calls or inside a save resumes bitwise from disk",
        ),
        Canary(
            name="liveness",
            module="canaries.liveness.canary",
            summary="injected hangs (a lagging, a killed, a diverging rank) are reported in time, naming the rank and the collective",
        ),
        Canary(
            name="planner",
            module="canaries.planner.canary",
            summary="auto's placements and the planner's byte estimates against every measured placement (certificate)",
        ),
        Canary(
            name="rollout",
            module="canaries.rollout.canary",
            summary="the rollout engine agrees with the trainer, publications are all or nothing, per-token versions are exact",
        ),
        Canary(
            name="mutations",
            module="canaries.mutations.canary",
            summary="every deliberately injected bug is caught by the canaries",
        ),
        Canary(
            name="learning",
            module="canaries.learning.canary",
            summary="stale, corrected and relocated backwards learn as well as strict training (paired TOST across seeds)",
        ),
        Canary(
            name="conform",
            module="canaries.conform.canary",
            summary="the conformance suite: this trainer's adapter passes every check, naive-async (the negative "
            "control) fails stale",
        ),
        Canary(
            name="benchmark",
            module="canaries.benchmark.canary",
            summary="throughput of the versioned step against plain PyTorch (ABBA blocks; shown, enforced with --gate)",
            enforced=False,
        ),
    )
}


def canary(name: str) -> Canary:
    """The registered canary ``name``; :class:`SetupError` naming the registered ones otherwise."""
    try:
        return CANARIES[name]
    except KeyError:
        raise SetupError(f"unknown canary {name!r}", fix=f"use one of {', '.join(CANARIES)}") from None
