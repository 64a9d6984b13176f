"""``rtv run --preset gpu|gpu-8b``: every registered canary's GPU preset on this machine's GPUs, then one report.

What the GPU CI jobs run on the cluster (``ci/*.sky.yaml``). Part of the
``rtv`` command line (it imports the canary registry, as only the command
line may). It refuses, with exit 2 and the reason (docs/harness.md#exit-codes):

- without CUDA (``rtv gpu local`` runs a task's commands on CPU presets instead);
- with ``--nproc`` above the number of visible GPUs.

``--nproc`` reaches the canaries as ``RTV_NPROC`` (the processes their
logical-rank parts use). The canaries run through the loop ``rtv run`` uses
on the CPU (``canaries.suite.run_canaries``, on the ``default`` profile); a
canary that raises is reported and the others still run. Exit 1 if an
enforced canary's evidence does not say passed, else 0.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from validation.errors import SetupError

__all__ = ["NPROC_ENV", "require_gpus", "run_gpu_preset"]

NPROC_ENV = "RTV_NPROC"


def require_gpus(preset: str, nproc: int) -> None:
    """:class:`SetupError` unless CUDA is present with at least ``nproc`` devices."""
    import torch

    if not torch.cuda.is_available():
        raise SetupError(f"rtv run --preset {preset}: no CUDA device on this machine (torch {torch.__version__}, "
                         f"cuda build: {torch.version.cuda})",
                         fix="run it on a GPU machine (rtv gpu launch ci/gate.sky.yaml), "
                             "or here with --preset cpu (rtv gpu local ci/gate.sky.yaml does that)")
    count = torch.cuda.device_count()
    if nproc > count:
        raise SetupError(f"rtv run --preset {preset} --nproc {nproc}: expected at most {count} processes, "
                         f"one per visible GPU, found --nproc {nproc}", fix=f"pass --nproc {count} or fewer")


def run_gpu_preset(preset: str, nproc: int, out: Path, *, environ: dict[str, str], gate: bool = False,
                   echo: Callable[[str], None] = print) -> int:
    """Run every registered canary on ``preset``; returns the exit code (module docstring)."""
    try:
        require_gpus(preset, nproc)
    except SetupError as error:
        print(error, file=sys.stderr)
        return error.exit_code
    from canaries.suite import run_canaries
    from reports import render_report

    environ[NPROC_ENV] = str(nproc)
    run_dir = Path(out) / f"run-{preset}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    run_dir.mkdir(parents=True, exist_ok=False)
    echo(f"rtv run --preset {preset} --nproc {nproc}: evidence goes to {run_dir}")
    failed = [o.name for o in run_canaries(preset, "default", run_dir, gate=gate, echo=echo) if o.fails_run]
    report = render_report(run_dir, run_dir / "report" / "index.md", title=f"rtv run --preset {preset}")
    echo(f"report: {report.html}")
    echo(f"rtv run --preset {preset}: {'PASSED' if not failed else 'FAILED: ' + ', '.join(failed)}")
    return 1 if failed else 0
