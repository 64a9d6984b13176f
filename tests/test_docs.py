"""The docs the repository ships: every citation of them resolves, nothing cites a document outside it, every public name is documented.

Conventions (``docs/README.md``):

- a citation is ``docs/<page>`` with an optional ``#anchor`` (from anywhere in
  the tree), or a relative Markdown link ``[text](page.md#anchor)`` /
  ``[text](#anchor)`` (from a Markdown file); the page must exist and the
  anchor must be the GitHub slug of one of its headings;
- no file cites a section sign or a contract document kept outside the
  repository (the shared spec folder beside the checkout);
- every name in ``reference_trainer.__all__`` has a heading `` ### `Name` ``
  in ``docs/api.md``, and every such heading names a public name;
- comments and docs speak of the code, not of a tracker a reader of the
  repository cannot see: no "issue" / "defect" / "PR" / "ticket" with a
  number, and no bare hash-number (say the rule, the test or the NOTE it
  means instead). The word alone ("issues") and a quoted colour are fine.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import reference_trainer as rt

ROOT = Path(__file__).parents[1]
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".txt", ".sh"}
TEXT_NAMES = {"Makefile", "run", "slow_tier", "local_slurm_stage"}  # extension-less scripts (.ci/run, ...)
SKIPPED_DIRS = {
    ".git",
    ".venv",
    "rtv-out",
    "build",
    "mutants",
    "node_modules",
    "__pycache__",
    ".pytest_cache",
    ".hypothesis",
    ".mypy_cache",
    ".ruff_cache",
    "fixtures",
}

_DOC_REF = re.compile(r"(?<![\w./-])docs/([\w./-]*[\w-])(?:#([\w-]+))?")
_MD_LINK = re.compile(r"\]\((?!https?:|mailto:)([^)\s#]*)(?:#([^)\s]+))?\)")
# Written with escapes and character classes so that this file does not match itself.
_OUTSIDE = re.compile("\u00a7|contract[.]md|contract[ ]section|shared[/]spec|[.][.]/shared")
# A tracker's item by number. Written with character classes so that this file does not match itself.
# A bare "#N" after "(" is the trainer's own count of a rank's commands ("run_logical (#2)", ranks/state.py), not a
# tracker's item; the same words after an issue's or defect's name are still one.
_TRACKER = re.compile(
    r"\b(?:[i]ssue|[d]efect|[P]R|[t]icket|[p]ull request)s?[- ]?\(?#?[0-9]+\b|(?<![\w&#\"'/(])#[0-9]+\b", re.IGNORECASE
)
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_API_HEADING = re.compile(r"^### `([^`]+)`\s*$", re.MULTILINE)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading anchor of a Markdown text (outside code fences; repeats get ``-1``, ``-2``, ...)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        match = None if fenced else _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def source_files(root: Path) -> list[Path]:
    """The tree's text files, without generated folders, virtual environments and recorded fixtures.

    Skipped folders are pruned, not walked: a virtual environment alone holds tens of thousands of files.
    """
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in SKIPPED_DIRS and not d.endswith(".egg-info"))
        files += [Path(folder, name) for name in names if Path(name).suffix in TEXT_SUFFIXES or name in TEXT_NAMES]
    return sorted(files)


def _resolve(root: Path, page: Path, anchor: str | None, where: str) -> list[str]:
    if not page.is_file():
        return [f"{where}: cites {page.relative_to(root) if page.is_relative_to(root) else page}, which does not exist"]
    if not page.resolve().is_relative_to(root.resolve()):
        return [f"{where}: cites {page}, outside the repository"]
    if anchor and page.suffix == ".md" and anchor not in anchors(page.read_text()):
        return [f"{where}: cites {page.relative_to(root)}#{anchor}, a heading that page does not have"]
    return []


def citation_problems(root: Path) -> list[str]:
    """Every citation under ``root`` that does not resolve, and every citation of a document outside it."""
    problems: list[str] = []
    for path in source_files(root):
        name = path.relative_to(root).as_posix()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            where = f"{name}:{number}"
            if _OUTSIDE.search(line):
                problems.append(f"{where}: cites a document outside the repository: {line.strip()}")
            for target, anchor in _DOC_REF.findall(line):
                problems += _resolve(root, root / "docs" / target, anchor or None, where)
            if path.suffix == ".md":
                for target, anchor in _MD_LINK.findall(line):
                    page = path if not target else path.parent / target
                    if target and not (target.endswith(".md") or page.exists()):
                        continue  # not a page link (an image with a URL scheme, ...)
                    problems += _resolve(root, page, anchor or None, where)
    return problems


def tracker_citations(root: Path) -> list[str]:
    """Every line under ``root`` that cites a tracker's item by number, as ``path:line: the citation``."""
    found = []
    for path in source_files(root):
        name = path.relative_to(root).as_posix()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            found += [f"{name}:{number}: {match.group(0)!r}" for match in _TRACKER.finditer(line)]
    return found


