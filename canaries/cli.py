"""``rtv``: the one command line of the harness (a thin layer over the packages).

    rtv run [--preset cpu|gpu|gpu-8b] [--nproc N] [--inject-mutation NAME] [--inject-failure]
            [--threads N] [--seed S] [--gate] [--hang-timeout S] [--out DIR]
                                          the main job, one path for every preset (canaries.suite):
                                          smoke, every registered canary, one report
    rtv canary NAME [--preset P] [--profile quick|default|nightly] [--hang-timeout S] [--out DIR]
    rtv bench [--preset P] [--profile quick|default|nightly] [--gate G] [--target R] [--out DIR]
              [--baseline [REV] [--arm A ...]]   this source against REV's (default: the merge base with main)
              [--sweep]                          only the cost-growth sweep (default and nightly run it too)
    rtv history [--store FILE] [--arm A] [--workload W] [--out FILE]
                                          every benchmark so far: trends, change points, verdicts
    rtv report [--in DIR] [--out FILE] [--summary]
    rtv conform [ADAPTER ...] [--adapter package.module:factory] [--list] [--out DIR]
                                          the conformance suite on any trainer's adapter (docs/conform.md)
    rtv mutation-score [--paths P ...] [--tests T ...] [--sample N] [--seed S] [--budget S] [--out DIR]
                                          the suite's strength: a sampled mutmut run, its record and report

Canaries come from ``canaries.registry`` (one registration per canary);
every command writes write-once JSON evidence (``validation.evidence``) and
prints where it is. Canary modules are imported inside the commands, so
``rtv --help`` stays instant. This is the only module that may import every
package.

Exit status (docs/harness.md#exit-codes): 0 when every enforced check passed, 1 when one
failed or a step raised (a shown-not-enforced canary, the benchmark, fails
the run only under ``--gate``), 2 for usage and setup errors, 7 when a
collective hung past ``--hang-timeout`` (``validation.hangs``). The console
script enters through ``canaries.entry`` (Python and torch checked first). A
``validation.errors.HarnessError`` is printed as its cause and its fix, and
exits with its ``exit_code``.

Under ``torchrun`` (one node or many) every process runs the same command:
rank 0 runs it, the logical-rank parts run on every process of the world,
and only rank 0 writes (NOTE [Joined worlds] in ``validation.world``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ci.cli import add_gpu_commands
from validation.errors import HarnessError, SetupError
from validation.evidence import DEFAULT_OUT, EVIDENCE_MARKER
from validation.world import given_world, joined

from . import suite
from .arguments import positive, seconds
from .benchmark.command import add_bench_commands
from .conform.command import add_conform_command
from .registry import CANARIES, PRESET_NAMES, PROFILES, canary

__all__ = ["main", "INJECT_ENV", "MUTATION_ENV"]

INJECT_ENV = "RTV_SMOKE_INJECT_FAILURE"
MUTATION_ENV = "RTV_INJECT_MUTATION"


def _passed(path: Path) -> bool:
    from validation.evidence import verify

    return bool(verify(path)["passed"])


def _run(args: argparse.Namespace) -> int:
    """``rtv run``: the one run path of every preset (``canaries.suite.run``)."""
    request = suite.RunRequest(
        preset=args.preset,
        out=args.out,
        nproc=args.nproc,
        inject_mutation=args.inject_mutation,
        inject_failure=args.inject_failure,
        threads=args.threads,
        seed=args.seed,
        gate=args.gate,
        hang_timeout_s=args.hang_timeout,
    )
    return suite.run(request)


# --- rtv canary / bench / report ---------------------------------------------------------


def _canary_command(args: argparse.Namespace) -> int:
    """``rtv canary NAME``: one request (on the torchrun world's processes inside one), one record: the canary's, or
    the failed record of a canary that raised (``Canary.record_raised``, as ``rtv run`` writes it), before the error
    takes its own exit (7 for a hang). A :class:`SetupError` (a request this machine cannot run) records nothing."""
    from validation.hangs import watching

    from .request import canary_run

    asked, entry = canary_run(args.preset, args.profile, processes=getattr(args, "nproc", None)), canary(args.name)
    deadline = args.hang_timeout if args.hang_timeout is not None else asked.preset.hang_timeout_s
    with suite.threads(args.threads), watching(deadline, args.out):
        try:
            path = entry.run(asked, args.out)
        except SetupError:
            raise  # a request this machine cannot run (out of space too): nothing ran to record, exit 2 with the fix
        except Exception as error:  # a crash or a hang: recorded failed as in rtv run, then its own exit code
            raised = entry.record_raised(asked, error, args.out)
            print(f"rtv canary {args.name}: FAILED (raised {type(error).__name__}); evidence: {raised}")
            raise
    passed = _passed(path)
    print(f"rtv canary {args.name}: {'PASSED' if passed else 'FAILED'}; evidence: {path}")
    return 0 if passed else 1


def _report(args: argparse.Namespace) -> int:
    from reports import render_report

    source = args.in_dir
    if not source.is_dir():
        raise SetupError(f"{source} is not a folder of evidence", fix="pass --in DIR, a folder of records")
    report = render_report(source, args.out_file)
    print(f"rtv report: {report.records} records, {'PASSED' if report.passed else 'FAILED'}")
    if report.skipped:
        first = ", ".join(map(str, report.skipped[:5])) + (" ..." if len(report.skipped) > 5 else "")
        print(
            f"skipped {len(report.skipped)} *.json that are not records (no {EVIDENCE_MARKER} beside them and none "
            f"verifies as evidence): {first}"
        )
    if not report.records:
        print(
            f"no records in {source} nor in a folder rtv wrote records into below it (one holding "
            f"{EVIDENCE_MARKER}); a folder of records made otherwise is read when named: --in FOLDER"
        )
    print(f"wrote {report.markdown}\nwrote {report.html}" + "".join(f"\nwrote {p}" for p in report.plots))
    if args.summary:
        from reports.summary import write_summary

        summary = write_summary(source, report.markdown.parent, report.html)
        print(
            f"wrote {summary.summary}"
            + (
                f"\nwrote {summary.comment} ({summary.regressions} regressions, {summary.failed} failed records, "
                f"{summary.raised} of them canary runs that raised)"
                if summary.comment
                else " (no regression and no failed record: no PR comment)"
            )
        )
    return 0 if report.passed else 1


def _mutation_score(args: argparse.Namespace) -> int:
    from reports import render_report
    from validation.mutation_score import MutationConfig, run_mutation_score

    config = MutationConfig(
        paths=tuple(args.paths),
        tests=tuple(args.tests),
        sample=args.sample,
        seed=args.seed,
        budget_s=args.budget,
        max_children=args.jobs,
        python=args.python,
    )
    path = run_mutation_score(Path.cwd(), args.out, config)
    report = render_report(args.out)
    print(f"rtv mutation-score: evidence {path}\nreport: {report.html}")
    return 0 if report.passed else 1


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rtv",
        description="Reference-trainer validation: canaries, learning comparisons, benchmarks, reports.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = sub.add_parser(
        "run",
        help="the main job: smoke, every canary, a report (any preset)",
        description=f"Run the smoke, every registered canary ({', '.join(CANARIES)}) on --preset "
        f"(profile: {', '.join(f'{p} {q}' for p, q in suite.RUN_PROFILES.items())}), and render a report, all in a new "
        "folder under --out; every flag applies to every preset. Exits 1 if anything failed, 2 when refused "
        "(a GPU preset without CUDA, --nproc above the GPUs, a mutation that cannot show on the preset), "
        "7 when a collective hung past --hang-timeout.",
    )
    run.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: ./rtv-out)")
    run.add_argument("--seed", type=int, default=0, help="seed for the smoke's weights and tokens (default: 0)")
    run.add_argument(
        "--inject-failure",
        action="store_true",
        default=os.environ.get(INJECT_ENV) == "1",
        help=f"negative control: make a smoke check fail on purpose (also {INJECT_ENV}=1)",
    )
    run.add_argument(
        "--inject-mutation",
        metavar="NAME",
        default=os.environ.get(MUTATION_ENV) or None,
        help=f"negative control: leave the named bug of canaries.mutations.catalogue in for the whole run (also {MUTATION_ENV}=NAME); "
        "the canary that must catch it fails and the run exits 1",
    )
    run.add_argument(
        "--gate",
        action="store_true",
        help="enforce the shown verdicts too: the benchmark's gates and the learning equivalence verdicts",
    )
    run.add_argument("--threads", type=positive, default=1, help="torch CPU threads (default: 1)")
    run.add_argument(
        "--preset",
        choices=PRESET_NAMES,
        default="cpu",
        help="cpu (default), or a GPU preset: every canary on this machine's GPUs (exit 2 without CUDA)",
    )
    run.add_argument(
        "--nproc",
        type=positive,
        default=None,
        help="processes for the logical-rank parts (default: the preset's; a GPU preset: at most its GPUs)",
    )
    run.add_argument(
        "--hang-timeout",
        type=seconds,
        default=None,
        metavar="S",
        help="collective watchdog deadline in seconds (default: the preset's); a collective that waits "
        "longer dumps every process's stack and trace into the run folder and the run exits 7",
    )
    run.set_defaults(handler=_run)

    listing = "\n".join(f"  {c.name:12} {c.summary}" for c in CANARIES.values())
    canary_parser = sub.add_parser(
        "canary",
        help=f"run one canary ({' | '.join(CANARIES)})",
        epilog=f"registered canaries:\n{listing}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    canary_parser.add_argument("name", choices=list(CANARIES), metavar="NAME", help="a registered canary (below)")
    canary_parser.add_argument(
        "--preset",
        choices=PRESET_NAMES,
        default="cpu",
        help="cpu, or a GPU preset (without CUDA it runs on CPU with a small shape)",
    )
    canary_parser.add_argument(
        "--profile", choices=PROFILES, default="default", help="depth: quick (seconds), default, nightly (minutes)"
    )
    canary_parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="evidence folder (default: ./rtv-out)")
    canary_parser.add_argument("--threads", type=positive, default=1, help="torch CPU threads (default: 1)")
    canary_parser.add_argument(
        "--hang-timeout",
        type=seconds,
        default=None,
        metavar="S",
        help="collective watchdog deadline in seconds (default: the preset's); a hang exits 7",
    )
    canary_parser.set_defaults(handler=_canary_command)

    report = sub.add_parser("report", help="render evidence into a Markdown/HTML report")
    report.add_argument(
        "--in",
        dest="in_dir",
        type=Path,
        default=DEFAULT_OUT,
        help="folder of evidence JSON, searched recursively (default: ./rtv-out)",
    )
    report.add_argument(
        "--out",
        dest="out_file",
        type=Path,
        default=None,
        help="Markdown file to write; HTML and plots go beside it (default: <in>/report/index.md)",
    )
    report.add_argument(
        "--summary",
        action="store_true",
        help="also write summary.md (failed records first, then benchmark verdicts, ratios, intervals, links: for "
        "$GITHUB_STEP_SUMMARY) and, only when some verdict is a regression or some record failed, pr-comment.md",
    )
    report.set_defaults(handler=_report)

    mutation = sub.add_parser(
        "mutation-score",
        help="measure the suite: a sampled mutmut run (the mutation extra)",
        description="Run mutmut over --paths on a seeded sample of its mutants, each judged by "
        "the --tests that reach it (NOTE [Mutation score] in validation.mutation_score); write "
        "the score and the survivors as evidence and render the report. Run from the checkout.",
    )
    mutation.add_argument("--paths", nargs="+", default=["reference_trainer", "validation"], help="packages to mutate")
    mutation.add_argument(
        "--tests", nargs="+", default=["tests/unit"], help="the tests that judge (default: tests/unit)"
    )
    mutation.add_argument("--sample", type=positive, default=200, help="mutants to run (default: 200)")
    mutation.add_argument("--seed", type=int, default=0, help="seed of the sample (default: 0)")
    mutation.add_argument("--budget", type=float, default=3600.0, help="seconds for the whole run (default: 3600)")
    mutation.add_argument("--jobs", type=positive, default=2, help="mutants run at once (default: 2)")
    mutation.add_argument("--python", default=sys.executable, help="interpreter with mutmut (default: this one)")
    mutation.add_argument(
        "--out", type=Path, default=DEFAULT_OUT / "mutation", help="evidence folder (default: ./rtv-out/mutation)"
    )
    mutation.set_defaults(handler=_mutation_score)

    add_bench_commands(sub)
    add_conform_command(sub)
    add_gpu_commands(sub)
    return parser


def _in_world(args: argparse.Namespace, processes: int) -> int:
    """Rank 0 of a torchrun world (NOTE [Joined worlds] in ``validation.world``): the command's logical-rank
    parts run on every process of the world, so the run's process count is the world's size (``args.nproc``,
    which ``rtv run`` and ``rtv canary`` resolve their request with)."""
    if getattr(args, "nproc", None) not in (None, processes):
        raise SetupError(
            f"rtv {args.command} --nproc {args.nproc} under torchrun: expected the world's "
            f"{processes} processes, found --nproc {args.nproc}",
            fix=f"drop --nproc (it is the world's size under torchrun), or start {args.nproc} processes",
        )
    args.nproc = processes
    return args.handler(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the command; a :class:`HarnessError` becomes its reason, its fix and its exit code."""
    args = _build_parser().parse_args(argv)
    try:
        world = given_world()
        if world is None:
            return args.handler(args)
        return joined(world, lambda: _in_world(args, world.world_size))
    except HarnessError as error:
        print(f"rtv {args.command}: {error.cause}\nfix: {error.fix}", file=sys.stderr)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
