"""``rtv run``, the one run path of every preset: smoke, every registered canary, one report, in one new folder.

:func:`run` takes a :class:`RunRequest` (the flags of ``rtv run``) and goes
through the same steps on ``cpu``, ``gpu`` and ``gpu-8b``:

1. refusals, before anything is written (exit 2, docs/harness.md#exit-codes):
   a package of the ``harness`` extra missing (``canaries.extras.import_extra``), a GPU preset without CUDA (:func:`cuda_devices`, the seam tests stand in
   for), ``--nproc`` above the visible GPUs, an unknown ``--inject-mutation``
   or one whose bug cannot show on the preset, and a preset whose memory
   estimate (``canaries.preset_budget``, with the FP64 oracle beside it)
   exceeds the device;
2. one request for the whole run (``canaries.request.CanaryRun``: the
   preset resolved once with the ``--nproc`` process count, never an
   environment variable or ambient state, the preset's profile
   :data:`RUN_PROFILES`, ``--gate``), then inside ``--threads`` torch CPU
   threads and the injected mutation, if any: the smoke (:data:`SMOKE`, with
   ``--seed`` and ``--inject-failure``), then :func:`run_canaries` with the
   request, then the report; an injected
   mutation or failure is in every record's ``config["injected"]``
   (``validation.evidence.injected``) and on the report's board;
3. a summary; exit 7 (``validation.hangs.HANG_EXIT_CODE``) if a canary's
   processes hung (the canaries run inside ``validation.hangs.watching``
   with ``hang_timeout_s``, default the preset's: NOTE [Hang reports]), 1
   if a step failed, else 0.

The run folder is ``<out>/run-<preset>-<stamp>`` (``validation.evidence.evidence_path``)
on every preset. :func:`run_canaries` runs each canary of
``canaries.registry.CANARIES``: one that raises is recorded as failed (its
traceback printed, and a failed record written for it by
``canaries.registry.Canary.record_raised``: its error and, for a hang, the
diagnosis, so the report and ``rtv report --summary`` show it as failed) and
the others still run, except on a full disk
(:class:`validation.errors.OutOfSpace`), which stops the run, since no later
step could write its evidence either. A smoke that raises is recorded the
same way.

Whether an outcome fails the run is :attr:`CanaryOutcome.fails_run`: a canary
registered ``enforced`` fails it when its evidence does not say passed;
a shown-not-enforced canary (the benchmark) fails it only under ``gate``
(``rtv run --gate``), which the request also carries to every canary (the
learning canary's equivalence verdicts read it).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from validation.errors import OutOfSpace, SetupError
from validation.evidence import DEFAULT_OUT, evidence_path, injected, verify
from validation.hangs import HANG_EXIT_CODE, HangDetected, watching
from validation.world import world_facts

from . import registry
from .request import CanaryRun, canary_run

__all__ = ["CanaryOutcome", "RUN_PROFILES", "RunRequest", "SMOKE", "cuda_devices", "run", "run_canaries", "threads"]

RUN_PROFILES = {"cpu": "quick", "gpu": "default", "gpu-8b": "default"}  # the depth ``rtv run`` runs each preset at
# The run's first step, not a registered canary (rtv run alone runs it, with --seed and --inject-failure); its record
# is written like every canary's.
SMOKE = registry.Canary(name="smoke", module="canaries.smoke", summary="one LoRA training step on the tiny model")


@dataclass(frozen=True)
class RunRequest:
    """What ``rtv run`` was asked for (its flags, docs/harness.md#commands); the defaults are ``rtv run``'s."""

    preset: str = "cpu"
    out: Path = DEFAULT_OUT
    nproc: int | None = None  # processes of the logical-rank parts (None: the preset's own)
    inject_mutation: str | None = None
    inject_failure: bool = False
    threads: int = 1
    seed: int = 0
    gate: bool = False
    hang_timeout_s: float | None = None  # the collective watchdog's deadline (None: the preset's)


@dataclass(frozen=True)
class CanaryOutcome:
    """One canary's result: where its evidence is (what it raised too, when it did), whether it passed, whether that
    fails the run."""

    name: str
    label: str
    passed: bool
    enforced: bool
    where: str  # the evidence path; for a canary that raised, what it raised and the failed record written for it
    hung: bool = False  # it raised validation.hangs.HangDetected: the run exits HANG_EXIT_CODE

    @property
    def fails_run(self) -> bool:
        return self.enforced and not self.passed

    @property
    def state(self) -> str:
        if self.passed:
            return "PASS"
        return "FAIL" if self.enforced else "SHOWN"  # a failed verdict the run shows but does not enforce


def cuda_devices() -> int:
    """The CUDA devices this process sees (0 without CUDA): the one CUDA check of the run, a seam for tests."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _require_gpus(preset: str, nproc: int | None) -> None:
    """:class:`SetupError` for a GPU preset unless CUDA is present with at least ``nproc`` devices."""
    if preset == "cpu":
        return
    import torch

    count = cuda_devices()
    if count == 0:
        raise SetupError(
            f"rtv run --preset {preset}: no CUDA device on this machine (torch {torch.__version__}, "
            f"cuda build: {torch.version.cuda})",
            fix="run it on a GPU machine (rtv gpu launch ci/gate.sky.yaml), "
            "or here with --preset cpu (rtv gpu local ci/gate.sky.yaml does that)",
        )
    if nproc is not None and nproc > count:
        raise SetupError(
            f"rtv run --preset {preset} --nproc {nproc}: expected at most {count} processes, "
            f"one per visible GPU, found --nproc {nproc}",
            fix=f"pass --nproc {count} or fewer",
        )


@contextmanager
def threads(count: int) -> Iterator[None]:
    """Torch CPU threads for the block (restored after, for in-process callers).

    The CPU canaries' tiny shapes gain nothing from more threads and lose a
    lot to contention on a busy machine (``rtv run`` took 180 s instead of 20 s
    with 2 threads on 2 loaded cores).
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def _mutation(name: str | None, preset: object) -> Iterator[None]:
    """The run's negative control: the named bug of ``canaries.mutations.catalogue`` stays in while the steps run."""
    if name is None:
        yield
        return
    from .mutations.catalogue import mutation

    bug = mutation(name)  # SetupError naming the known ones
    if not bug.applies_to(preset):
        raise SetupError(
            f"mutation {name!r} cannot show on preset {preset.name!r} ({bug.description})",  # type: ignore[attr-defined]
            fix="pick a mutation that applies to the preset, or another preset",
        )
    print(f"rtv run: mutation {bug.name!r} left in on purpose ({bug.description}); canary {bug.caught_by} must fail")
    with bug.apply(), injected(f"mutation {bug.name}"):
        yield


@contextmanager
def _failure(inject: bool) -> Iterator[None]:
    """``--inject-failure``: every record of the run says a smoke check fails on purpose (``evidence.injected``)."""
    if not inject:
        yield
        return
    with injected("failure: a smoke check fails on purpose"):
        yield


def run(request: RunRequest) -> int:
    """Run ``request`` (module docstring); returns the exit code, raises :class:`SetupError` (exit 2) for a refusal."""
    from .extras import import_extra

    import_extra("harness")  # every canary needs some of it: refused at once, not as a failure of each
    from .preset_budget import check_fits

    _require_gpus(request.preset, None if world_facts() is not None else request.nproc)  # a world: a GPU each
    asked = canary_run(
        request.preset, RUN_PROFILES[request.preset], processes=request.nproc, gate=request.gate, echo=tqdm.write
    )
    check_fits(asked.preset, oracle=True)  # the run's largest step: the derivative canary's FP64 oracle
    deadline = request.hang_timeout_s if request.hang_timeout_s is not None else asked.preset.hang_timeout_s
    with threads(request.threads), _mutation(request.inject_mutation, asked.preset), _failure(request.inject_failure):
        return _steps(request, asked, deadline)


def _smoke(request: RunRequest, asked: CanaryRun, out: Path) -> Path:
    from .smoke import judge  # imports torch: keep `rtv --help` instant

    judged = judge(asked, seed=request.seed, inject_failure=request.inject_failure)
    return SMOKE.record(asked.preset.name, judged, out, echo=asked.echo)


def _steps(request: RunRequest, asked: CanaryRun, hang_timeout_s: float) -> int:
    run_dir = evidence_path(request.out, f"run-{request.preset}").with_suffix("")  # named like the records it holds
    run_dir.mkdir(parents=True, exist_ok=False)
    print(
        f"rtv run --preset {request.preset}: evidence goes to {run_dir} (hang deadline {hang_timeout_s:g} s)",
        flush=True,
    )
    started = time.perf_counter()
    outcomes: list[tuple[str, str, str]] = []  # (PASS|FAIL|SHOWN, label, where or why)
    try:
        smoke = _smoke(request, asked, run_dir)
        outcomes.append(("PASS" if verify(smoke)["passed"] else "FAIL", "smoke", str(smoke)))
    except OutOfSpace:
        raise  # nothing later could be written either: exit 2 with the fix
    except Exception as error:  # noqa: BLE001 - a broken smoke must not hide the canaries (HarnessError too)
        traceback.print_exc()
        outcomes.append(("FAIL", "smoke", _raised(error, SMOKE.record_raised(asked, error, run_dir))))
    with watching(hang_timeout_s, run_dir):
        ran = run_canaries(asked, run_dir)
    for outcome in ran:
        outcomes.append(("FAIL" if outcome.fails_run else outcome.state, outcome.label, outcome.where))
    print("\n== report ==", flush=True)
    report = None
    try:
        from reports import render_report

        report = render_report(run_dir, run_dir / "report" / "index.md", title=f"rtv run {run_dir.name}")
    except Exception as error:  # noqa: BLE001
        traceback.print_exc()
        outcomes.append(("FAIL", "report", f"raised {type(error).__name__}: {error}"))
    seconds = time.perf_counter() - started
    print(f"\nrtv run summary ({seconds:.1f} s; SHOWN: a verdict shown, not enforced without --gate):")
    for state, label, where in outcomes:
        print(f"  {state:5} {label:28} {where}")
    failed = [label for state, label, _ in outcomes if state == "FAIL"]
    print(f"rtv run: {'PASSED' if not failed else 'FAILED: ' + ', '.join(failed)}; everything is in {run_dir}")
    if report is not None:
        print(f"report: {report.html}\n  (Markdown: {report.markdown}; {len(report.plots)} plots)")
    hung = [o.label for o in ran if o.hung]
    if hung:
        print(
            f"rtv run: a collective hung in {', '.join(hung)} (exit {HANG_EXIT_CODE}); the dumps are in {run_dir / 'hangs'}"
        )
        return HANG_EXIT_CODE
    return 0 if not failed else 1


def _raised(error: Exception, record: Path) -> str:
    """The summary's line for a step that raised ``error`` and was recorded as failed in ``record``."""
    return f"raised {type(error).__name__}: {error} (recorded in {record})"


def run_canaries(asked: CanaryRun, run_dir: Path) -> list[CanaryOutcome]:
    """Run every registered canary on the one request ``asked`` into ``run_dir`` (module docstring)."""
    outcomes = []
    for canary in registry.CANARIES.values():
        label = f"canary {canary.name} ({asked.profile})"
        enforced = canary.enforced or asked.gate
        asked.echo(f"\n== {label} ==")
        hung = False
        try:
            path = canary.run(asked, run_dir)
            passed, where = bool(verify(path)["passed"]), str(path)
        except OutOfSpace:
            raise
        except Exception as error:  # noqa: BLE001 - one broken canary must not hide the others (HarnessError too)
            traceback.print_exc()
            passed, hung = False, isinstance(error, HangDetected)
            where = _raised(error, canary.record_raised(asked, error, run_dir))
        outcome = CanaryOutcome(canary.name, label, passed, enforced, where, hung)
        asked.echo(f"{outcome.state}  {label}: {where}")
        outcomes.append(outcome)
    return outcomes
