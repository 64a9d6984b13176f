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
import time
from collections.abc import Sequence
from pathlib import Path

from ci.cli import add_gpu_commands
from validation.errors import HarnessError, SetupError
from validation.evidence import DEFAULT_OUT, EVIDENCE_MARKER
from validation.world import given_world, joined

from .conform.command import add_conform_command
from .registry import CANARIES, PRESET_NAMES, PROFILES, canary
from . import suite

__all__ = ["main", "INJECT_ENV", "MUTATION_ENV"]

INJECT_ENV = "RTV_SMOKE_INJECT_FAILURE"
MUTATION_ENV = "RTV_INJECT_MUTATION"
HISTORY_FILE = "history.sqlite"  # in rtv bench's --out folder


def _passed(path: Path) -> bool:
    from validation.evidence import verify

    return bool(verify(path)["passed"])


def _run(args: argparse.Namespace) -> int:
    """``rtv run``: the one run path of every preset (``canaries.suite.run``)."""
    request = suite.RunRequest(preset=args.preset, out=args.out, nproc=args.nproc, inject_mutation=args.inject_mutation,
                         inject_failure=args.inject_failure, threads=args.threads, seed=args.seed, gate=args.gate,
                         hang_timeout_s=args.hang_timeout)
    return suite.run(request)


# --- rtv canary / bench / report ---------------------------------------------------------


def _canary_command(args: argparse.Namespace) -> int:
    from validation.hangs import watching

    from .presets import preset

    deadline = args.hang_timeout if args.hang_timeout is not None else preset(args.preset).hang_timeout_s
    with suite.threads(args.threads), watching(deadline, args.out):
        path = canary(args.name).run(args.preset, args.profile, args.out)
    passed = _passed(path)
    print(f"rtv canary {args.name}: {'PASSED' if passed else 'FAILED'}; evidence: {path}")
    return 0 if passed else 1


SWEPT_PROFILES = ("default", "nightly")  # rtv bench's profiles that run the cost-growth sweep after the benchmark


def _bench_judged(args: argparse.Namespace, run_dir: Path, started: float) -> list:
    """What ``rtv bench`` runs: the sweep alone (``--sweep``), the baseline, or the benchmark and, on the
    ``SWEPT_PROFILES``, the sweep's grid of that profile in what the run's budget leaves (``started``: the
    run's ``time.monotonic()``; NOTE [Cost growth] in ``canaries/benchmark/sweep.py``)."""
    from .benchmark import canary as benchmark
    from .benchmark import sweep

    if args.sweep:
        with suite.threads(args.threads):
            return [sweep.judge(args.preset, args.profile, gate=args.gate)]
    if args.baseline is not None:
        from .benchmark import baseline

        return [baseline.judge(args.baseline or None, args.preset, args.profile, args.out,
                               arms=tuple(args.arm or ("retain@s0",)), gate=args.gate, threads=args.threads)]
    judged = [benchmark.judge(args.preset, args.profile, gate=args.gate, target=args.target, threads=args.threads,
                              progress=True, traces=run_dir / "traces", pauses=True)]
    if args.profile in SWEPT_PROFILES:
        with suite.threads(args.threads):
            budget = sweep.budget_left(args.preset, args.profile, time.monotonic() - started)
            judged.append(sweep.judge(args.preset, args.profile, gate=args.gate, budget_s=budget))
    return judged


def _print_record(record: dict) -> None:
    """A record's comparison lines (per group, per sweep shape, or the baseline's) and its checks."""
    from reports.benchmark import comparison_line

    measurements, gate = record["measurements"], record["config"]["gate"]
    for comparison in measurements["comparisons"] if record["kind"] == "benchmark-baseline" else []:
        print(comparison_line(comparison, record["config"]["workload"], gate))
    for group in measurements.get("groups", []):
        for comparison in group["comparisons"] + ([group["replay_floor"]] if group["replay_floor"] else []):
            print(comparison_line(comparison, group["label"], gate))
    for point in measurements.get("points", []):
        for comparison in point["comparisons"]:
            print(comparison_line(comparison, point["label"], gate))
    for check, passed in record["checks"].items():
        print(f"{'PASS' if passed else 'FAIL'}  {check}")
    for check, why in record.get("skips", {}).items():
        print(f"SKIP  {check}: {why}")  # e.g. inconclusive (loaded: ...): not a failure


