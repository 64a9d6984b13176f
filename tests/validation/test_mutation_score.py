"""NOTE [Mutation score]: sampling, mutmut's results parsed, scores per package, survivors located and rendered.

The end-to-end case runs the real mutmut on a ten-line package with two
tests in a temporary folder (a few seconds); it needs the ``mutation``
extra, which cannot sit beside the ``ci`` extra (click), so without it the
case is skipped with that reason and the nightly mutation job runs it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from reports import render_report
from validation.evidence import make_record, verify, write_once
from validation.mutation_score import MutationConfig, locate, parse_results, run_mutation_score, sample_names, summarize

TOY = """def clamp(x, low, high):
    if x < low:
        return low
    if x > high:
        return high
    return x


def double(x):
    return x * 2
"""
TOY_TESTS = """from toypkg.calc import clamp, double


def test_clamp():
    assert clamp(5, 0, 10) == 5 and clamp(-1, 0, 10) == 0


def test_double():
    assert double(3) == 6
"""


def _toy(root: Path) -> Path:
    (root / "toypkg").mkdir(parents=True)
    (root / "toypkg" / "__init__.py").write_text("")
    (root / "toypkg" / "calc.py").write_text(TOY)
    (root / "tests").mkdir()
    (root / "tests" / "test_calc.py").write_text(TOY_TESTS)
    (root / "pyproject.toml").write_text("")
    return root


def test_the_sample_is_seeded_sorted_and_everything_when_it_is_larger() -> None:
    names = [f"pkg.m.x_f__mutmut_{i}" for i in range(50)]
    picked = sample_names(names, 10, seed=3)
    assert picked == sample_names(list(reversed(names)), 10, seed=3) == sorted(picked) and len(set(picked)) == 10
    assert picked != sample_names(names, 10, seed=4)
    assert sample_names(names, None, 0) == sample_names(names, 99, 0) == sorted(names)


def test_results_are_parsed_and_scored_per_package() -> None:
    text = (
        "    a.m.x_f__mutmut_1: killed\n    a.m.xǁCǁg__mutmut_2: survived\n    a.m.x_f__mutmut_3: timeout\n"
        "    b.n.x_h__mutmut_1: no tests\n    b.n.x_h__mutmut_2: not checked\nnoise line\n"
    )
    statuses = parse_results(text)
    assert statuses["a.m.xǁCǁg__mutmut_2"] == "survived" and len(statuses) == 5
    summary = summarize(statuses)
    assert summary["a"] == {
        "counts": {"killed": 1, "survived": 1, "timeout": 1},
        "checked": 3,
        "killed": 2,
        "score": pytest.approx(2 / 3),
    }
    assert summary["b"]["checked"] == 1 and summary["b"]["score"] == 0.0  # "no tests" is checked, not killed
    assert summarize({"c.x_f__mutmut_1": "not checked"})["c"]["score"] is None


def test_a_survivor_is_located_by_its_function_and_diff(tmp_path: Path) -> None:
    root = _toy(tmp_path)
    (root / "toypkg" / "shapes.py").write_text("class Box:\n    def area(self, w):\n        return w * w\n")
    shown = (
        "# toypkg.calc.x_clamp__mutmut_2: survived\n--- a\n+++ b\n@@ -1,6 +1,6 @@\n def clamp(x, low, high):\n"
        "     if x < low:\n         return low\n-    if x > high:\n+    if x >= high:\n         return high\n"
    )
    where = locate("toypkg.calc.x_clamp__mutmut_2", shown, root)
    assert (where["file"], where["line"], where["removed"], where["added"]) == (
        "toypkg/calc.py",
        4,
        ["    if x > high:"],
        ["    if x >= high:"],
    )
    method = "@@ -1,2 +1,2 @@\n def area(self, w):\n-    return w * w\n+    return w / w\n"
    assert locate("toypkg.shapes.xǁBoxǁarea__mutmut_1", method, root)["line"] == 3


def _record(tmp_path: Path) -> Path:
    survivor = {
        "name": "reference_trainer.commit.x_f__mutmut_3",
        "file": "reference_trainer/commit.py",
        "line": 87,
        "removed": ["    if a < b:"],
        "added": ["    if a <= b:"],
        "status": "survived",
    }
    measurements = {
        "tool": "mutmut==3.8.1",
        "generated": 900,
        "sampled": 3,
        "seconds": 12.0,
        "by_package": summarize(
            {
                "reference_trainer.commit.x_f__mutmut_1": "killed",
                "reference_trainer.commit.x_f__mutmut_2": "killed",
                survivor["name"]: "survived",
            }
        ),
        "survivors": [survivor],
    }
    record = make_record(
        "mutation-score",
        config={"seed": 0, "tests": ["tests/unit"]},
        checks={"mutmut ran to the end": True, "every sampled mutant was checked": True},
        measurements=measurements,
    )
    return write_once(tmp_path / "evidence" / "mutation-score-1.json", record)


def test_the_report_shows_the_score_and_names_each_survivor(tmp_path: Path) -> None:
    _record(tmp_path)
    page = render_report(tmp_path / "evidence").markdown.read_text()
    assert "Mutation score" in page and "mutation score reference_trainer 67% (2/3)" in page
    assert "reference_trainer/commit.py:87" in page and "if a <= b:" in page
    assert "reference_trainer.commit.x_f__mutmut_3" in page


@pytest.mark.skipif(
    importlib.util.find_spec("mutmut") is None,
    reason="needs the mutation extra (pip install -e '.[mutation]'; not beside the ci extra)",
)
def test_a_real_mutmut_run_on_a_toy_package_finds_its_two_survivors(tmp_path: Path) -> None:
    root = _toy(tmp_path / "toy")
    config = MutationConfig(
        paths=("toypkg",), tests=("tests",), sample=None, budget_s=120, max_children=1, python=sys.executable
    )
    record = verify(run_mutation_score(root, tmp_path / "out", config))
    m = record["measurements"]
    assert record["passed"] and m["sampled"] == m["generated"] == 4
    assert m["by_package"]["toypkg"]["counts"] == {"killed": 2, "survived": 2}  # `<` and `>` at their bounds
    assert sorted((s["file"], s["line"]) for s in m["survivors"]) == [("toypkg/calc.py", 2), ("toypkg/calc.py", 4)]
    assert not (root / "mutants").exists(), "mutmut ran in the checkout, not in its scratch copy"
