"""``rtv bench --baseline REV``: the same arm on two source trees, REV and HEAD, in alternating ABBA blocks.

NOTE [Source against its base]
1. Scope: ``reference_trainer/`` only. REV's tree is a ``git worktree`` of its
   own (:func:`source_tree`, ``<out>/sources/<commit>``); each side runs in a
   worker process (``canaries.benchmark.worker``) whose ``PYTHONPATH`` puts
   that side's ``reference_trainer`` before this checkout's harness, so arms,
   timing and statistics are HEAD's on both sides and only the trainer's
   source differs. Each side's commit and source digest (SHA-256 of its
   ``reference_trainer/*.py``) are recorded.
2. Per arm, one ``validation.abba.compare`` of ``{REV, HEAD}``, REV the
   baseline, with ``rtv bench``'s looks, verdicts, gate band and exit codes: a
   ratio above 1 means HEAD is slower. Arms are compared one at a time on
   fresh workers, since arms in one process share its allocator
   (``canary.split_gated``).
3. Times are each worker's own step seconds (the pipe's round trip is not
   timed); ``compare``'s clock is their running sum. The load probe is the
   workers' CPU seconds over the driver's wall seconds (:class:`WorkerShare`,
   about 1 with one worker computing at a time); the machine meter counts
   the workers' CPU as the measurement's own (NOTE [Machine load] Rule 1).
4. ``plain`` never runs ``reference_trainer``'s step, so it is the A/A
   control: always run first, never a finding, and a decided difference
   there means the method, not the source, is broken.
5. REV whose trainer source digest equals HEAD's is an A/A run of every arm
   (``config["a_a"]``), said in the scope, the terminal and the report; REV
   at HEAD's commit with edited trainer files is not (HEAD imports the work
   tree) and is labelled :data:`EDITED`. REV is shown by itself up to 12
   characters, else by its commit's first 12 (the full REV is in
   ``sources``). Its worktree is removed and pruned when the run ends.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path

from reports.numbers import interval, number
from validation.abba import Comparison, LoadMeter, LoadProbe, compare
from validation.errors import SetupError
from validation.evidence import Checks
from validation.load import Meter

from ..registry import Judged
from .arms import TimedWorkload
from .canary import WARMUP_BLOCKS, plan

__all__ = [
    "KIND",
    "CONTROL",
    "merge_base",
    "source_tree",
    "source_identity",
    "Worker",
    "WorkerShare",
    "compare_sources",
    "measure",
]

KIND = "benchmark-baseline"
CONTROL = "plain"
BASE_SIDE, HEAD_SIDE = "base", "head"  # the sides' names in compare (REV may itself be spelled "HEAD")
ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str, cwd: Path = ROOT) -> str:
    """``git args`` in ``cwd``; a failure is a :class:`SetupError` carrying git's message."""
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SetupError(
            f"git {' '.join(args)} failed: {done.stderr.strip()}",
            fix="pass --baseline a commit, branch or tag of this repository",
        )
    return done.stdout.strip()


EDITED = "REV is HEAD's commit; HEAD has uncommitted edits"  # the scope of a run that is no A/A run for that


def merge_base(root: Path = ROOT) -> str:
    """The default baseline: the merge base of HEAD with ``main``."""
    return _git("merge-base", "HEAD", "main", cwd=root)


def source_identity(tree: Path) -> dict[str, str]:
    """``{"commit", "digest"}`` of a source tree: its HEAD (plus ``+dirty`` when edited) and Rule 1's digest."""
    digest = hashlib.sha256()
    for path in sorted((tree / "reference_trainer").rglob("*.py")):
        digest.update(str(path.relative_to(tree)).encode())
        digest.update(path.read_bytes())
    commit = _git("rev-parse", "HEAD", cwd=tree)
    dirty = _git("status", "--porcelain", "--", "reference_trainer", cwd=tree)
    return {"commit": commit + ("+dirty" if dirty else ""), "digest": digest.hexdigest()}


def source_tree(rev: str, out: Path, root: Path = ROOT) -> tuple[str, Path]:
    """``(commit, path)``: REV's source as a detached ``git worktree`` under ``out/sources/<commit>`` (reused)."""
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}", cwd=root)
    tree = (Path(out) / "sources" / commit).resolve()
    if not (tree / "reference_trainer").is_dir():
        tree.parent.mkdir(parents=True, exist_ok=True)
        _git("worktree", "add", "--detach", "--force", str(tree), commit, cwd=root)
    return commit, tree


