"""The suite's strength, measured: a sampled mutmut run over the trainer and the harness.

NOTE [Mutation score]
  1. The tool is mutmut, pinned in the ``mutation`` extra (its internals used
     here are those of that version). It runs in a scratch copy of the
     packages, ``tests/`` and ``pyproject.toml`` (with a ``[tool.mutmut]``
     section added), never in the checkout; mutmut keeps its ``mutants/``
     there, and ``PYTHONPATH`` is dropped so only the mutated copy imports.
     mutmut forks one child per mutant from its test process, and a child
     forked after torch's thread pool ran hangs in its first parallel op
     (every mutant would "time out", a false kill): torch runs on one
     thread there (``RTV_TORCH_THREADS=1`` for the suite's conftest,
     ``OMP_NUM_THREADS=1``).
  2. Every mutant of the chosen packages is generated, then a deterministic
     sample of their names is run: ``random.Random(seed).sample`` of the
     sorted names (all of them when ``sample`` is None or larger). Each
     mutant runs only the tests of the selection (``tests/unit`` by
     default) that reached the mutated function in mutmut's stats run.
  3. ``budget_s`` bounds the whole run; mutants not checked by then are
     reported as ``not checked`` and the record's check "every sampled
     mutant was checked" fails.
  4. Statuses are mutmut's (``mutmut results --all=true``). Killed means
     ``killed`` or ``timeout``; the score of a package is killed over every
     checked mutant, ``no tests`` (a function no selected test reaches)
     counted as not killed. Every mutant not killed is a survivor, named in
     the record with its file, line and the mutated lines (``mutmut show``).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .errors import SetupError
from .evidence import Checks, evidence_path, make_record, write_once

__all__ = [
    "KIND",
    "TOOL",
    "MutationConfig",
    "parse_results",
    "sample_names",
    "summarize",
    "locate",
    "run_mutation_score",
]

KIND = "mutation-score"
TOOL = "mutmut==3.8.1"  # the `mutation` extra's pin; the generation step below uses this version's internals
KILLED = frozenset({"killed", "timeout"})
_SUPPORT = (
    "reference_trainer",
    "validation",
    "canaries",
    "reports",
    "ci",
    "tests",
    "pyproject.toml",
)  # what tests import
_IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "rtv-out", "mutants", ".hypothesis")
_GENERATE = (  # mutmut 3.8 has no "generate only" command: its run's first step, alone
    "import os; os.environ['MUTANT_UNDER_TEST'] = 'mutant_generation'; "
    "from mutmut.__main__ import copy_also_copy_files, copy_src_dir, create_mutants; "
    "os.makedirs('mutants', exist_ok=True); copy_src_dir(); copy_also_copy_files(); create_mutants({children})"
)


@dataclass(frozen=True, kw_only=True)
class MutationConfig:
    """What to mutate (``paths``: top-level packages), which tests judge it, and how much to run (NOTE Rules 2-3)."""

    paths: tuple[str, ...] = ("reference_trainer", "validation")
    tests: tuple[str, ...] = ("tests/unit",)
    sample: int | None = 200
    seed: int = 0
    budget_s: float = 3600.0
    max_children: int = 2
    python: str = sys.executable  # an interpreter with the `mutation` extra and the project's dependencies


def sample_names(names: list[str], sample: int | None, seed: int) -> list[str]:
    """Rule 2: the sorted names, or a seeded sample of them (sorted, so the run order is reproducible too)."""
    ordered = sorted(names)
    if sample is None or sample >= len(ordered):
        return ordered
    return sorted(random.Random(seed).sample(ordered, sample))


def parse_results(text: str) -> dict[str, str]:
    """``mutmut results --all=true`` output as ``{mutant name: status}``."""
    found = (re.match(r"^\s+(\S+__mutmut_\d+): (.+?)\s*$", line) for line in text.splitlines())
    return {m.group(1): m.group(2) for m in found if m}


def summarize(statuses: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Rule 4 per top-level package: status counts, checked, killed and the score (None when nothing was checked)."""
    by_package: dict[str, Counter[str]] = {}
    for name, status in statuses.items():
        by_package.setdefault(name.split(".")[0], Counter())[status] += 1
    out = {}
    for package, counts in sorted(by_package.items()):
        checked = sum(n for status, n in counts.items() if status != "not checked")
        killed = sum(counts[status] for status in KILLED)
        out[package] = {
            "counts": dict(sorted(counts.items())),
            "checked": checked,
            "killed": killed,
            "score": killed / checked if checked else None,
        }
    return out


