"""The README's promises a newcomer relies on: the 20-line API example runs, the pictures are there and small, every
shell command in a fenced block works as written after `make install`, the tables name every canary."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import tomllib

README = Path(__file__).parents[1] / "README.md"


def _api_example() -> str:
    text = README.read_text()
    section = text[text.index("## The API in 20 lines") :]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_api_example_runs_and_fits_in_20_lines() -> None:
    code = _api_example()
    assert len([line for line in code.splitlines() if line.strip()]) <= 20
    scope: dict = {}
    exec(compile(code, "README.md (The API in 20 lines)", "exec"), scope)  # the README's own example
    trainer, report = scope["trainer"], scope["report"]
    assert trainer.checkpoint("policy").revision == 2 and report is not None


def test_the_verdict_board_picture_is_committed_and_small() -> None:
    picture = README.parent / "docs" / "verdict-board.png"
    assert "](docs/verdict-board.png)" in README.read_text()
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size < 150_000


# The throughput questions in the README's order, the command that answers each, and the picture of its plot where
# it has one.
THROUGHPUT = {
    "What does this change cost against main?": ("rtv bench --baseline", "docs/bench-baseline.png"),
    "How does the cost grow?": ("rtv bench --profile default", "docs/bench-sweep.png"),
    "Did it get slower over time, and since which commit?": ("rtv history", "docs/bench-history.png"),
    "Where does the time go?": ("rtv bench", None),
    "Tell me on the PR, and only when it matters.": ("rtv report --in rtv-out/bench --summary", None),
}


def _answers() -> dict[str, str]:
    """The throughput section: each bold question -> the text up to the next one."""
    text = README.read_text()
    section = text[text.index("## Throughput: the questions it answers") :]
    section = section[: section.index("\n## ", 1)]
    parts = re.split(r"^\*\*(.+?)\*\*$", section, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def test_each_throughput_question_has_its_command_and_the_picture_of_its_plot() -> None:
    answers = _answers()
    assert list(answers) == list(THROUGHPUT), "the five questions, in THROUGHPUT's order"
    for question, (command, picture) in THROUGHPUT.items():
        answer = answers[question]
        assert f"`{command}" in answer, f"{question!r}: no `{command}` in its answer"
        pictures = re.findall(r"!\[[^\]]+\]\(([^)]+)\)", answer)
        assert pictures == ([picture] if picture else []), f"{question!r}: pictures {pictures}"
        if picture:
            data = (README.parent / picture).read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 150_000, f"{picture}: a small PNG"
            assert picture in (README.parent / "Makefile").read_text(), f"{picture}: made by make bench-pngs"


def _layout_rows() -> dict[str, str]:
    """The Layout table: first-column path -> its description."""
    text = README.read_text()
    section = text[text.index("## Layout") :]
    section = section[: section.index("\n## ", 1)]
    return dict(re.findall(r"^\| `([^`]+)` \| (.+) \|$", section, re.MULTILINE))


def test_the_layout_table_matches_the_tree() -> None:
    root = README.parent
    rows = _layout_rows()
    assert rows, "no Layout table"
    for path in rows:
        assert (root / path).exists(), f"the Layout table names {path}, which does not exist"
    folders = {p.name for p in root.iterdir() if (p.is_dir() and any(p.rglob("*.py"))) or p.name in (".ci", ".github")}
    folders -= {".venv", ".git", "rtv-out", "build"} | {p.name for p in root.iterdir() if p.name.endswith(".egg-info")}
    named = {path.strip("/").split("/")[0] for path in rows}
    assert folders <= named, f"folders missing from the Layout table: {sorted(folders - named)}"
    test_folders = {p.name for p in (root / "tests").iterdir() if p.is_dir() and any(p.glob("*.py"))}
    described = set(re.findall(r"`([a-z_]+)/`", rows["tests/"]))
    assert test_folders <= described, f"test folders the table does not list: {sorted(test_folders - described)}"


def package_folders(root: Path) -> list[str]:
    """Every importable package folder under ``root`` (``pyproject.toml``'s ``packages.find`` include), as
    ``pkg/`` or ``pkg/sub/``, in path order."""
    include = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    tops = sorted({pattern.rstrip("*") for pattern in include})
    inits = (init for top in tops for init in (root / top).rglob("__init__.py"))
    return sorted(init.parent.relative_to(root).as_posix() + "/" for init in inits)


def layout_gaps(rows: dict[str, str], folders: list[str]) -> list[str]:
    """The package folders the Layout table leaves out, each as the edit that adds it. A top-level package has a row
    of its own; a subpackage is named in its top-level package's row (`` `sub/` ``, or `` `sub/deeper/` ``) unless it
    has a row of its own."""
    gaps = []
    for folder in folders:
        top, _, rest = folder.partition("/")
        if folder in rows:
            continue
        if not rest:
            gaps.append(
                f"README.md's Layout table has no row for the package {folder}: add the row "
                f"| `{folder}` | <what it holds> |"
            )
        elif f"`{rest}`" not in rows.get(f"{top}/", ""):
            gaps.append(
                f"README.md's Layout table does not name the subpackage {folder}: add `{rest}` and what it "
                f"holds to the `{top}/` row"
            )
    return gaps


def test_the_layout_table_names_every_package_and_subpackage() -> None:
    gaps = layout_gaps(_layout_rows(), package_folders(README.parent))
    assert not gaps, "\n".join(gaps)


def test_negative_control_a_package_left_out_of_the_layout_table_is_named_with_its_row(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.packages.find]\ninclude = ["pkg*", "lib*"]\n')
    for folder in ("pkg", "pkg/named", "pkg/unnamed", "pkg/named/deep", "lib", "pkg/data", "tests/unit"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        if folder != "pkg/data":  # a folder without __init__.py is no package
            (tmp_path / folder / "__init__.py").write_text("")
    folders = package_folders(tmp_path)
    assert folders == ["lib/", "pkg/", "pkg/named/", "pkg/named/deep/", "pkg/unnamed/"]
    rows = {"pkg/": "the package; `named/` and `named/deep/`", "pkg/unnamed/": "a row of its own"}
    assert layout_gaps(rows, folders) == [
        "README.md's Layout table has no row for the package lib/: add the row | `lib/` | <what it holds> |"
    ]
    del rows["pkg/unnamed/"]
    rows["pkg/"] = "the package; `named/`"
    assert layout_gaps(rows, folders)[1:] == [
        (
            "README.md's Layout table does not name the subpackage pkg/named/deep/: add `named/deep/` and what it "
            "holds to the `pkg/` row"
        ),
        (
            "README.md's Layout table does not name the subpackage pkg/unnamed/: add `unnamed/` and what it holds to "
            "the `pkg/` row"
        ),
    ]


def test_the_docs_row_and_index_name_every_page() -> None:
    docs = README.parent / "docs"
    pages = sorted(p.name for p in docs.glob("*.md"))
    assert {"api.md", "semantics.md", "harness.md", "README.md"} <= set(pages)
    row, index = _layout_rows()["docs/"], (docs / "README.md").read_text()
    for page in pages:
        assert f"`{page}`" in row, f"the Layout table's docs/ row does not name {page}"
        assert page == "README.md" or f"]({page})" in index, f"docs/README.md does not link {page}"


def test_the_tests_readme_names_every_test_folder_and_marker() -> None:
    tests = README.parent / "tests"
    text = (tests / "README.md").read_text()
    listed = set(re.findall(r"^\| `([a-z_]+)/` \|", text, re.MULTILINE))
    folders = {p.name for p in tests.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    assert listed == folders, f"tests/README.md's table and the test folders differ: {sorted(listed ^ folders)}"
    markers = set(re.findall(r'addinivalue_line\("markers", "([a-z]+):', (tests / "conftest.py").read_text()))
    assert markers and all(f"- `{marker}`:" in text for marker in markers), (
        f"tests/README.md must describe {sorted(markers)}"
    )


def test_every_run_prints_its_20_slowest_tests_as_the_tests_readme_says() -> None:
    root = README.parent
    options = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "--durations=20" in shlex.split(options["addopts"])
    text = (root / "tests" / "README.md").read_text()
    section = text[text.index("## The time budget") :]
    assert "--durations=20" in section and "≤ 60 s" in section and "user + sys" in section


def test_the_gpu_ci_section_sets_up_environment_secrets_label_and_sweeper_in_that_order():
    text = README.read_text()
    section = text[text.index("### GPU CI for a team") : text.index("## Layout")]
    steps = ["**The environment.**", "**The secrets**", "**The label.**", "**The sweeper.**"]
    positions = [section.index(step) for step in steps]
    assert positions == sorted(positions)
    for name in (
        "trainer-rank-gpu-validation",
        "SKYPILOT_API_SERVER_ENDPOINT",
        "SKYPILOT_SERVICE_ACCOUNT_TOKEN",
        "`gpu-ci`",
        "rtv gpu sweep --older-than 3h",
    ):
        assert name in section, name


# --- The README's shell commands work as written after `make install` -----------------------------

ACTIVATE = "source .venv/bin/activate"
VENV_COMMANDS = ("rtv", "pytest", "torchrun")  # what a newcomer types that lives in .venv/bin, not on PATH


def _fenced_commands() -> list[str]:
    """Every command of the README's ```sh blocks (one a line), in order, without its comment."""
    blocks = re.findall(r"^```(?:sh|bash|shell)\n(.*?)^```", README.read_text(), re.DOTALL | re.MULTILINE)
    commands = [shlex.split(line, comments=True) for block in blocks for line in block.splitlines()]
    return [shlex.join(words) for words in commands if words]


def _installed_by_make() -> set[str]:
    """The distributions `make install` puts in .venv: torch, then the project with the extras its Makefile names."""
    project = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]
    extras = re.search(r"pip install -e '\.\[([a-z,-]+)\]'", (README.parent / "Makefile").read_text()).group(1)
    specs = project["dependencies"] + [s for e in extras.split(",") for s in project["optional-dependencies"][e]]
    names = {"torch", project["name"]} | {re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0] for spec in specs}
    return {name.lower().replace("_", "-") for name in names}