def remove_tree(tree: Path, root: Path = ROOT) -> None:
    """Remove REV's worktree made by :func:`source_tree` and its trainer link folder; git forgets the worktree."""
    if tree.is_dir():
        _git("worktree", "remove", "--force", str(tree), cwd=root)
    shutil.rmtree(tree.parent / f"{tree.name}.trainer", ignore_errors=True)
    _git("worktree", "prune", cwd=root)


def revision_label(rev: str, commit: str) -> str:
    """REV as written when it has at most 12 characters (``HEAD~1``, ``v1.2``), else its commit's first 12."""
    return rev if len(rev) <= 12 else commit[:12]


def _trainer_only(tree: Path) -> Path:
    """A folder holding only a link to ``tree``'s ``reference_trainer`` (Rule 1: the harness stays HEAD's)."""
    shim = tree.parent / f"{tree.name}.trainer"
    link = shim / "reference_trainer"
    if not link.exists():
        shim.mkdir(parents=True, exist_ok=True)
        link.symlink_to(tree / "reference_trainer", target_is_directory=True)
    return shim


class Worker:
    """A running ``canaries.benchmark.worker`` that imports ``tree``'s trainer (Rule 1); ``cpu``: its CPU seconds."""

    def __init__(self, tree: Path) -> None:
        shim = ROOT if tree.resolve() == ROOT else _trainer_only(tree)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim), str(ROOT)]))
        # cwd: ``python -m`` puts it first on sys.path, so it must not be a checkout with a trainer of its own.
        self.process = subprocess.Popen(
            [sys.executable, "-m", "canaries.benchmark.worker"],
            env=env,
            cwd=shim,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.cpu = 0.0

    def ask(self, **request: object) -> dict:
        """Send one request, return its answer; a worker's error is raised here as a :class:`SetupError`."""
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = json.loads(self.process.stdout.readline() or '{"error": "the worker exited"}')
        if "error" in answer:
            raise SetupError(f"benchmark worker failed:\n{answer['error']}", fix="run the arm on that source alone")
        self.cpu = answer["cpu"]
        return answer

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)


class WorkerShare:
    """Rule 3's load probe: the workers' CPU seconds over wall seconds for the block."""

    def __init__(self, workers: list[Worker], wall: Callable[[], float]) -> None:
        self.workers, self.wall, self.began = workers, wall, (0.0, 0.0)

    def _cpu(self) -> float:
        return sum(w.cpu for w in self.workers)

    def start(self) -> None:
        self.began = (self._cpu(), self.wall())

    def stop(self) -> float:
        cpu, wall = self._cpu() - self.began[0], self.wall() - self.began[1]
        return cpu / wall if wall > 0 else 1.0