def api_problems(api_markdown: str, names: list[str]) -> list[str]:
    """Public names without their `` ### `Name` `` heading in the API page, and headings of no public name."""
    documented = set(_API_HEADING.findall(api_markdown))
    missing = [f"{name} has no ### `{name}` heading in docs/api.md" for name in names if name not in documented]
    stale = [
        f"docs/api.md documents {name}, which reference_trainer.__all__ lacks"
        for name in sorted(documented - set(names))
    ]
    return missing + stale


def test_every_citation_in_the_tree_resolves_inside_the_repository() -> None:
    problems = citation_problems(ROOT)
    assert not problems, "\n".join(problems)


def test_no_comment_or_doc_cites_a_tracker_item() -> None:
    found = tracker_citations(ROOT)
    assert not found, "say the rule, test or NOTE it means instead of the tracker's number:\n" + "\n".join(found)


def test_the_api_page_documents_every_public_name() -> None:
    problems = api_problems((ROOT / "docs" / "api.md").read_text(), list(rt.__all__))
    assert not problems, "\n".join(problems)


def test_the_readme_sends_readers_to_the_docs() -> None:
    readme = (ROOT / "README.md").read_text()
    for page in ("docs/api.md", "docs/semantics.md", "docs/harness.md"):
        assert f"]({page}" in readme, f"the README does not link {page}"


# --- negative controls: the checkers see what they must ------------------------------------------------


def test_slugs_follow_github() -> None:
    assert slug("Placements and memory admission") == "placements-and-memory-admission"
    assert slug("`Trainer.forward`") == "trainerforward"
    assert slug("Refusals change nothing!") == "refusals-change-nothing"
    assert anchors("# A\n```\n# not a heading\n```\n## A\n") == {"a", "a-1"}


def test_broken_and_outside_citations_are_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "semantics.md").write_text(
        "# Semantics\n\n## Staleness\n\nSee [x](#staleness), [y](api.md).\n"
    )
    (tmp_path / "pkg").mkdir()
    sign, docs = "\u00a7", "docs" + "/"  # split so that the real tree's check does not see them
    (tmp_path / "pkg" / "good.py").write_text('"""Rules: docs/semantics.md#staleness."""\n')
    (tmp_path / "pkg" / "bad.py").write_text(
        '"""See ' + docs + "semantics.md#stalenes, " + docs + "missing.md and the contract " + sign + '4."""\n'
        "# as in ../" + "shared/" + "spec/contract" + ".md\n"
    )
    problems = citation_problems(tmp_path)
    assert not [p for p in problems if p.startswith("pkg/good.py")]
    bad = [p for p in problems if p.startswith("pkg/bad.py:1")]
    assert any(p.endswith(f"cites {docs}semantics.md#stalenes, a heading that page does not have") for p in bad), bad
    assert any(p.endswith(f"cites {docs}missing.md, which does not exist") for p in bad), bad
    assert len(bad) == 3, bad  # the broken anchor, the missing page, the section sign
    assert any(p.startswith("pkg/bad.py:2") and "outside the repository" in p for p in problems), problems
    assert any(p.startswith("docs/semantics.md:5") and "api.md" in p for p in problems), problems  # a page link
    assert len([p for p in problems if p.startswith("docs/semantics.md")]) == 1  # #staleness resolves


def test_a_planted_tracker_citation_is_reported(tmp_path: Path) -> None:
    issue, defect = "issue ", "defect "  # split so that the real tree's check does not see them
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "bad.py").write_text(
        f"x = 1  # as {issue}12 asks\n"
        f'"""({defect}4, per {issue.title().strip()}-7)."""\n'
        'color = "#555"  # a colour in quotes is not a tracker\n'
        f'label = "run_logical (#2)"  # a rank\'s command count; but {issue}(#9) is a citation\n'
    )
    (tmp_path / "notes.md").write_text("Fixed in #" + "34.\nThe `issues` tool; step 12; an issue, 2 defects.\n")
    assert tracker_citations(tmp_path) == [
        "notes.md:1: '#3" + "4'",
        f"pkg/bad.py:1: '{issue}12'",
        f"pkg/bad.py:2: '{defect}4'",
        f"pkg/bad.py:2: '{issue.title().strip()}-7'",
        f"pkg/bad.py:4: '{issue}(#9'",
    ]


def test_a_missing_or_stale_api_name_is_reported() -> None:
    page = "# API\n\n### `Trainer`\n\n### `Gone`\n\n`ForwardInput` in prose is not a heading.\n"
    problems = api_problems(page, ["Trainer", "ForwardInput"])
    assert problems == [
        "ForwardInput has no ### `ForwardInput` heading in docs/api.md",
        "docs/api.md documents Gone, which reference_trainer.__all__ lacks",
    ]
