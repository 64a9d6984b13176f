"""The README's promises a newcomer relies on: the 20-line API example runs, the pictures are there and small."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def _api_example() -> str:
    text = README.read_text()
    section = text[text.index("## The API in 20 lines"):]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_api_example_runs_and_fits_in_20_lines() -> None:
    code = _api_example()
    assert len([line for line in code.splitlines() if line.strip()]) <= 20
    scope: dict = {}
    exec(compile(code, "README.md (The API in 20 lines)", "exec"), scope)  # noqa: S102 - the README's own example
    trainer, report = scope["trainer"], scope["report"]
    assert trainer.checkpoint("policy").revision == 2 and report is not None


def test_the_verdict_board_picture_is_committed_and_small() -> None:
    picture = README.parent / "docs" / "verdict-board.png"
    assert "](docs/verdict-board.png)" in README.read_text()
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size < 150_000


# The throughput questions (issue 26), the command that answers each, and the picture of its plot where it has one.
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
    section = text[text.index("## Throughput: the questions it answers"):]
    section = section[: section.index("\n## ", 1)]
    parts = re.split(r"^\*\*(.+?)\*\*$", section, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def test_each_throughput_question_has_its_command_and_the_picture_of_its_plot() -> None:
    answers = _answers()
    assert list(answers) == list(THROUGHPUT), "the five questions, in the issue's order"
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
    section = text[text.index("## Layout"):]
    section = section[: section.index("\n## ", 1)]
    return dict(re.findall(r"^\| `([^`]+)` \| (.+) \|$", section, re.MULTILINE))


def test_the_layout_table_matches_the_tree() -> None:
    root = README.parent
    rows = _layout_rows()
    assert rows, "no Layout table"
    for path in rows:
        assert (root / path).exists(), f"the Layout table names {path}, which does not exist"
    folders = {p.name for p in root.iterdir() if p.is_dir() and any(p.rglob("*.py")) or p.name in (".ci", ".github")}
    folders -= {".venv", ".git", "rtv-out", "build"} | {p.name for p in root.iterdir() if p.name.endswith(".egg-info")}
    named = {path.strip("/").split("/")[0] for path in rows}
    assert folders <= named, f"folders missing from the Layout table: {sorted(folders - named)}"
    test_folders = {p.name for p in (root / "tests").iterdir() if p.is_dir() and any(p.glob("*.py"))}
    described = set(re.findall(r"`([a-z_]+)/`", rows["tests/"]))
    assert test_folders <= described, f"test folders the table does not list: {sorted(test_folders - described)}"


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
    assert markers and all(f"- `{marker}`:" in text for marker in markers), f"tests/README.md must describe {sorted(markers)}"


def test_every_run_prints_its_20_slowest_tests_as_the_tests_readme_says() -> None:
    root = README.parent
    options = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "--durations=20" in shlex.split(options["addopts"])
    text = (root / "tests" / "README.md").read_text()
    section = text[text.index("## The time budget"):]
    assert "--durations=20" in section and "≤ 60 s" in section and "user + sys" in section


def test_the_gpu_ci_section_sets_up_environment_secrets_label_and_sweeper_in_that_order():
    text = README.read_text()
    section = text[text.index("### GPU CI for a team"):text.index("## Layout")]
    steps = ["**The environment.**", "**The secrets**", "**The label.**", "**The sweeper.**"]
    positions = [section.index(step) for step in steps]
    assert positions == sorted(positions)
    for name in ("trainer-rank-gpu-validation", "SKYPILOT_API_SERVER_ENDPOINT", "SKYPILOT_SERVICE_ACCOUNT_TOKEN",
                 "`gpu-ci`", "rtv gpu sweep --older-than 3h"):
        assert name in section, name