class _SummedClock:
    """Rule 3's clock: the running sum of the workers' own step seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def step(self, worker: Worker) -> Callable[[], None]:
        def run() -> None:
            self.now += worker.ask(op="step")["seconds"]

        return run


def compare_sources(
    sides: Mapping[str, Mapping[str, Callable[[], object]]],
    *,
    baseline: str,
    gate: float,
    max_blocks: int,
    budget_s: float,
    clock: Callable[[], float],
    load_probe: LoadProbe | None,
    meter: LoadMeter | None = None,
) -> dict[str, Comparison]:
    """Per arm, ``compare`` of its two sides (``sides[arm] = {rev_label: step, head_label: step}``), Rule 2."""
    return {
        arm: compare(
            steps,
            baseline=baseline,
            gate=gate,
            max_blocks=max_blocks,
            budget_s=budget_s / len(sides),
            warmup_blocks=WARMUP_BLOCKS,
            clock=clock,
            load_probe=load_probe,
            meter=meter,
        )[0]
        for arm, steps in sides.items()
    }


def _checks(results: dict[str, Comparison], losses: dict[str, dict[str, float]], scope: str) -> Checks:
    checks = Checks()
    control = results[CONTROL]
    checks.check(
        f"{CONTROL} {scope}: the A/A control is not a decided difference (the method holds)",
        control.verdict not in ("regression", "gain"),
        f"{control.reading}: ratio {number(control.ratio, '.4f')}, CI {interval(*control.ci95, '.4f')}",
    )
    for arm, result in results.items():
        if arm == CONTROL:
            continue
        low, high = result.ci95
        checks.check(
            f"{arm} {scope}: not a regression (±{result.gate:.0%} gate)",
            result.verdict != "regression",
            f"{result.reading}: ratio {number(result.ratio, '.4f')}, CI {interval(low, high, '.4f')} over "
            f"{result.blocks} blocks; "
            f"first losses {losses[arm]}",
        )
    return checks


def measure(
    rev: str | None,
    preset: str,
    profile: str,
    out: Path,
    *,
    arms: tuple[str, ...] = ("retain@s0",),
    gate: float = 0.05,
    threads: int = 1,
    seed: int = 0,
    root: Path = ROOT,
    worker: Callable[[Path], Worker] = Worker,
    meter: LoadMeter | None = None,
) -> Judged:
    """Compare ``arms`` (plus the :data:`CONTROL`) on REV's and HEAD's trainer (module NOTE); the caller records it.

    ``rev``: a commit, branch or tag; None: :func:`merge_base`. The workload,
    block bound and budget are :func:`canary.plan`'s gated ones for
    ``preset`` x ``profile``. Raises :class:`SetupError` for an unknown REV
    or a worker that fails. ``root``: the checkout that is
    HEAD; ``worker``: starts a side's worker on a tree (tests fake both);
    ``meter``: the machine meter (default: ``validation.load.Meter`` counting
    the workers' CPU as the measurement's own, Rule 3).
    """
    rev = rev or merge_base(root)
    commit, tree = source_tree(rev, out, root)
    try:
        identities = {"baseline": {"rev": rev, **source_identity(tree)}, "head": source_identity(root)}
        a_a = identities["baseline"]["digest"] == identities["head"]["digest"]  # HEAD's side imports the work tree
        edited = not a_a and commit == _git("rev-parse", "HEAD", cwd=root)
        label = revision_label(rev, commit)
        scope = f"{label} → HEAD" + (" (A/A: the same trainer source)" if a_a else f" ({EDITED})" if edited else "")
        if a_a:
            print(
                f"rtv bench --baseline: {rev} ({commit[:12]}) has HEAD's trainer source: an A/A run (both sides run "
                "the same trainer; pass --baseline REV to compare with another revision)",
                flush=True,
            )
        elif edited:
            print(f"rtv bench --baseline: {EDITED}: the comparison is of those edits", flush=True)
        return _judged(
            tree,
            root,
            preset,
            profile,
            arms=arms,
            gate=gate,
            threads=threads,
            seed=seed,
            worker=worker,
            meter=meter,
            config={"scope": scope, "a_a": a_a},
            label=label,
            identities=identities,
        )
    finally:
        try:
            remove_tree(tree, root)
        except SetupError as error:  # the comparison stands; only the clean-up failed
            print(
                f"rtv bench --baseline: REV's worktree {tree} stays ({error.cause}); remove it with "
                f"`git worktree remove --force {tree}`",
                file=sys.stderr,
            )


def _judged(
    tree: Path,
    root: Path,
    preset: str,
    profile: str,
    *,
    arms: tuple[str, ...],
    gate: float,
    threads: int,
    seed: int,
    worker: Callable[[Path], Worker],
    meter: LoadMeter | None,
    config: dict,
    label: str,
    identities: dict,
) -> Judged:
    """:func:`measure`'s comparison of REV's ``tree`` with HEAD's ``root`` and its record's parts."""
    import time

    scope = config["scope"]
    plan_ = plan(preset, profile)
    workload: TimedWorkload = plan_.groups[0].workload
    names = (CONTROL, *(a for a in arms if a != CONTROL))
    sides, losses, workers = {}, {}, []
    clock = _SummedClock()
    try:
        for arm in names:
            pair = {BASE_SIDE: worker(tree), HEAD_SIDE: worker(root)}
            workers += pair.values()
            losses[arm] = {
                side: w.ask(op="build", workload=asdict(workload), arm=arm, seed=seed, threads=threads)["loss"]
                for side, w in pair.items()
            }
            sides[arm] = {side: clock.step(w) for side, w in pair.items()}
        results = compare_sources(
            sides,
            baseline=BASE_SIDE,
            gate=gate,
            max_blocks=plan_.max_blocks,
            budget_s=plan_.budget_s,
            clock=clock,
            load_probe=WorkerShare(workers, time.perf_counter),
            meter=meter or Meter(pids=lambda: [w.process.pid for w in workers]),
        )
    finally:
        for worker in workers:
            worker.close()
    return Judged(
        KIND,
        {
            "preset": preset,
            "profile": profile,
            "gate": gate,
            "threads": threads,
            "seed": seed,
            **config,
            "source_scope": "reference_trainer/ (the harness is HEAD's on both sides)",
            "workload": workload.label,
            "control": CONTROL,
            "max_blocks": plan_.max_blocks,
            "budget_s": plan_.budget_s,
        },
        _checks(results, losses, scope),
        # "arm" is the arm compared (HEAD's side), "baseline" the REV it is compared with
        {
            "sources": identities,
            "first_losses": losses,
            "comparisons": [dict(r.as_dict(), arm=arm, baseline=label) for arm, r in results.items()],
        },
    )
