"""``rtv bench`` and ``rtv history``: the benchmark, its baseline and sweep, one report; every benchmark so far.

    rtv bench [--preset P] [--profile quick|default|nightly] [--gate G] [--target R] [--out DIR]
              [--baseline [REV] [--arm A ...]] [--sweep]
    rtv history [--store FILE] [--arm A] [--workload W] [--out FILE]

``rtv bench`` judges with options of its own (the band ``--gate``, the
target, threads, traces and pauses: ``canaries.benchmark.canary.measure``)
and writes through ``canaries.registry.Canary.record``; each record is also
appended to the history store (:data:`HISTORY_FILE` in ``--out``), which
``rtv history`` renders. Exit 1 when an enforced check fails (bench) or a
series' verdict is a regression (history).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from validation.errors import SetupError
from validation.evidence import DEFAULT_OUT, checks_of

from ..arguments import fraction, positive
from ..registry import PRESET_NAMES, PROFILES, canary
from ..suite import threads

__all__ = ["HISTORY_FILE", "SWEPT_PROFILES", "add_bench_commands"]

HISTORY_FILE = "history.sqlite"  # in rtv bench's --out folder
SWEPT_PROFILES = ("default", "nightly")  # rtv bench's profiles that run the cost-growth sweep after the benchmark


def _bench_judged(args: argparse.Namespace, run_dir: Path, started: float) -> list:
    """What ``rtv bench`` runs: the sweep alone (``--sweep``), the baseline, or the benchmark and, on the
    ``SWEPT_PROFILES``, the sweep's grid of that profile in what the run's budget leaves (``started``: the
    run's ``time.monotonic()``; NOTE [Cost growth] in ``canaries/benchmark/sweep.py``)."""
    from . import canary as benchmark
    from . import sweep

    if args.sweep:
        with threads(args.threads):
            return [sweep.measure(args.preset, args.profile, gate=args.gate)]
    if args.baseline is not None:
        from . import baseline

        return [
            baseline.measure(
                args.baseline or None,
                args.preset,
                args.profile,
                args.out,
                arms=tuple(args.arm or ("retain@s0",)),
                gate=args.gate,
                threads=args.threads,
            )
        ]
    judged = [
        benchmark.measure(
            args.preset,
            args.profile,
            gate=args.gate,
            target=args.target,
            threads=args.threads,
            progress=True,
            traces=run_dir / "traces",
            pauses=True,
        )
    ]
    if args.profile in SWEPT_PROFILES:
        with threads(args.threads):
            budget = sweep.budget_left(args.preset, args.profile, time.monotonic() - started)
            judged.append(sweep.measure(args.preset, args.profile, gate=args.gate, budget_s=budget))
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
    for check in checks_of(record):  # a skip, e.g. inconclusive (loaded: ...), is not a failure
        print(check.line)


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
    print(
        f"rtv bench: {'PASSED' if passed else 'FAILED'}; evidence: "
        + ", ".join(str(p) for p, _ in records)
        + f"\nreport: {report.html}"
    )
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
        print(
            f"{series.verdict:18} {series.arm} · {series.workload} · machine {series.machine_id} "
            f"({len(series.commits)} commits)" + "".join(f"\n    {change_line(c)}" for c in series.changes)
        )
    print(f"wrote {paths.markdown}\nwrote {paths.html}")
    return 1 if any(s.verdict == "regression" for s in paths.series) else 0


def add_bench_commands(sub: Any) -> None:
    """Add ``rtv bench`` and ``rtv history`` to ``sub`` (the ``rtv`` parser's subparsers)."""
    bench = sub.add_parser(
        "bench",
        help="the benchmark: versioned-trainer arms vs a plain PyTorch step (ABBA), with its report",
        description="Compare the versioned trainer's placements (retain, offload, replay, auto; staleness 0 and 2) "
        "with a plain PyTorch step in alternating blocks, and render a report. Exits 1 when an enforced gate fails "
        "(retain@s0 vs plain, replay@s0 vs its floor: a regression beyond --gate; --target if given).",
    )
    bench.add_argument(
        "--preset",
        choices=PRESET_NAMES,
        default="cpu",
        help="cpu, or a GPU preset (on a machine without CUDA it runs CPU shapes and says so)",
    )
    bench.add_argument(
        "--profile",
        choices=PROFILES,
        default="default",
        help="quick (<= 60 s), default (<= 5 min here; with a small cost-growth sweep), "
        "nightly (every arm and workload, and the full sweep)",
    )
    bench.add_argument("--gate", type=fraction, default=0.05, help="half-width of the tie band (default: 0.05)")
    bench.add_argument(
        "--target",
        type=float,
        default=None,
        help="also enforce retain@s0 / plain median <= TARGET (default: 1.03 reported, not enforced)",
    )
    bench.add_argument(
        "--out", type=Path, default=DEFAULT_OUT / "bench", help="evidence folder (default: ./rtv-out/bench)"
    )
    bench.add_argument("--threads", type=positive, default=1, help="torch CPU threads (default: 1)")
    bench.add_argument(
        "--baseline",
        nargs="?",
        const="",
        default=None,
        metavar="REV",
        help="compare this checkout's reference_trainer with REV's (a commit, branch or tag; "
        "default: the merge base with main), each in a worker process, in ABBA blocks; "
        "plain runs too, as the A/A control",
    )
    bench.add_argument(
        "--sweep",
        action="store_true",
        help="only the cost-growth sweep (default and nightly run it after the benchmark): sequence "
        "length x batch (the full grid with --profile nightly; 4x{1K,2K,4K} on a GPU preset), each "
        "shape in ABBA blocks against plain, and a fixed + per-token (+ per-token²) fit per arm",
    )
    bench.add_argument(
        "--arm",
        action="append",
        default=None,
        metavar="A",
        help="with --baseline: an arm to compare, e.g. offload@s2 (repeatable; default: retain@s0)",
    )
    bench.set_defaults(handler=_bench)

    trend = sub.add_parser(
        "history",
        help="benchmark history: trend plots, change points and verdicts per series",
        description="Render every benchmark record appended so far (one series per machine, "
        "workload and arm; machines never mixed), find change points (ruptures PELT) and name the "
        "first commit after each, with a verdict per series. Exits 1 when a series regressed.",
    )
    trend.add_argument(
        "--store",
        type=Path,
        default=DEFAULT_OUT / "bench" / HISTORY_FILE,
        help=f"the history store (default: ./rtv-out/bench/{HISTORY_FILE}, where rtv bench appends)",
    )
    trend.add_argument("--arm", default=None, help="only this arm, e.g. retain@s0")
    trend.add_argument("--workload", default=None, help="only this workload label, e.g. 'small 4x64 full'")
    trend.add_argument(
        "--out",
        dest="out_file",
        type=Path,
        default=None,
        help="Markdown file to write (default: <store folder>/history/index.md)",
    )
    trend.set_defaults(handler=_history)