def _check_rtv(args: list[str]) -> None:
    """Help actually runs, through the console script; anything else must parse (subcommand, flags, choices)."""
    if "--help" in args:
        script = Path(sys.executable).parent / "rtv"
        done = subprocess.run(
            [str(script), *args],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ, PYTHONPATH=str(README.parent)),
            check=False,
        )
        assert done.returncode == 0 and done.stdout.startswith("usage: rtv"), done.stderr
        return
    from canaries.cli import _build_parser

    parsed = _build_parser().parse_args(args)  # argparse's SystemExit(2) names an unknown subcommand or flag
    if getattr(parsed, "inject_mutation", None):
        from canaries.mutations.catalogue import mutation

        mutation(parsed.inject_mutation)  # SetupError naming the known ones


def _check_torchrun(args: list[str]) -> None:
    """torchrun's own parser takes its flags; the script exists and declares every flag passed to it."""
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(args)
    script = README.parent / parsed.training_script
    declared = {
        node.args[0].value
        for node in ast.walk(ast.parse(script.read_text()))
        if isinstance(node, ast.Call)
        and getattr(node.func, "attr", None) == "add_argument"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }
    passed = {arg.split("=")[0] for arg in parsed.training_script_args if arg.startswith("--")}
    assert passed <= declared, f"{script.name} does not take {sorted(passed - declared)}"


