"""``rtv gpu launch|status|down|sweep|receipts|local``: the GPU CI part of the command line.

``canaries.cli`` (the ``rtv`` parser) calls :func:`add_gpu_commands` once;
nothing here imports ``canaries``: a GPU job runs the harness through its
command line (the task files call ``rtv run --preset gpu ...``). SkyPilot (the ``ci`` extra) is
imported only by the commands that talk to it, so ``rtv --help`` stays
instant; without it they exit 2 with the fix.

    rtv gpu launch TASK [--cluster NAME | --run-id ID --attempt N] [--env KEY=VALUE]... [--out DIR]
    rtv gpu status                 clusters this project launched, any user's, as SkyPilot sees them
    rtv gpu down NAME [--wait S]   tear down, prove absence, write a receipt (exit 6 if unproven)
    rtv gpu sweep [--older-than DURATION] [--prefix rtv-] [--fail-if-found]
                                          down every matching cluster of any user, a receipt each
    rtv gpu receipts [--in DIR]    every termination receipt under rtv-out/
    rtv gpu local TASK [--out DIR] [--skip-setup] [--venv DIR]

Exit codes: docs/harness.md#exit-codes (NOTE [Exit codes] in ``ci.launcher``).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from validation.errors import HarnessError, SetupError
from validation.evidence import DEFAULT_OUT

__all__ = ["add_gpu_commands"]


def _sky() -> Any:
    try:
        import sky
    except ImportError as error:
        raise SetupError(
            f"SkyPilot is not installed ({error})", fix="install the ci extra: pip install -e '.[ci]' (make test does)"
        ) from None
    return sky


def _launch(args: argparse.Namespace) -> int:
    from .launcher import Launcher, cluster_name, default_run_id
    from .tasks import load_task

    spec = load_task(args.task, validate=True, envs=_envs(args.env))
    run_id, attempt = default_run_id()
    name = args.cluster or cluster_name(spec.name, args.run_id or run_id, args.attempt or attempt)
    return Launcher(_sky()).launch(spec, cluster=name, out_dir=args.out).exit_code


def _envs(items: list[str]) -> dict[str, str]:
    """``--env KEY=VALUE`` arguments as a mapping; a SetupError (exit 2) names the first malformed one."""
    bad = [item for item in items if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", item, re.S)]
    if bad:
        raise SetupError(
            f"--env expects KEY=VALUE (KEY a shell variable name), found {bad[0]!r}",
            fix="pass e.g. --env RTV_TIME_LIMIT=10m",
        )
    return dict(item.split("=", 1) for item in items)


def _down(args: argparse.Namespace) -> int:
    from .launcher import Launcher, Timeouts

    timeouts = Timeouts(absence=args.wait)
    return Launcher(_sky(), timeouts=timeouts).down(args.name, out_dir=args.out).exit_code


def _sweep(args: argparse.Namespace) -> int:
    from .launcher import Launcher, Timeouts

    if args.older_than is not None:
        _duration(args.older_than)
    outcomes = Launcher(_sky(), timeouts=Timeouts(absence=args.wait)).sweep(
        out_dir=args.out, prefix=args.prefix, older_than=args.older_than
    )
    codes = [o.exit_code for o in outcomes]
    code = 6 if 6 in codes else max(codes, default=0)
    if args.fail_if_found and outcomes:
        print(
            f"rtv gpu sweep: FAILED: {len(outcomes)} cluster(s) outlived their runs (receipts in {args.out}); "
            "each is a launcher or workflow that did not tear down: read its receipt",
            flush=True,
        )
        return code or 1
    return code


def _duration(text: str) -> float:
    from .tasks import parse_duration

    try:
        return parse_duration(text)
    except ValueError as error:
        raise SetupError(f"--older-than: {error}", fix="pass e.g. --older-than 2h") from None


def _status(args: argparse.Namespace) -> int:
    from .launcher import Launcher

    records = Launcher(_sky()).census()
    for r in records:
        print(f"{r.name:40} {r.status.value:10} {r.user_name or r.user_hash or '?':12} {r.resources_str or ''}")
    print(
        f"rtv gpu status: {len(records)} cluster(s) of this project up"
        if records
        else "rtv gpu status: no cluster of this project exists"
    )
    return 0


def _receipts(args: argparse.Namespace) -> int:
    from reports.kinds import RECEIPT_KIND
    from reports.records import load_records

    if not args.in_dir.is_dir():
        raise SetupError(f"{args.in_dir} is not a folder", fix="pass --in DIR (default ./rtv-out)")
    # A tampered receipt no longer verifies, so its kind is unknown: its file name still says what it was.
    receipts = [
        r for r in load_records(args.in_dir) if r.kind == RECEIPT_KIND or r.path.name.startswith(f"{RECEIPT_KIND}-")
    ]
    for r in receipts:
        m = r.record.get("measurements", {})
        cost = m.get("cost", {}).get("estimate", "?")
        print(
            f"{r.record.get('created', '?')[:19]}  {m.get('cluster', '?'):32} {m.get('outcome', r.status):18} "
            f"absence {m.get('absence', '?'):9} {m.get('gpu_minutes', 0):8.1f} GPU-min  "
            f"{cost if isinstance(cost, str) else f'${cost:.2f}'}  {r.path}  [{r.integrity}]"
        )
    print(f"rtv gpu receipts: {len(receipts)} receipt(s) under {args.in_dir}")
    return 1 if any(r.status == "invalid" for r in receipts) else 0


def _local(args: argparse.Namespace) -> int:
    import torch

    from .local import run_local
    from .tasks import load_task

    spec = load_task(args.task)
    return run_local(spec, out=args.out, cuda=torch.cuda.is_available(), skip_setup=args.skip_setup, venv=args.venv)


def _guarded(handler):
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except HarnessError as error:
            print(f"rtv gpu {args.gpu_command}: {error}", file=sys.stderr)
            return error.exit_code

    return run


def add_gpu_commands(subparsers: Any) -> None:
    """Add ``rtv gpu ...`` to ``rtv``'s subparsers."""
    gpu = subparsers.add_parser(
        "gpu",
        help="GPU CI on SkyPilot: launch, status, down, sweep, receipts, local",
        description="GPU CI on SkyPilot: launch a task file and gate on its job status, "
        "tear clusters down and prove it, list receipts, run a task's commands here.",
    )
    sub = gpu.add_subparsers(dest="gpu_command", metavar="GPU_COMMAND", required=True)

    launch = sub.add_parser("launch", help="launch a task, gate on its job status, tear down, write a receipt")
    launch.add_argument("task", type=Path, help="a task file, e.g. ci/gate.sky.yaml")
    launch.add_argument("--cluster", help="cluster name (default: rtv-<task>-<run id>-<attempt>)")
    launch.add_argument("--run-id", help="run id for the name (default: $GITHUB_RUN_ID, else a UTC stamp)")
    launch.add_argument("--attempt", help="attempt for the name (default: $GITHUB_RUN_ATTEMPT, else 1)")
    launch.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set or override one of the task's envs (repeatable)",
    )
    launch.add_argument("--out", type=Path, default=DEFAULT_OUT / "gpu", help="evidence, logs, receipt")
    launch.set_defaults(handler=_guarded(_launch))

    status = sub.add_parser("status", help="clusters this project launched (any user's), as SkyPilot sees them")
    status.set_defaults(handler=_guarded(_status))

    down = sub.add_parser("down", help="tear a cluster down and prove it is gone (exit 6 if unproven)")
    down.add_argument("name", help="the cluster name (printed by rtv gpu launch)")
    down.add_argument("--out", type=Path, default=DEFAULT_OUT / "gpu", help="where the receipt goes")
    down.add_argument(
        "--wait", type=float, default=600.0, help="seconds to keep polling for the cluster's absence (default: 600)"
    )
    down.set_defaults(handler=_guarded(_down))

    sweep = sub.add_parser("sweep", help="down every CI cluster of any user (lost runners, earlier attempts)")
    sweep.add_argument(
        "--older-than",
        default=None,
        metavar="DURATION",
        help="only clusters launched at least this long ago (90s, 40m, 2h; default: all)",
    )
    sweep.add_argument("--prefix", default="rtv-", help="only clusters whose name starts with this (default: rtv-)")
    sweep.add_argument("--out", type=Path, default=DEFAULT_OUT / "gpu", help="where the receipts go (one each)")
    sweep.add_argument("--wait", type=float, default=600.0, help="seconds to poll each cluster's absence")
    sweep.add_argument(
        "--fail-if-found",
        action="store_true",
        help="exit 1 when anything was found (the scheduled sweeper: a leftover cluster is a bug)",
    )
    sweep.set_defaults(handler=_guarded(_sweep))

    receipts = sub.add_parser("receipts", help="list termination receipts")
    receipts.add_argument("--in", dest="in_dir", type=Path, default=DEFAULT_OUT, help="searched recursively")
    receipts.set_defaults(handler=_guarded(_receipts))

    local = sub.add_parser("local", help="run a task file's setup and run here (CPU presets without CUDA)")
    local.add_argument("task", type=Path, help="a task file, e.g. ci/gate.sky.yaml")
    local.add_argument("--out", type=Path, default=None, help="evidence folder (default: rtv-out/local/<task>-<time>)")
    local.add_argument("--skip-setup", action="store_true", help="run only the task's run commands")
    local.add_argument(
        "--venv",
        type=Path,
        default=None,
        help="the environment the commands use as RTV_VENV (default: the one rtv runs from)",
    )
    local.set_defaults(handler=_guarded(_local))