def _source_file(root: Path, module: str) -> Path:
    base = root.joinpath(*module.split("."))
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"


def locate(name: str, shown: str, root: Path) -> dict[str, Any]:
    """A survivor's file, line and mutated lines, from its name and its ``mutmut show`` diff (hunks count from the def)."""
    module, _, function = name.partition("__mutmut_")[0].rpartition(".")
    # A method is mangled as xǁClassǁmethod, a function as x_function.
    cls, method = function.split("ǁ")[1:3] if "ǁ" in function else (None, function.removeprefix("x_"))
    path = _source_file(root, module)
    lines = path.read_text().splitlines() if path.is_file() else []
    start = 0
    if cls is not None:
        start = next((i for i, line in enumerate(lines) if re.match(rf"\s*class {re.escape(cls)}\b", line)), 0)
    definition = next(
        (i for i in range(start, len(lines)) if re.match(rf"\s*(async\s+)?def {re.escape(method)}\b", lines[i])), None
    )
    body = shown.split("\n@@", 1)[-1].splitlines()[1:]  # the hunk after its header
    offset = next(
        (i for i, line in enumerate(line for line in body if not line.startswith("+")) if line.startswith("-")), None
    )
    number = None if definition is None or offset is None else definition + offset + 1
    return {
        "name": name,
        "file": str(path.relative_to(root)) if path.is_file() else module,
        "line": number,
        "removed": [text[1:] for text in body if text.startswith("-")],
        "added": [text[1:] for text in body if text.startswith("+")],
    }


def _scratch(root: Path, scratch: Path, config: MutationConfig) -> None:
    """Rule 1: the copy mutmut works in, its configuration appended to the copied pyproject."""
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    copied = dict.fromkeys((*config.paths, *_SUPPORT))
    for name in copied:
        source = root / name
        if source.is_dir():
            shutil.copytree(source, scratch / name, ignore=_IGNORED)
        elif source.is_file():
            shutil.copy2(source, scratch / name)
    others = [name for name in copied if name not in config.paths and (root / name).is_dir()]
    with open(scratch / "pyproject.toml", "a") as handle:
        handle.write(
            "\n[tool.mutmut]\n"
            f"source_paths = {list(config.paths)!r}\n"
            f"also_copy = {others!r}\n"
            f"pytest_add_cli_args_test_selection = {list(config.tests)!r}\n"
            "pytest_add_cli_args = ['-p', 'no:xdist', '-p', 'no:cacheprovider']\n"
        )