def test_the_readme_says_how_to_reach_the_venvs_commands_before_naming_one() -> None:
    """`make run` leaves rtv in .venv/bin, not on PATH: the README activates the venv before its first venv command."""
    text = README.read_text()
    first = re.search(rf"(?:`|^)(?:{'|'.join(VENV_COMMANDS)}) ", text, re.MULTILINE)
    assert first is not None
    assert ACTIVATE in text[: first.start()], f"the README names {first.group(0)!r} before saying `{ACTIVATE}`"


@pytest.mark.parametrize("command", _fenced_commands())
def test_each_fenced_shell_command_runs_as_written_after_make_install(command: str) -> None:
    words = shlex.split(command)
    commands = _fenced_commands()
    if words[0] == "make":
        targets = re.findall(r"^([a-z][a-z-]*):", (README.parent / "Makefile").read_text(), re.MULTILINE)
        assert set(words[1:]) <= set(targets), (
            f"{command!r}: make has no target {sorted(set(words[1:]) - set(targets))}"
        )
        return
    if command == ACTIVATE:
        assert re.search(r"^VENV := \.venv$", (README.parent / "Makefile").read_text(), re.MULTILINE)
        assert "-m venv $(VENV)" in (README.parent / "Makefile").read_text(), "make install makes .venv with venv"
        return
    binary = words[0].removeprefix(".venv/bin/")
    if binary == words[0]:
        assert ACTIVATE in commands[: commands.index(command)], f"{command!r} before `{ACTIVATE}`: command not found"
    scripts = {ep.name: ep.dist.name.lower() for ep in entry_points(group="console_scripts")}
    assert scripts.get(binary) in _installed_by_make(), f"{binary!r} is no console script make install installs"
    assert (Path(sys.executable).parent / binary).is_file(), f"{binary!r} is not in this venv's bin"
    checks = {"rtv": _check_rtv, "torchrun": _check_torchrun}
    assert binary in checks, f"{command!r}: no rule checks its arguments; add one here"
    checks[binary](words[1:])


def _table_names(section: str) -> list[str]:
    """The first column of the README's table under ``section`` (header row left out)."""
    text = README.read_text()
    part = text[text.index(section) :]
    part = part[: part.index("\n#", 1)]
    return re.findall(r"^\| ([a-z]+) \|", part, re.MULTILINE)[1:]


def test_the_readme_names_every_registered_canary_in_its_verdict_table_run_list_and_layout() -> None:
    from canaries.registry import CANARIES
    from canaries.smoke import KIND as SMOKE

    assert sorted(_table_names("### How to read a verdict")) == sorted([SMOKE, *CANARIES]), "How to read a verdict"
    text = README.read_text()
    harness = text[text.index("## The harness") :]
    listed = re.search(r"`rtv run`: [^(]*\(([^)]*)\)", harness).group(1)
    assert listed.split(", ") == list(CANARIES), f"the `rtv run` bullet lists {listed}, the registry {list(CANARIES)}"
    canaries_row = _layout_rows()["canaries/"]
    for canary in CANARIES.values():
        folder = canary.module.split(".")[1]
        assert f"`{folder}/`" in canaries_row, f"the Layout table's canaries/ row does not name {folder}/"