def _bench(args: argparse.Namespace) -> int:
    """``rtv bench``: run the benchmark into a new folder, render its report, exit 0/1 on its enforced checks."""
    from reports import render_report
    from validation import history
    from validation.evidence import evidence_path, verify

    started = time.monotonic()
    run_dir = evidence_path(args.out, "bench").with_suffix("")  # one folder per run: the report shows this run only
    records = []
    for judged in _bench_judged(args, run_dir, started):
        path = canary("benchmark").record(args.preset, judged, run_dir)
        records.append((path, verify(path)))
        history.append(args.out / HISTORY_FILE, records[-1][1], str(path))
    scope = records[0][1]["config"].get("scope")
    title = f"rtv bench {run_dir.name}" + (f" ({scope})" if scope else "")
    report = render_report(run_dir, run_dir / "report" / "index.md", title=title)
    for _, record in records:
        _print_record(record)
    passed = all(record["passed"] for _, record in records)
    print(f"appended to the history {args.out / HISTORY_FILE} (rtv history --store FILE)")
    print(f"rtv bench: {'PASSED' if passed else 'FAILED'}; evidence: " + ", ".join(str(p) for p, _ in records)
          + f"\nreport: {report.html}")
    return 0 if passed else 1


def _history(args: argparse.Namespace) -> int:
    """``rtv history``: the trend page of the store; exit 1 when some series' verdict is a regression."""
    from reports.history import change_line, render_history
    from validation import history

    if not args.store.is_file():
        raise SetupError(f"no benchmark history at {args.store}", fix="run rtv bench first, or pass --store FILE")
    out = args.out_file or args.store.parent / "history" / "index.md"
    found = history.series(history.load(args.store, arm=args.arm, workload=args.workload))
    paths = render_history(found, f"Benchmark history: {args.store}", out)
    for series in paths.series:
        print(f"{series.verdict:18} {series.arm} · {series.workload} · machine {series.machine_id} "
              f"({len(series.commits)} commits)" + "".join(f"\n    {change_line(c)}" for c in series.changes))
    print(f"wrote {paths.markdown}\nwrote {paths.html}")
    return 1 if any(s.verdict == "regression" for s in paths.series) else 0


def _report(args: argparse.Namespace) -> int:
    from reports import render_report

    source = args.in_dir
    if not source.is_dir():
        raise SetupError(f"{source} is not a folder of evidence", fix="pass --in DIR, a folder of records")
    report = render_report(source, args.out_file)
    print(f"rtv report: {report.records} records, {'PASSED' if report.passed else 'FAILED'}")
    if report.skipped:
        first = ", ".join(map(str, report.skipped[:5])) + (" ..." if len(report.skipped) > 5 else "")
        print(f"skipped {len(report.skipped)} *.json that are not records (no {EVIDENCE_MARKER} beside them and none "
              f"verifies as evidence): {first}")
    if not report.records:
        print(f"no records in {source} nor in a folder rtv wrote records into below it (one holding "
              f"{EVIDENCE_MARKER}); a folder of records made otherwise is read when named: --in FOLDER")
    print(f"wrote {report.markdown}\nwrote {report.html}" + "".join(f"\nwrote {p}" for p in report.plots))
    if args.summary:
        from reports.summary import write_summary

        summary = write_summary(source, report.markdown.parent, report.html)
        print(f"wrote {summary.summary}" + (f"\nwrote {summary.comment} ({summary.regressions} regressions)"
                                            if summary.comment else " (no regression: no PR comment)"))
    return 0 if report.passed else 1


