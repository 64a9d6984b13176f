"""``rtv``: the one command line of the harness (a thin layer over the packages).

    rtv run [--out DIR]                   the main job: smoke, every CPU canary, a report
    rtv canary derivative|memory|mutations [--preset P] [--profile ci|nightly] [--out DIR]
    rtv bench placements|throughput [--presets ...] [--blocks N] [--out DIR]
    rtv report [--in DIR] [--out FILE]

Every command writes write-once JSON evidence (``validation.evidence``) and
prints where it is. Canary modules are imported inside the commands, so
``rtv --help`` stays instant. This is the only module that may import every
package.

Exit status: 0 when every check passed, 1 when a check failed or a step
raised, 2 for usage errors and subcommands that are not available.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from ci.cli import add_gpu_commands, run_with_preset

if TYPE_CHECKING:
    from .smoke import Check

__all__ = ["main", "Step", "cpu_steps", "INJECT_ENV", "PRESET_NAMES"]

INJECT_ENV = "RTV_SMOKE_INJECT_FAILURE"
PRESET_NAMES = ("cpu", "gpu", "gpu-8b")  # canaries.presets.PRESETS, without importing torch for --help
CANARIES = ("derivative", "memory", "mutations")
DEFAULT_OUT = Path("rtv-out")

# Subcommands still to come: name -> help line.
PLANNED = {
    "learn": "matched-schedule learning comparison",
    "ci": "launch the GPU CI jobs through SkyPilot",
}


def _module(name: str) -> ModuleType:
    """``canaries.<name>``, imported when a command needs it."""
    return importlib.import_module(f"canaries.{name}")


def _canary(name: str, preset: str, profile: str, out: Path) -> Path:
    """Run one canary suite; returns its evidence path."""
    if name == "derivative":
        return _module("derivative").run(preset, profile=profile, out_dir=out)
    if name == "memory":
        return _module("memory").run(preset, out_dir=out)
    if name == "mutations":
        return _module("mutations").run_mutations(preset, out_dir=out)
    raise ValueError(f"unknown canary {name!r}; expected one of {CANARIES}")


def _smoke(out: Path, *, seed: int = 0, inject_failure: bool = False) -> Path:
    from validation.evidence import write_once

    from .smoke import run_smoke  # imports torch: keep `rtv --help` instant

    def show(check: Check) -> None:
        print(f"{'PASS' if check.passed else 'FAIL'}  {check.name}: {check.detail}", flush=True)

    result = run_smoke(seed=seed, inject_failure=inject_failure, on_check=show)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = write_once(out / f"smoke-{stamp}-{os.getpid()}.json", result.record())
    failed = sum(not check.passed for check in result.checks)
    print(f"smoke: {'PASSED' if not failed else f'FAILED ({failed} of {len(result.checks)} checks)'}")
    print(f"wrote {path}", flush=True)
    return path


def _passed(path: Path) -> bool:
    from validation.evidence import verify

    return bool(verify(path)["passed"])


# --- rtv run ------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One step of ``rtv run``: ``run(out_dir)`` returns an evidence path."""

    label: str
    run: Callable[[Path], Path]


def cpu_steps(*, seed: int = 0, inject_failure: bool = False) -> list[Step]:
    """What ``rtv run`` runs, in order: the smoke, then every CPU canary."""
    return [
        Step("smoke", lambda out: _smoke(out, seed=seed, inject_failure=inject_failure)),
        Step("canary derivative (ci)", lambda out: _canary("derivative", "cpu", "ci", out)),
        Step("canary memory", lambda out: _canary("memory", "cpu", "ci", out)),
        Step("canary mutations", lambda out: _canary("mutations", "cpu", "ci", out)),
    ]