def _env() -> dict[str, str]:
    """Rule 1: without PYTHONPATH (the tests import the mutated copy, never the checkout), torch on one thread."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MUTANT_UNDER_TEST")}
    return {**env, "RTV_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}


def _mutmut(config: MutationConfig, scratch: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """One mutmut command (or ``-c CODE`` in its interpreter) in the scratch copy, its output captured."""
    command = [config.python, *args] if args[0] == "-c" else [config.python, "-m", "mutmut", *args]
    return subprocess.run(
        command, cwd=scratch, env=_env(), capture_output=True, text=True, timeout=timeout, check=False
    )


def _generated(scratch: Path) -> list[str]:
    """Every mutant name mutmut generated (the keys of its ``mutants/**/*.meta`` files)."""
    return [
        key
        for meta in sorted((scratch / "mutants").rglob("*.meta"))
        for key in json.loads(meta.read_text())["exit_code_by_key"]
    ]


def _run_sample(config: MutationConfig, scratch: Path, names: list[str], log: Path) -> tuple[bool, float]:
    """Rule 3: ``mutmut run NAMES`` under the budget, with a progress bar read from mutmut's own result files."""
    start = time.monotonic()
    with open(log, "a") as out:
        process = subprocess.Popen(
            [config.python, "-m", "mutmut", "run", "--max-children", str(config.max_children), *names],
            cwd=scratch,
            env=_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wanted = set(names)
        with tqdm(total=len(names), desc="mutants", unit="mutant") as bar:
            while process.poll() is None and time.monotonic() - start < config.budget_s:
                time.sleep(2)
                bar.update(_checked(scratch, wanted) - bar.n)
            if process.poll() is None:
                os.killpg(process.pid, 9)  # the budget is spent; mutmut's forked children go with it
                process.wait()
            bar.update(_checked(scratch, wanted) - bar.n)
    return process.returncode == 0, time.monotonic() - start


def _checked(scratch: Path, wanted: set[str]) -> int:
    """How many of ``wanted`` mutmut has a result for so far."""
    done = 0
    for meta in (scratch / "mutants").rglob("*.meta"):
        try:
            codes = json.loads(meta.read_text())["exit_code_by_key"]
        except (ValueError, KeyError):  # mutmut is rewriting it
            continue
        done += sum(1 for key, code in codes.items() if key in wanted and code is not None)
    return done


def run_mutation_score(root: Path, out_dir: Path, config: MutationConfig = MutationConfig()) -> Path:
    """Run NOTE [Mutation score] on the checkout at ``root``; write and return the evidence record under ``out_dir``.

    Raises :class:`SetupError` (exit 2) when mutmut is not installed for
    ``config.python`` or generates no mutant. The scratch copy is a
    temporary folder, removed afterwards (it holds JSON files a report of
    ``out_dir`` must not read); mutmut's log stays as ``out_dir/mutmut.log``.
    """
    root, out_dir = Path(root).resolve(), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="rtv-mutation-")) / "tree"
    try:
        return _measure(root, out_dir, scratch, config)
    finally:
        shutil.rmtree(scratch.parent, ignore_errors=True)


def _measure(root: Path, out_dir: Path, scratch: Path, config: MutationConfig) -> Path:
    """Rules 1-4 in ``scratch``: generate, sample, run, read the statuses and locate the survivors."""
    log = (out_dir / "mutmut.log").resolve()
    _scratch(root, scratch, config)
    generated = _mutmut(config, scratch, "-c", _GENERATE.format(children=config.max_children), timeout=600)
    if generated.returncode != 0:
        raise SetupError(
            f"mutmut could not generate mutants with {config.python}: {generated.stderr.strip()[-500:]}",
            fix="install the mutation extra (pip install -e '.[mutation]', not beside the ci extra) "
            "or pass --python for an interpreter that has it",
        )
    names = sample_names(_generated(scratch), config.sample, config.seed)
    if not names:
        raise SetupError(f"mutmut generated no mutant for {list(config.paths)}", fix="pass packages that hold code")
    clean, seconds = _run_sample(config, scratch, names, log)
    results = parse_results(_mutmut(config, scratch, "results", "--all=true", timeout=600).stdout)
    statuses = {name: results.get(name, "not checked") for name in names}
    survivors = [
        {**locate(name, _mutmut(config, scratch, "show", name, timeout=120).stdout, root), "status": status}
        for name, status in statuses.items()
        if status not in KILLED
    ]
    unchecked = [name for name, status in statuses.items() if status == "not checked"]
    checks = Checks()
    checks.check("mutmut ran to the end", clean, f"log: {log}")
    checks.check(
        "every sampled mutant was checked",
        not unchecked,
        f"not checked: {unchecked}" if unchecked else f"{len(names)} of {len(names)} checked",
    )
    measurements = {
        "tool": TOOL,
        "generated": len(_generated(scratch)),
        "sampled": len(names),
        "by_package": summarize(statuses),
        "survivors": survivors,
        "seconds": round(seconds, 1),
        "log": str(log),
    }
    record = make_record(
        KIND, config={**asdict(config), "python": config.python}, checks=checks, measurements=measurements
    )
    return write_once(evidence_path(out_dir, KIND), record)