def _mutation_score(args: argparse.Namespace) -> int:
    from reports import render_report
    from validation.mutation_score import MutationConfig, run_mutation_score

    config = MutationConfig(paths=tuple(args.paths), tests=tuple(args.tests), sample=args.sample, seed=args.seed,
                            budget_s=args.budget, max_children=args.jobs, python=args.python)
    path = run_mutation_score(Path.cwd(), args.out, config)
    report = render_report(args.out)
    print(f"rtv mutation-score: evidence {path}\nreport: {report.html}")
    return 0 if report.passed else 1


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, found {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, found {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a number strictly between 0 and 1, found {value}")
    return value


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
        "--inject-mutation", metavar="NAME", default=os.environ.get(MUTATION_ENV) or None,
        help=f"negative control: leave the named bug of canaries.mutations.catalogue in for the whole run (also {MUTATION_ENV}=NAME); "
        "the canary that must catch it fails and the run exits 1",
    )
    run.add_argument("--gate", action="store_true",
                     help="enforce the shown verdicts too: the benchmark's gates and the learning equivalence verdicts")
    run.add_argument("--threads", type=_positive, default=1, help="torch CPU threads (default: 1)")
    run.add_argument("--preset", choices=PRESET_NAMES, default="cpu",
                     help="cpu (default), or a GPU preset: every canary on this machine's GPUs (exit 2 without CUDA)")
    run.add_argument("--nproc", type=_positive, default=None,
                     help="processes for the logical-rank parts (default: the preset's; a GPU preset: at most its GPUs)")
    run.add_argument("--hang-timeout", type=_seconds, default=None, metavar="S",
                     help="collective watchdog deadline in seconds (default: the preset's); a collective that waits "
                     "longer dumps every process's stack and trace into the run folder and the run exits 7")
    run.set_defaults(handler=_run)

    listing = "\n".join(f"  {c.name:12} {c.summary}" for c in CANARIES.values())
    canary_parser = sub.add_parser(
        "canary", help=f"run one canary ({' | '.join(CANARIES)})", epilog=f"registered canaries:\n{listing}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    canary_parser.add_argument("name", choices=list(CANARIES), metavar="NAME", help="a registered canary (below)")
    canary_parser.add_argument("--preset", choices=PRESET_NAMES, default="cpu",
                               help="cpu, or a GPU preset (without CUDA it runs on CPU with a small shape)")
    canary_parser.add_argument("--profile", choices=PROFILES, default="default",
                               help="depth: quick (seconds), default, nightly (minutes)")
    canary_parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="evidence folder (default: ./rtv-out)")
    canary_parser.add_argument("--threads", type=_positive, default=1, help="torch CPU threads (default: 1)")
    canary_parser.add_argument("--hang-timeout", type=_seconds, default=None, metavar="S",
                               help="collective watchdog deadline in seconds (default: the preset's); a hang exits 7")
    canary_parser.set_defaults(handler=_canary_command)

    bench = sub.add_parser(
        "bench", help="the benchmark: versioned-trainer arms vs a plain PyTorch step (ABBA), with its report",
        description="Compare the versioned trainer's placements (retain, offload, replay, auto; staleness 0 and 2) "
        "with a plain PyTorch step in alternating blocks, and render a report. Exits 1 when an enforced gate fails "
        "(retain@s0 vs plain, replay@s0 vs its floor: a regression beyond --gate; --target if given).",
    )
    bench.add_argument("--preset", choices=PRESET_NAMES, default="cpu",
                       help="cpu, or a GPU preset (on a machine without CUDA it runs CPU shapes and says so)")
    bench.add_argument("--profile", choices=PROFILES, default="default",
                       help="quick (<= 60 s), default (<= 5 min here; with a small cost-growth sweep), "
                       "nightly (every arm and workload, and the full sweep)")
    bench.add_argument("--gate", type=_fraction, default=0.05, help="half-width of the tie band (default: 0.05)")
    bench.add_argument("--target", type=float, default=None,
                       help="also enforce retain@s0 / plain median <= TARGET (default: 1.03 reported, not enforced)")
    bench.add_argument("--out", type=Path, default=DEFAULT_OUT / "bench", help="evidence folder (default: ./rtv-out/bench)")
    bench.add_argument("--threads", type=_positive, default=1, help="torch CPU threads (default: 1)")
    bench.add_argument("--baseline", nargs="?", const="", default=None, metavar="REV",
                       help="compare this checkout's reference_trainer with REV's (a commit, branch or tag; "
                       "default: the merge base with main), each in a worker process, in ABBA blocks; "
                       "plain runs too, as the A/A control")
    bench.add_argument("--sweep", action="store_true",
                       help="only the cost-growth sweep (default and nightly run it after the benchmark): sequence "
                       "length x batch (the full grid with --profile nightly; 4x{1K,2K,4K} on a GPU preset), each "
                       "shape in ABBA blocks against plain, and a fixed + per-token (+ per-token²) fit per arm")
    bench.add_argument("--arm", action="append", default=None, metavar="A",
                       help="with --baseline: an arm to compare, e.g. offload@s2 (repeatable; default: retain@s0)")
    bench.set_defaults(handler=_bench)

    trend = sub.add_parser("history", help="benchmark history: trend plots, change points and verdicts per series",
                           description="Render every benchmark record appended so far (one series per machine, "
                           "workload and arm; machines never mixed), find change points (ruptures PELT) and name the "
                           "first commit after each, with a verdict per series. Exits 1 when a series regressed.")
    trend.add_argument("--store", type=Path, default=DEFAULT_OUT / "bench" / HISTORY_FILE,
                       help=f"the history store (default: ./rtv-out/bench/{HISTORY_FILE}, where rtv bench appends)")
    trend.add_argument("--arm", default=None, help="only this arm, e.g. retain@s0")
    trend.add_argument("--workload", default=None, help="only this workload label, e.g. 'small 4x64 full'")
    trend.add_argument("--out", dest="out_file", type=Path, default=None,
                       help="Markdown file to write (default: <store folder>/history/index.md)")
    trend.set_defaults(handler=_history)

    report = sub.add_parser("report", help="render evidence into a Markdown/HTML report")
    report.add_argument("--in", dest="in_dir", type=Path, default=DEFAULT_OUT,
                        help="folder of evidence JSON, searched recursively (default: ./rtv-out)")
    report.add_argument("--out", dest="out_file", type=Path, default=None,
                        help="Markdown file to write; HTML and plots go beside it (default: <in>/report/index.md)")
    report.add_argument("--summary", action="store_true",
                        help="also write summary.md (benchmark verdicts, ratios, intervals, links: for "
                        "$GITHUB_STEP_SUMMARY) and, only when some verdict is a regression, pr-comment.md")
    report.set_defaults(handler=_report)

    mutation = sub.add_parser("mutation-score", help="measure the suite: a sampled mutmut run (the mutation extra)",
                              description="Run mutmut over --paths on a seeded sample of its mutants, each judged by "
                              "the --tests that reach it (NOTE [Mutation score] in validation.mutation_score); write "
                              "the score and the survivors as evidence and render the report. Run from the checkout.")
    mutation.add_argument("--paths", nargs="+", default=["reference_trainer", "validation"], help="packages to mutate")
    mutation.add_argument("--tests", nargs="+", default=["tests/unit"], help="the tests that judge (default: tests/unit)")
    mutation.add_argument("--sample", type=_positive, default=200, help="mutants to run (default: 200)")
    mutation.add_argument("--seed", type=int, default=0, help="seed of the sample (default: 0)")
    mutation.add_argument("--budget", type=float, default=3600.0, help="seconds for the whole run (default: 3600)")
    mutation.add_argument("--jobs", type=_positive, default=2, help="mutants run at once (default: 2)")
    mutation.add_argument("--python", default=sys.executable, help="interpreter with mutmut (default: this one)")
    mutation.add_argument("--out", type=Path, default=DEFAULT_OUT / "mutation",
                          help="evidence folder (default: ./rtv-out/mutation)")
    mutation.set_defaults(handler=_mutation_score)

    add_conform_command(sub)
    add_gpu_commands(sub)
    return parser


def _in_world(args: argparse.Namespace, processes: int) -> int:
    """Rank 0 of a torchrun world (NOTE [Joined worlds] in ``validation.world``): the command's logical-rank
    parts run on every process of the world, so the run's process count is the world's size."""
    from .presets import process_count

    if getattr(args, "nproc", None) not in (None, processes):
        raise SetupError(f"rtv {args.command} --nproc {args.nproc} under torchrun: expected the world's "
                         f"{processes} processes, found --nproc {args.nproc}",
                         fix=f"drop --nproc (it is the world's size under torchrun), or start {args.nproc} processes")
    if hasattr(args, "nproc"):
        args.nproc = processes
    with process_count(processes):
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
