"""``rtv``: the one command line of the harness (a thin layer over the packages).

Exit status: 0 when every check passed, 1 when a check failed, 2 for usage
errors and subcommands that are not implemented yet.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .smoke import Check

__all__ = ["main"]

INJECT_ENV = "RTV_SMOKE_INJECT_FAILURE"

# Subcommands still to come: name -> help line.
PLANNED = {
    "learn": "matched-schedule learning comparison",
    "bench": "ABBA throughput benchmark",
    "report": "render evidence into a Markdown/HTML report",
    "ci": "launch the GPU CI jobs through SkyPilot",
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rtv",
        description="Reference-trainer validation: canaries, learning comparisons, benchmarks, reports.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = sub.add_parser(
        "run",
        help="the main job (for now: a CPU smoke of model + LoRA + AdamW)",
        description="Run the CPU checks and write a JSON record. For now: a smoke of the tiny "
        "model with a LoRA adapter (forward, loss, backward, one AdamW step).",
    )
    run.add_argument("--out", type=Path, default=Path("rtv-out"), help="output folder (default: ./rtv-out)")
    run.add_argument("--seed", type=int, default=0, help="seed for weights, adapter and tokens (default: 0)")
    run.add_argument(
        "--inject-failure",
        action="store_true",
        default=os.environ.get(INJECT_ENV) == "1",
        help=f"negative control: make a check fail on purpose (also {INJECT_ENV}=1)",
    )
    run.set_defaults(handler=_run)

    canary = sub.add_parser("canary", help="run one canary suite (derivative | memory)")
    canary.add_argument("suite", choices=("derivative", "memory"))
    canary.set_defaults(handler=_not_implemented)

    for name, help_line in PLANNED.items():
        sub.add_parser(name, help=help_line).set_defaults(handler=_not_implemented)
    return parser


def _run(args: argparse.Namespace) -> int:
    from .smoke import run_smoke  # imports torch: keep `rtv --help` instant

    def show(check: Check) -> None:
        print(f"{'PASS' if check.passed else 'FAIL'}  {check.name}: {check.detail}", flush=True)

    result = run_smoke(seed=args.seed, inject_failure=args.inject_failure, on_check=show)
    record = result.record()
    record["created_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = args.out / f"smoke-{stamp}-{os.getpid()}.json"
    with path.open("x") as f:  # evidence is write-once
        json.dump(record, f, indent=2)
        f.write("\n")
    failed = sum(not check.passed for check in result.checks)
    print(f"wrote {path}")
    print(f"smoke: {'PASSED' if not failed else f'FAILED ({failed} of {len(result.checks)} checks)'}")
    return 0 if not failed else 1


def _not_implemented(args: argparse.Namespace) -> int:
    what = " ".join(filter(None, (args.command, getattr(args, "suite", None))))
    print(f"rtv {what}: not implemented yet", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
