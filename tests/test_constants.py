"""Each constant of the harness in one place: no literal string or Path is assigned to a constant in two modules.

A constant (an UPPER_CASE module-level name) whose value is a string, a tuple
of strings or a ``Path("...")`` literal names a concept: a second module
assigning the same value keeps a copy that can drift. It imports the one
definition instead (``validation.evidence.DEFAULT_OUT``, ``reports.kinds.RECEIPT_KIND``).
:data:`KNOWN` lists the copies other work removes, each with where it goes.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ("validation", "canaries", "reports", "ci")
KNOWN = {
    repr("quick"): "the run's profile and the mutation suite's: one RUN_PROFILE",
    repr("policy"): "the canaries' checkpoint name: one constant, shared by the canaries' folders",
}


def _literal(value: ast.expr) -> object:
    """The constant's value if it names something (str, tuple of str, Path literal), else None."""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "Path":
        return (
            ("Path", *(ast.literal_eval(a) for a in value.args))
            if all(isinstance(a, ast.Constant) for a in value.args)
            else None
        )
    try:
        literal = ast.literal_eval(value)
    except ValueError:
        return None
    named = isinstance(literal, str) or (
        isinstance(literal, tuple) and literal and all(isinstance(x, str) for x in literal)
    )
    return literal if named else None


def repeated_constants(root: Path, packages: tuple[str, ...] = HARNESS) -> dict[str, list[str]]:
    """repr(value) -> ``module:NAME`` for every such value assigned to constants in two or more modules."""
    found: dict[str, list[str]] = defaultdict(list)
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    name, value = node.targets[0].id, _literal(node.value)
                    if name.isupper() and value is not None:
                        found[repr(value)].append(f"{path.relative_to(root).with_suffix('')}:{name}")
    return {value: where for value, where in found.items() if len({w.split(":")[0] for w in where}) > 1}


def test_no_constant_is_declared_in_two_harness_modules() -> None:
    repeated = {value: where for value, where in repeated_constants(ROOT).items() if value not in KNOWN}
    assert repeated == {}, f"declare each once and import it: {repeated}"


def test_negative_control_a_copied_constant_is_reported(tmp_path: Path) -> None:
    for relative, text in {
        "ci/a.py": 'from pathlib import Path\nOUT = Path("rtv-out")\nKIND = "gpu-receipt"\nN = 3\n',
        "reports/b.py": 'from pathlib import Path\nDEFAULT = Path("rtv-out")\nN = 3\n',
        "reports/c.py": 'KIND = "gpu-receipt"\n',
        "validation/d.py": 'kind = "gpu-receipt"\n',
    }.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    assert repeated_constants(tmp_path, ("ci", "reports", "validation")) == {
        repr(("Path", "rtv-out")): ["ci/a:OUT", "reports/b:DEFAULT"],
        repr("gpu-receipt"): ["ci/a:KIND", "reports/c:KIND"],
    }