@contextmanager
def _threads(threads: int) -> Iterator[None]:
    """Torch CPU threads for the block (restored after, for in-process callers).

    The CPU canaries' tiny shapes gain nothing from more threads and lose a
    lot to contention on a busy machine (``rtv run`` took 180 s instead of 20 s
    with 2 threads on 2 loaded cores).
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run(args: argparse.Namespace) -> int:
    if (code := run_with_preset(args)) is not None:  # --preset gpu|gpu-8b: ci.gpu_run
        return code
    with _threads(args.threads):
        return _run_steps(args)


def _run_steps(args: argparse.Namespace) -> int:
    run_dir = args.out / f"run-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=False)
    print(f"rtv run: evidence goes to {run_dir}", flush=True)
    started = time.perf_counter()
    outcomes: list[tuple[str, str, str]] = []  # (PASS|FAIL, label, where or why)
    for step in cpu_steps(seed=args.seed, inject_failure=args.inject_failure):
        print(f"\n== {step.label} ==", flush=True)
        try:
            path = step.run(run_dir)
            outcomes.append(("PASS" if _passed(path) else "FAIL", step.label, str(path)))
        except Exception as error:  # noqa: BLE001 - one broken step must not hide the others
            traceback.print_exc()
            outcomes.append(("FAIL", step.label, f"raised {type(error).__name__}: {error}"))
    print("\n== report ==", flush=True)
    report = None
    try:
        from reports import render_report

        report = render_report(run_dir, run_dir / "report" / "index.md", title=f"rtv run {run_dir.name}")
        if not report.passed and all(state != "FAIL" for state, _, _ in outcomes):
            outcomes.append(("FAIL", "report", "the report found failed or invalid records"))
    except Exception as error:  # noqa: BLE001
        traceback.print_exc()
        outcomes.append(("FAIL", "report", f"raised {type(error).__name__}: {error}"))
    seconds = time.perf_counter() - started
    print(f"\nrtv run summary ({seconds:.1f} s):")
    for state, label, where in outcomes:
        print(f"  {state}  {label:24} {where}")
    if report is not None:
        print(f"  report: {report.markdown} (and {report.html.name}, {len(report.plots)} plots)")
    failed = [label for state, label, _ in outcomes if state == "FAIL"]
    print(f"rtv run: {'PASSED' if not failed else 'FAILED: ' + ', '.join(failed)}; everything is in {run_dir}")
    return 0 if not failed else 1


# --- rtv canary / bench / report ---------------------------------------------------------


def _canary_command(args: argparse.Namespace) -> int:
    with _threads(args.threads):
        path = _canary(args.suite, args.preset, args.profile, args.out)
    passed = _passed(path)
    print(f"rtv canary {args.suite}: {'PASSED' if passed else 'FAILED'}; evidence: {path}")
    return 0 if passed else 1


def _bench(args: argparse.Namespace) -> int:
    argv = ["--out", str(args.out), "--blocks", str(args.blocks)]
    if args.suite == "throughput":
        from . import throughput

        return throughput.main(argv)
    from . import placements

    if args.presets:
        argv += ["--presets", *args.presets]
    return placements.main(argv)


def _report(args: argparse.Namespace) -> int:
    from reports import render_report

    source = args.in_dir
    if not source.is_dir():
        print(f"rtv report: {source} is not a folder of evidence; pass --in DIR", file=sys.stderr)
        return 2
    report = render_report(source, args.out_file)
    print(f"rtv report: {report.records} records, {'PASSED' if report.passed else 'FAILED'}")
    print(f"wrote {report.markdown}\nwrote {report.html}" + "".join(f"\nwrote {p}" for p in report.plots))
    return 0 if report.passed else 1


def _not_implemented(args: argparse.Namespace) -> int:
    print(f"rtv {args.command}: not implemented yet", file=sys.stderr)
    return 2


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, found {value}")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rtv",
        description="Reference-trainer validation: canaries, learning comparisons, benchmarks, reports.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = sub.add_parser(
        "run",
        help="the main job: smoke, every CPU canary, a report",
        description="Run the CPU smoke, the CPU canaries (derivative ci, memory, mutations) "
        "and render a report, all in a new folder under --out. Exits 1 if anything failed.",
    )
    run.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: ./rtv-out)")
    run.add_argument("--seed", type=int, default=0, help="seed for the smoke's weights and tokens (default: 0)")
    run.add_argument(
        "--inject-failure",
        action="store_true",
        default=os.environ.get(INJECT_ENV) == "1",
        help=f"negative control: make a smoke check fail on purpose (also {INJECT_ENV}=1)",
    )
    run.add_argument("--threads", type=_positive, default=1, help="torch CPU threads (default: 1)")
    run.add_argument("--preset", choices=PRESET_NAMES, default="cpu",
                     help="cpu (default), or a GPU preset: every canary on this machine's GPUs (exit 2 without CUDA)")
    run.add_argument("--nproc", type=_positive, default=None, help="processes for the logical-rank parts (default: 1)")
    run.set_defaults(handler=_run)

    canary = sub.add_parser("canary", help="run one canary suite (derivative | memory | mutations)")
    canary.add_argument("suite", choices=CANARIES)
    canary.add_argument("--preset", choices=PRESET_NAMES, default="cpu",
                        help="cpu, or a GPU preset (on a machine without CUDA it runs on CPU with a small shape)")
    canary.add_argument("--profile", choices=("ci", "nightly"), default="ci",
                        help="derivative only: exploration depth (default: ci)")
    canary.add_argument("--out", type=Path, default=DEFAULT_OUT, help="evidence folder (default: ./rtv-out)")
    canary.add_argument("--threads", type=_positive, default=1, help="torch CPU threads (default: 1)")
    canary.set_defaults(handler=_canary_command)

    bench = sub.add_parser(
        "bench", help="benchmarks, ABBA (placements: step time per placement; throughput: versioned vs plain step)"
    )
    bench.add_argument("suite", choices=("placements", "throughput"))
    bench.add_argument("--presets", nargs="+", choices=("tiny", "small"), help="placements: model shapes (default: all)")
    bench.add_argument("--blocks", type=int, default=10, help="measured ABBA blocks (default: 10)")
    bench.add_argument("--out", type=Path, default=DEFAULT_OUT / "bench", help="evidence folder (default: ./rtv-out/bench)")
    bench.set_defaults(handler=_bench)

    report = sub.add_parser("report", help="render evidence into a Markdown/HTML report")
    report.add_argument("--in", dest="in_dir", type=Path, default=DEFAULT_OUT,
                        help="folder of evidence JSON, searched recursively (default: ./rtv-out)")
    report.add_argument("--out", dest="out_file", type=Path, default=None,
                        help="Markdown file to write; HTML and plots go beside it (default: <in>/report/index.md)")
    report.set_defaults(handler=_report)

    add_gpu_commands(sub)
    for name, help_line in PLANNED.items():
        sub.add_parser(name, help=help_line).set_defaults(handler=_not_implemented)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
