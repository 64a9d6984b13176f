"""``rtv conform``: run the conformance suite (``validation.conform``) on adapters; one record, one report.

    rtv conform ADAPTER ...              shipped names or package.module:factory
    rtv conform --adapter package.module:factory [--adapter ...]
    rtv conform --list                   the shipped adapters
    [--seed S] [--dtype float32|float64] [--max-staleness K] [--out DIR]

Exit status: 0 when every applicable check of every adapter passed, 1 when
one failed, 2 for a broken adapter (named in one line with the fix:
``validation.conform.AdapterError``) or a usage error.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from validation.errors import SetupError
from validation.evidence import DEFAULT_OUT, evidence_path, write_once

__all__ = ["add_conform_command"]

_DTYPES = ("float32", "float64")


def _list() -> int:
    from validation.conform import SHIPPED

    for name, (path, summary) in SHIPPED.items():
        print(f"{name:15} {summary}\n{'':15} --adapter {path}")
    return 0


def _print(adapter: str, verdict) -> None:
    word = {"passed": "PASS", "failed": "FAIL", "not applicable": "N/A "}[verdict.status]
    print(f"{word}  {adapter} {verdict.check}: {verdict.reason}", flush=True)


def _conform(args: argparse.Namespace) -> int:
    if args.list:
        return _list()
    from validation.conform import AdapterError, ConformSpec, conform
    from validation.conform.suite import require_distinct_names

    adapters = [*args.adapters, *args.adapter]
    if not adapters:
        raise SetupError(
            "rtv conform: no adapter named",
            fix="name one (rtv conform --list), or pass --adapter package.module:factory",
        )
    spec = ConformSpec(seed=args.seed, dtype=args.dtype, max_staleness=args.max_staleness)
    started, reports = time.monotonic(), []
    try:
        require_distinct_names(adapters)
        for adapter in adapters:
            reports.append(conform(adapter, spec, progress=_print))
    except AdapterError as error:
        print(f"rtv conform: {error.one_line()}", flush=True)
        return 2
    return _write(reports, spec, args.out, time.monotonic() - started)


def _write(reports: list, spec, out: Path, seconds: float) -> int:
    from reports import render_report
    from validation.conform import conform_record

    run_dir = evidence_path(out, "conform").with_suffix("")
    path = write_once(run_dir / "conform.json", conform_record(reports, spec, seconds=round(seconds, 2)))
    report = render_report(run_dir, run_dir / "report" / "index.md", title=f"rtv conform {run_dir.name}")
    passed = all(r.passed for r in reports)
    print(f"rtv conform: {'PASSED' if passed else 'FAILED'}; evidence: {path}\nreport: {report.html}")
    return 0 if passed else 1


def add_conform_command(sub: argparse._SubParsersAction) -> None:
    """Register ``rtv conform`` on the command line's subparsers."""
    parser = sub.add_parser(
        "conform",
        help="the conformance suite: judge any trainer's gradients, staleness, splits, resume, processes",
        description="Drive each named adapter (a shipped name, or package.module:factory returning a "
        "validation.conform.Adapter) through the checks sync, stale, splits, resume and processes against the "
        "suite's FP64 oracle (docs/conform.md); write one evidence record and a report. Exits 0 when every "
        "applicable check passed, 1 when one failed, 2 for a broken adapter (one line: what, and the fix).",
    )
    parser.add_argument(
        "adapters", nargs="*", metavar="ADAPTER", help="shipped adapter names or package.module:factory"
    )
    parser.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="PACKAGE.MODULE:FACTORY",
        help="an adapter's factory (repeatable); its folder must be importable (PYTHONPATH)",
    )
    parser.add_argument("--list", action="store_true", help="list the shipped adapters and exit")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and batches (default: 0)")
    parser.add_argument("--dtype", choices=_DTYPES, default="float32", help="parameter dtype (default: float32)")
    parser.add_argument(
        "--max-staleness", type=int, default=2, help="largest staleness the stale check tries (default: 2)"
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT / "conform", help="evidence folder (default: ./rtv-out/conform)"
    )
    parser.set_defaults(handler=_conform)
