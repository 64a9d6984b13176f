"""The shape of the code, checked: layering, private names, import cycles, module sizes (style.md).

:func:`violations` scans the five packages' sources (``ast`` only, nothing
is imported) and reports, per rule:

- ``layering``: a package imports one it never imports (:data:`NEVER_IMPORTS`):
  ``reference_trainer`` a harness package; ``ci`` ``canaries`` (the harness's
  top, the ``rtv`` command line in ``canaries``, drives ``ci``; a GPU job
  reaches the canaries through ``rtv run``); ``reports`` the trainer
  (it reads evidence files); ``validation`` ``canaries`` (the canaries build on
  it);
- ``climb``: a module of ``reference_trainer`` imports one of a higher layer
  (:data:`TRAINER_LAYERS`, lowest first: the core, every module outside
  ``ranks/``, ``peers.py`` and ``trainer.py`` included; the logical-rank
  runtime ``ranks/``, which drives a ``Trainer``; the package's boundary
  ``__init__``, which re-exports them all);
- ``ranks-boundary``: a module outside ``reference_trainer/ranks/`` imports a
  module inside it rather than its ``__init__``, the subpackage's public
  boundary (:data:`RANKS_INTERNALS_ALLOWED`: the mutation suite, which plants
  faults inside);
- ``rollout``: a module of the rollout engine ``reference_trainer/rollout/``
  imports a trainer module outside :data:`ROLLOUT_IMPORTS` (the model code,
  sampling, versions, errors and seams): the engine runs the trainer's model,
  never the trainer;
- ``private``: package code imports a private name (``_x``) from another
  module, by ``from m import _x`` or as ``m._x`` on an imported module
  (``reference_trainer.testing`` is the allowed hook; tests are not scanned);
- ``cycle``: modules that import each other, directly or through others
  (imports inside functions count: a lazy import is still a dependency);
- ``size``: a module longer than :data:`MAX_LINES` (``reference_trainer/trainer.py``:
  :data:`MAX_TRAINER_LINES`);
- ``callback``: a trainer module imports ``reference_trainer.trainer``. What a
  forward, backward, commit or step runs through never calls back into it; only
  the package's boundary (``__init__``) and the logical-rank runtime's entry
  points (``ranks/logical.py``, ``ranks/zero.py``), which drive a ``Trainer``,
  import it (:data:`TRAINER_CALLERS`); the runtime's parts (layout, tree,
  fibers, rounds, state, reduction, batches) never do;
- ``note``: a ``NOTE [Name]`` written in more than one file (a NOTE lives in
  one place; ``(continued)`` parts elsewhere count), or one referred to that
  no file writes. A NOTE is written where a line starts with it and goes on
  with nothing, ``:`` or ``(``; any other mention is a reference;
- ``canary-folder``: a module at the top of ``canaries/`` named for one canary's
  family (:data:`CANARY_PREFIXES`), or a registered canary (``canaries/registry.py``)
  whose module is not inside ``canaries/<name>/``: a canary and what only it uses
  live in its folder, the shared pieces beside them;
- ``defined-twice``: a public top-level class or UPPER_CASE constant defined in
  two harness modules (one name per concept; :data:`DEFINED_TWICE` lists the
  deliberate ones, each with why);
- ``homonym``: a harness module defines, at its top level, a name that a
  trainer module exports (its ``__all__``): one name, one meaning;
- ``is-number``: a condition spells out :data:`IS_NUMBER` (``isinstance(x,
  bool)`` and ``isinstance(x, (int, float))`` of the same ``x``) rather than
  calling it;
- ``resolve``: a canary's own module (inside ``canaries/<name>/``) imports a
  way to resolve a preset (:data:`RESOLVERS`: ``canaries.presets``'
  ``preset`` or ``PRESETS``, the module itself, ``canaries.request.canary_run``):
  the spine (the modules at the top of ``canaries/``) resolves the preset once
  and every canary reads ``run.preset`` (``canaries.request.CanaryRun``).

Apart from those rules, ``one-builder``: a trainer with one ``policy``
checkpoint is built by ``validation.trainers.trainer_with_policy`` alone; a
function in ``canaries/``, ``validation/`` or ``tests/`` that calls ``Trainer(``
and ``add_checkpoint("policy", ...)`` is a copy (:data:`BUILDER_EXEMPT` lists
the few that must build by hand), with its own negative control.

A permanent negative control feeds it a small fake package tree that breaks
every rule and expects each violation to be reported; the import rules,
``resolve`` and ``homonym`` are also run over the real tree with one planted
import or definition, which each must report.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("reference_trainer", "validation", "canaries", "reports", "ci")
TRAINER = "reference_trainer"
HARNESS = ("validation", "canaries", "reports", "ci")
NEVER_IMPORTS = {  # package -> the packages it never imports
    TRAINER: HARNESS,
    "ci": ("canaries",),
    "reports": (TRAINER,),
    "validation": ("canaries",),
}
RANKS = f"{TRAINER}.ranks"
TRAINER_LAYERS = ("core", "ranks", "boundary")  # lowest first; a trainer module imports its own layer or lower
RANKS_INTERNALS_ALLOWED = {  # module prefix -> why it may import a module inside ranks/
    "canaries.mutations": "the mutation suite plants its faults inside the logical ranks (LogicalSums, TreeFold)",
}
ROLLOUT = f"{TRAINER}.rollout"
ROLLOUT_IMPORTS = tuple(
    f"{TRAINER}.{m}" for m in ("model", "lora", "sampling", "checkpoints", "errors", "seams", "host_reads")
)
PRIVATE_ALLOWED = ("reference_trainer.testing",)
IS_NUMBER = f"{TRAINER}.errors.is_number"  # the one test for "an int or a float, not a bool"
MAX_LINES = 450
MAX_TRAINER_LINES = 420
TRAINER_CALLERS = (TRAINER, f"{RANKS}.logical", f"{RANKS}.zero")  # the boundary and the runtime's entry points
CANARY_PREFIXES = ("derivative_", "memory_", "learning_", "bench_", "oracle_", "mutation_")
DEFINED_TWICE = {  # name -> why each module keeps its own
    "KIND": "each record writer's evidence kind, read as ``module.KIND`` (a different value in each)",
    "SCENARIOS": "each canary's own scenario table (derivative, memory), read through its folder's module",
    "LR": "two learning rates with opposite reasons: large for the derivative oracle, small for benchmark stability",
    "VERDICTS": "two verdict vocabularies: paired equivalence (validation.equivalence) and timing (validation.stats)",
}
RESOLVERS = {  # module -> the names a canary's own module never imports from it (None: the module itself)
    "canaries.presets": (None, "preset", "PRESETS"),
    "canaries.request": ("canary_run",),
}
_NOTE = re.compile(r"NOTE \[([^\]]+)\]")
_NOTE_WRITTEN = re.compile(r"^\s*#?\s*NOTE \[([^\]]+)\]\s*(?:$|:|\()")


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


@dataclass(frozen=True)
class Violation:
    rule: str  # layering | climb | ranks-boundary | rollout | private | cycle | size | callback | note | canary-folder
    # | defined-twice | homonym | is-number | resolve
    module: str
    detail: str


def _modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``packages`` under ``root`` (a package is its ``__init__``)."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str | None]]:
    """(imported module, imported name or None) for every import in the module, resolved to absolute names."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.append((submodule, None) if submodule in modules else (base, alias.name))
    return found


def _owner(target: str, modules: dict[str, Path]) -> str | None:
    """The scanned module ``target`` names (or lives in), if any."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


@functools.cache
def _edges(root: Path, packages: tuple[str, ...]) -> tuple[tuple[str, str, str | None], ...]:
    """Every import as (module, the scanned module it names or else the dotted name written, the name or None)."""
    modules = _modules(root, packages)
    return tuple(
        (name, _owner(target, modules) or target, imported)
        for name, path in modules.items()
        for target, imported in _imports(name, path, modules)
    )


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def _layer(module: str) -> int | None:
    """A trainer module's index in :data:`TRAINER_LAYERS`; ``None`` outside the trainer."""
    if not _inside(module, TRAINER):
        return None
    return 2 if module == TRAINER else 1 if _inside(module, RANKS) else 0


def _import_rules(edges: tuple[tuple[str, str], ...]) -> list[Violation]:
    """``layering``, ``climb``, ``ranks-boundary`` and ``callback`` over ``(module, imported module)`` pairs."""
    found = []
    for name, target in edges:
        package = name.split(".")[0]
        if target.split(".")[0] in NEVER_IMPORTS.get(package, ()):
            found.append(
                Violation(
                    "layering", name, f"imports {target}: {package} never imports {', '.join(NEVER_IMPORTS[package])}"
                )
            )
        here, there = _layer(name), _layer(target)
        if here is not None and there is not None and there > here:
            found.append(
                Violation(
                    "climb",
                    name,
                    f"imports {target}: the {TRAINER_LAYERS[here]} never imports "
                    f"the {TRAINER_LAYERS[there]} above it (TRAINER_LAYERS)",
                )
            )
        internal = _inside(target, RANKS) and target != RANKS and not _inside(name, RANKS)
        if internal and not any(_inside(name, allowed) for allowed in RANKS_INTERNALS_ALLOWED):
            found.append(
                Violation(
                    "ranks-boundary",
                    name,
                    f"imports {target}: import it from {RANKS}, the subpackage's public boundary",
                )
            )
        if (
            _inside(name, ROLLOUT)
            and _inside(target, TRAINER)
            and not _inside(target, ROLLOUT)
            and target not in ROLLOUT_IMPORTS
        ):
            found.append(
                Violation(
                    "rollout",
                    name,
                    f"imports {target}: the rollout engine imports only {', '.join(ROLLOUT_IMPORTS)} of the trainer",
                )
            )
        if target == f"{TRAINER}.trainer" and package == TRAINER and name not in TRAINER_CALLERS:
            found.append(
                Violation(
                    "callback", name, "imports reference_trainer.trainer: the trainer's parts never call back into it"
                )
            )
    return found


def _private_attributes(path: Path, aliases: dict[str, str]) -> list[tuple[str, str]]:
    """``m._x`` where ``m`` is a name bound to an imported scanned module: (module, attribute)."""
    found = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append((aliases[node.value.id], node.attr))
    return found


def _module_aliases(path: Path, name: str, modules: dict[str, Path]) -> dict[str, str]:
    aliases = {}
    submodules = {
        target.rpartition(".")[2]: target
        for target, imported in _imports(name, path, modules)
        if imported is None and target in modules
    }  # once: each ImportFrom below binds the same names
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            aliases.update(submodules)
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and not node.level:
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                if target in modules:
                    aliases[alias.asname or alias.name] = target
    return aliases


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _notes(root: Path, modules: dict[str, Path]) -> list[Violation]:
    """The ``note`` rule over the modules' sources, plus references in ``root``'s README and tests."""
    written: dict[str, set[str]] = {}
    mentioned: dict[str, str] = {}
    tests = [p for p in (root / "tests").rglob("*.py") if p.name != Path(__file__).name]  # not its own examples
    readers = [*modules.items(), *((str(p.relative_to(root)), p) for p in tests)]
    if (root / "README.md").exists():
        readers.append(("README.md", root / "README.md"))
    for name, path in readers:
        for line in path.read_text().splitlines():
            match = _NOTE_WRITTEN.match(line)
            if match and name in modules:
                written.setdefault(match.group(1), set()).add(name)
            for mention in _NOTE.findall(line):
                mentioned.setdefault(mention, name)
    found = [
        Violation("note", module, f"NOTE [{note}] is written in {sorted(where)}")
        for note, where in written.items()
        if len(where) > 1
        for module in sorted(where)
    ]
    found += [
        Violation("note", where, f"refers to NOTE [{note}], which no file writes")
        for note, where in mentioned.items()
        if note not in written
    ]
    return found


def _canary_folders(root: Path, modules: dict[str, Path]) -> list[Violation]:
    """The ``canary-folder`` rule: prefix families at the top of ``canaries/``, registered canaries outside their folder."""
    found = [
        Violation("canary-folder", name, "a canary's own module: move it into its folder canaries/<name>/")
        for name in modules
        if name.count(".") == 1 and name.startswith("canaries.") and name.split(".")[1].startswith(CANARY_PREFIXES)
    ]
    registry = modules.get("canaries.registry")
    for node in ast.walk(_tree(registry)) if registry else ():
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Canary":
            given = {k.arg: k.value.value for k in node.keywords if isinstance(k.value, ast.Constant)}
            if not given.get("module", "").startswith(f"canaries.{given.get('name')}."):
                found.append(
                    Violation(
                        "canary-folder",
                        given.get("module", "?"),
                        f"registered canary {given.get('name')!r} lives outside canaries/{given.get('name')}/",
                    )
                )
    return found


def _resolutions(edges: tuple[tuple[str, str, str | None], ...]) -> list[Violation]:
    """The ``resolve`` rule over ``(module, imported module, imported name or None)`` edges."""
    return [
        Violation(
            "resolve",
            name,
            f"imports {owner}{'.' + imported if imported else ''}: a canary reads "
            "run.preset (canaries.request.CanaryRun); the spine resolves it once",
        )
        for name, owner, imported in edges
        if name.startswith("canaries.") and name.count(".") >= 2 and imported in RESOLVERS.get(owner, ())
    ]


def _defined_twice(modules: dict[str, Path]) -> list[Violation]:
    """The ``defined-twice`` rule over the harness's modules (classes and UPPER_CASE constants at module level)."""
    where: dict[str, list[str]] = {}
    for name, path in modules.items():
        if name.split(".")[0] not in HARNESS:
            continue
        for node in _tree(path).body:
            targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
            names = (
                [node.name] if isinstance(node, ast.ClassDef) else [t.id for t in targets if isinstance(t, ast.Name)]
            )
            for defined in names:
                public_class = isinstance(node, ast.ClassDef) and not defined.startswith("_")
                if (
                    public_class or (defined.isupper() and not defined.startswith("_"))
                ) and defined not in DEFINED_TWICE:
                    where.setdefault(defined, []).append(name)
    return [
        Violation("defined-twice", module, f"{defined} is also defined in {sorted(set(found) - {module})}")
        for defined, found in where.items()
        if len(set(found)) > 1
        for module in sorted(set(found))
    ]


def _exports(modules: dict[str, Path]) -> dict[str, str]:
    """Name -> a trainer module whose ``__all__`` lists it (the package's boundary where it does)."""
    found: dict[str, str] = {}
    for name, path in sorted(modules.items(), reverse=True):
        for node in _tree(path).body if _inside(name, TRAINER) else ():
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                found.update({e.value: name for e in getattr(node.value, "elts", ()) if isinstance(e, ast.Constant)})
    return found


def _definitions(modules: dict[str, Path]) -> list[tuple[str, str]]:
    """(harness module, public name) for every function, class and assignment at a harness module's top level."""
    found = []
    for name, path in modules.items():
        for node in _tree(path).body if name.split(".")[0] in HARNESS else ():
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.append((name, node.name))
            targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
            for target in targets:
                found += [(name, n.id) for n in ast.walk(target) if isinstance(n, ast.Name)]
    return [(module, defined) for module, defined in found if not defined.startswith("_")]


def _homonyms(exports: dict[str, str], definitions: list[tuple[str, str]]) -> list[Violation]:
    """The ``homonym`` rule: a harness definition of a name a trainer module exports."""
    return [
        Violation(
            "homonym",
            module,
            f"defines {defined}, which {exports[defined]} exports: one name, one "
            "meaning; give the harness's its own name",
        )
        for module, defined in definitions
        if defined in exports
    ]


def _number_checks(modules: dict[str, Path]) -> list[Violation]:
    """The ``is-number`` rule: a boolean condition testing one subject for ``bool`` and for ``(int, float)``."""
    found = []
    for name, path in modules.items():
        if name == IS_NUMBER.rpartition(".")[0]:
            continue
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.BoolOp):
                continue
            kinds: dict[str, set[str]] = {}
            for call in ast.walk(node):
                if (
                    isinstance(call, ast.Call)
                    and getattr(call.func, "id", None) == "isinstance"
                    and len(call.args) == 2
                ):
                    kinds.setdefault(ast.unparse(call.args[0]), set()).add(ast.unparse(call.args[1]))
            if any({"bool", "(int, float)"} <= found_kinds for found_kinds in kinds.values()):
                found.append(Violation("is-number", name, f"line {node.lineno} spells out {IS_NUMBER}: call it"))
    return found


def violations(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> list[Violation]:
    """Every violation of the fourteen rules in ``packages`` under ``root`` (see the module docstring)."""
    modules = _modules(root, packages)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    found: list[Violation] = []
    edges = _edges(root, packages)
    for name, owner, imported in edges:
        if owner not in modules:
            continue
        if owner != name:
            graph[name].add(owner)
        private = imported is not None and imported.startswith("_") and not imported.startswith("__")
        if private and owner != name and owner not in PRIVATE_ALLOWED:
            found.append(Violation("private", name, f"imports {imported} from {owner}"))
    for name, path in modules.items():
        lines = len(path.read_text().splitlines())
        limit = MAX_TRAINER_LINES if name == f"{TRAINER}.trainer" else MAX_LINES
        if lines > limit:
            found.append(Violation("size", name, f"{lines} lines, at most {limit}"))
        for owner, attribute in _private_attributes(path, _module_aliases(path, name, modules)):
            if owner != name and owner not in PRIVATE_ALLOWED:
                found.append(Violation("private", name, f"uses {owner}.{attribute}"))
    for component in _cycles(graph):
        for member in component:
            found.append(Violation("cycle", member, " <-> ".join(component)))
    found += _import_rules(tuple((name, owner) for name, owner, _ in edges))
    found += _homonyms(_exports(modules), _definitions(modules)) + _number_checks(modules) + _resolutions(edges)
    return found + _notes(root, modules) + _canary_folders(root, modules) + _defined_twice(modules)


@functools.lru_cache(maxsize=1)
def _current() -> tuple[Violation, ...]:
    return tuple(violations())


def _in(package: str, rule: str) -> list[Violation]:
    return [v for v in _current() if v.rule == rule and v.module.split(".")[0] == package]


def _params(rule_packages: tuple[str, ...]) -> list:
    return list(rule_packages)


def test_the_trainer_imports_nothing_of_the_harness() -> None:
    assert _in(TRAINER, "layering") == []


def test_ci_imports_nothing_of_canaries() -> None:
    """The one run path lives in ``canaries``; ``ci`` reaches it through the command line (``rtv run --preset gpu``)."""
    assert _in("ci", "layering") == []


def test_reports_import_nothing_of_the_trainer() -> None:
    assert _in("reports", "layering") == []


def test_validation_imports_nothing_of_canaries() -> None:
    assert _in("validation", "layering") == []


def test_no_import_climbs_a_layer_of_the_trainer() -> None:
    """Core, then ``ranks/``, then the boundary (:data:`TRAINER_LAYERS`): ``resume.py`` reaches ``peers.py`` below it."""
    assert _in(TRAINER, "climb") == []


@pytest.mark.parametrize("package", _params(PACKAGES))
def test_everything_outside_ranks_uses_it_through_its_boundary(package: str) -> None:
    assert _in(package, "ranks-boundary") == []


@pytest.mark.parametrize("package", _params(HARNESS))
def test_no_harness_module_redefines_a_name_the_trainer_exports(package: str) -> None:
    assert _in(package, "homonym") == []


@pytest.mark.parametrize("package", _params(PACKAGES))
def test_every_number_check_calls_the_one_is_number(package: str) -> None:
    assert _in(package, "is-number") == []


@pytest.mark.parametrize("package", _params(PACKAGES))
def test_no_private_name_is_imported_across_modules(package: str) -> None:
    assert _in(package, "private") == []


@pytest.mark.parametrize("package", _params(PACKAGES))
def test_no_modules_import_each_other_in_a_cycle(package: str) -> None:
    assert _in(package, "cycle") == []


@pytest.mark.parametrize("package", _params(PACKAGES))
def test_every_module_stays_within_its_size(package: str) -> None:
    assert _in(package, "size") == []


def test_the_rollout_engine_imports_the_model_code_never_the_trainer() -> None:
    assert _in(TRAINER, "rollout") == []


def test_no_part_of_the_trainer_calls_back_into_trainer_py() -> None:
    assert _in(TRAINER, "callback") == []


def test_each_note_is_written_in_one_file_and_every_reference_has_one() -> None:
    assert [v for v in _current() if v.rule == "note"] == []


def test_each_canary_and_what_only_it_uses_live_in_its_folder() -> None:
    assert _in("canaries", "canary-folder") == []


@pytest.mark.parametrize("package", _params(HARNESS))
def test_no_class_or_constant_name_is_defined_in_two_harness_modules(package: str) -> None:
    assert _in(package, "defined-twice") == []


def _write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_negative_control_a_fake_tree_breaking_every_rule_is_reported(tmp_path: Path) -> None:
    _write(tmp_path, "reference_trainer/__init__.py", "")
    _write(tmp_path, "reference_trainer/core.py", "import validation.a\n")  # layering
    _write(tmp_path, "reference_trainer/trainer.py", "x = 1\n" * (MAX_TRAINER_LINES + 1))  # size (trainer)
    _write(tmp_path, "reference_trainer/testing.py", "_hook = 1\n")
    _write(tmp_path, "validation/__init__.py", "")
    _write(tmp_path, "validation/a.py", "from .b import _secret\n")  # private, and a -> b
    _write(tmp_path, "validation/b.py", "_secret = 1\n\ndef f():\n    from validation import a\n")  # b -> a: cycle
    _write(tmp_path, "validation/c.py", "from reference_trainer import core\nx = core._hidden\n")  # private attribute
    _write(tmp_path, "validation/d.py", "from reference_trainer.testing import _hook\n")  # allowed
    _write(tmp_path, "validation/big.py", "x = 1\n" * (MAX_LINES + 1))  # size
    _write(tmp_path, "reference_trainer/commit.py", '"""NOTE [Commit]\n"""\nfrom . import trainer\n')  # callback
    _write(tmp_path, "reference_trainer/ranks/logical.py", "from ..trainer import x\n")  # allowed: drives a trainer
    _write(tmp_path, "validation/e.py", '"""NOTE [Commit] (continued)\n\nSee NOTE [Nowhere]."""\n')  # note x2

    _write(tmp_path, "canaries/__init__.py", "")
    _write(tmp_path, "canaries/oracle_pair.py", "class Arm:\n    pass\n")  # canary-folder; defined-twice (Arm)
    _write(tmp_path, "canaries/learning/arms.py", "class Arm:\n    pass\nKIND = 'a'\n")  # KIND: allowed twice
    _write(tmp_path, "canaries/derivative/canary.py", "KIND = 'b'\nPLACEMENTS = ('retain',)\n")
    _write(tmp_path, "validation/f.py", "PLACEMENTS: tuple = ('retain',)\n_PRIVATE = 1\n")  # defined-twice; private ok
    _write(tmp_path, "validation/g.py", "_PRIVATE = 2\n")
    _write(tmp_path, "ci/__init__.py", "")
    _write(tmp_path, "ci/run.py", "def f():\n    from canaries.suite import run\n")  # layering: ci -> canaries
    _write(tmp_path, "canaries/suite.py", "from ci import cli\n")  # allowed: canaries drives ci
    _write(tmp_path, "ci/cli.py", "")
    _write(
        tmp_path,
        "canaries/registry.py",
        "Canary(name='derivative', module='canaries.derivative.canary')\n"
        "Canary(name='memory', module='canaries.memory_canary')\n",
    )  # canary-folder
    _write(tmp_path, "canaries/presets.py", "def preset(name):\n    return name\n")
    _write(
        tmp_path,
        "canaries/request.py",
        "from .presets import preset\n\ndef canary_run(name):\n    return preset(name)\n",
    )  # allowed: the spine resolves
    _write(tmp_path, "canaries/rollout/canary.py", "from ..presets import preset\n")  # resolve: by name
    _write(tmp_path, "canaries/planner/canary.py", "from .. import presets\n")  # resolve: the module
    _write(tmp_path, "canaries/liveness/canary.py", "from canaries.request import canary_run\n")  # resolve
    _write(tmp_path, "canaries/memory/canary.py", "from ..presets import Preset\nfrom ..request import CanaryRun\n")

    found = {(v.rule, v.module) for v in violations(tmp_path, ("reference_trainer", "validation", "canaries", "ci"))}

    assert found == {
        ("layering", "reference_trainer.core"),
        ("layering", "ci.run"),
        ("size", "reference_trainer.trainer"),
        ("private", "validation.a"),
        ("private", "validation.c"),
        ("cycle", "validation.a"),
        ("cycle", "validation.b"),
        ("size", "validation.big"),
        ("callback", "reference_trainer.commit"),
        ("note", "reference_trainer.commit"),
        ("note", "validation.e"),
        ("canary-folder", "canaries.oracle_pair"),
        ("canary-folder", "canaries.memory_canary"),
        ("defined-twice", "canaries.oracle_pair"),
        ("defined-twice", "canaries.learning.arms"),
        ("defined-twice", "canaries.derivative.canary"),
        ("defined-twice", "validation.f"),
        ("resolve", "canaries.rollout.canary"),
        ("resolve", "canaries.planner.canary"),
        ("resolve", "canaries.liveness.canary"),
    }


def test_negative_control_a_fake_tree_breaking_the_layer_rules_is_reported(tmp_path: Path) -> None:
    _write(tmp_path, "reference_trainer/__init__.py", "from .ranks import run_logical\n")  # allowed: the boundary
    _write(tmp_path, "reference_trainer/trainer.py", "from . import peers\n")  # allowed: the core, same layer
    _write(tmp_path, "reference_trainer/peers.py", "")
    _write(tmp_path, "reference_trainer/resume.py", "from .ranks.peers import PeerFailure\n")  # climb; ranks-boundary
    _write(tmp_path, "reference_trainer/sinks.py", "from .ranks import spread\n")  # climb: core -> ranks
    _write(tmp_path, "reference_trainer/checkpoints.py", "__all__ = ['BASE']\nBASE = object()\n")
    _write(tmp_path, "reference_trainer/ranks/__init__.py", "from .tree import fold\nfrom ..peers import Comm\n")
    _write(tmp_path, "reference_trainer/ranks/peers.py", "")
    _write(tmp_path, "reference_trainer/ranks/zero.py", "from ..trainer import Trainer\n")  # allowed: an entry point
    _write(tmp_path, "reference_trainer/ranks/tree.py", "from ..trainer import Trainer\n")  # callback: a part
    _write(tmp_path, "reference_trainer/ranks/state.py", "from .. import Trainer\n")  # climb: ranks -> boundary
    _write(tmp_path, "validation/__init__.py", "")
    _write(tmp_path, "validation/world.py", "import canaries.cli\n")  # layering: validation -> canaries
    _write(tmp_path, "validation/oracle.py", "from reference_trainer.ranks.tree import fold\n")  # ranks-boundary
    _write(tmp_path, "validation/logical.py", "from reference_trainer.ranks import run_logical\n")  # allowed
    _write(tmp_path, "reports/__init__.py", "")
    _write(tmp_path, "reports/plots.py", "def f():\n    from reference_trainer import trainer\n")  # layering
    _write(tmp_path, "reports/records.py", "from validation import evidence\n")  # allowed
    _write(tmp_path, "canaries/__init__.py", "")
    _write(tmp_path, "canaries/cli.py", "")
    _write(tmp_path, "canaries/mutations/catalogue.py", "from reference_trainer.ranks.tree import fold\n")  # allowed
    _write(tmp_path, "canaries/benchmark/baseline.py", "BASE, HEAD = 'base', 'head'\n")  # homonym
    _write(
        tmp_path,
        "reference_trainer/errors.py",
        "def is_number(x):\n    return isinstance(x, (int, float)) and not isinstance(x, bool)\n",
    )
    _write(
        tmp_path,
        "reference_trainer/model.py",
        "def f(x):\n"  # is-number: a copy
        "    if isinstance(x, bool) or not isinstance(x, (int, float)):\n"
        "        raise ValueError(x)\n",
    )
    _write(
        tmp_path,
        "reports/generic.py",
        "def f(x, y):\n"  # allowed: two subjects, one test each
        "    return isinstance(x, bool) and isinstance(y, (int, float))\n",
    )

    found = {
        (v.rule, v.module) for v in violations(tmp_path, ("reference_trainer", "validation", "reports", "canaries"))
    }

    assert found == {
        ("climb", "reference_trainer.resume"),
        ("ranks-boundary", "reference_trainer.resume"),
        ("climb", "reference_trainer.sinks"),
        ("callback", "reference_trainer.ranks.tree"),
        ("climb", "reference_trainer.ranks.state"),
        ("layering", "validation.world"),
        ("ranks-boundary", "validation.oracle"),
        ("layering", "reports.plots"),
        ("homonym", "canaries.benchmark.baseline"),
        ("is-number", "reference_trainer.model"),
    }


PLANTED_IMPORTS = {  # (module, the module it is made to import) -> the violations that must appear
    ("reference_trainer.resume", "reference_trainer.ranks"): {("climb", "reference_trainer.resume")},
    ("reference_trainer.commit", "reference_trainer.ranks.state"): {
        ("climb", "reference_trainer.commit"),
        ("ranks-boundary", "reference_trainer.commit"),
    },
    ("reference_trainer.sinks", "reference_trainer"): {("climb", "reference_trainer.sinks")},
    ("reference_trainer.ranks.state", "reference_trainer"): {("climb", "reference_trainer.ranks.state")},
    ("reference_trainer.ranks.tree", "reference_trainer.trainer"): {("callback", "reference_trainer.ranks.tree")},
    ("reports.summary", "reference_trainer.checkpoints"): {("layering", "reports.summary")},
    ("reference_trainer.rollout.engine", "reference_trainer.records"): {
        ("rollout", "reference_trainer.rollout.engine")
    },
    ("reference_trainer.rollout.cache", "reference_trainer.trainer"): {
        ("rollout", "reference_trainer.rollout.cache"),
        ("callback", "reference_trainer.rollout.cache"),
    },
    ("validation.oracle", "canaries.registry"): {("layering", "validation.oracle")},
    ("canaries.derivative.scenarios", "reference_trainer.ranks.logical"): {
        ("ranks-boundary", "canaries.derivative.scenarios")
    },
}


@pytest.mark.parametrize("planted", list(PLANTED_IMPORTS), ids=" -> ".join)
def test_an_import_planted_in_the_real_tree_is_reported(planted: tuple[str, str]) -> None:
    real = tuple((name, owner) for name, owner, _ in _edges(ROOT, PACKAGES))
    assert set(planted) <= {name for edge in real for name in edge}, "plant between modules the tree has"
    assert _import_rules(real) == []
    assert {(v.rule, v.module) for v in _import_rules((*real, planted))} == PLANTED_IMPORTS[planted]


@pytest.mark.parametrize(
    "planted",
    [
        ("canaries.benchmark.baseline", "BASE"),
        ("validation.reference", "pad_sequences"),
        ("validation.oracle_state", "check_age"),
        ("ci.frames", "MANIFEST"),
    ],
    ids=" defines ".join,
)
def test_a_definition_planted_in_the_real_tree_is_reported(planted: tuple[str, str]) -> None:
    modules = _modules(ROOT, PACKAGES)
    real = _definitions(modules)
    assert _homonyms(_exports(modules), real) == []
    assert [(v.rule, v.module) for v in _homonyms(_exports(modules), [*real, planted])] == [("homonym", planted[0])]


# --- one builder: "a trainer with one policy checkpoint" is built by validation.trainers only ----------------

BUILDER = "validation/trainers.py"
BUILDER_SCANNED = ("canaries", "validation", "tests")  # examples/ teach the public API: they spell it out
BUILDER_EXEMPT = {  # "path::function" -> why it builds by hand
    "tests/unit/test_checkpoints.py::test_add_checkpoint_needs_exactly_one_of_lora_and_full": "tests add_checkpoint's own refusals",
    "tests/unit/test_admission.py::_trainer_in_census": "its census starts between the trainer and its checkpoint",
    "tests/unit/test_resume.py::_build": "builds a policy, a critic or both",
    "tests/validation/test_trainers.py::_by_hand": "the builder's oracle: the same trainer, built by hand",
}


def _policy_names(tree: ast.Module) -> set[str]:
    """Names that mean ``"policy"`` in a module: its constants of that value and ``POLICY`` imported from the builder."""
    names = (
        {"POLICY"}
        if any(
            isinstance(n, ast.ImportFrom)
            and n.module == "validation.trainers"
            and any(a.name == "POLICY" and a.asname is None for a in n.names)
            for n in tree.body
        )
        else set()
    )
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and node.value.value == "policy":
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _own_calls(scope: ast.AST) -> list[ast.Call]:
    """The calls in ``scope``'s own body (not in the functions or classes it defines)."""
    calls, stack = [], list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        calls += [node] if isinstance(node, ast.Call) else []
        stack.extend(ast.iter_child_nodes(node))
    return calls


def _builder_copies(root: Path, scanned: tuple[str, ...] = BUILDER_SCANNED) -> list[str]:
    """``path::function`` (``<module>`` for a module's body) of each scope outside :data:`BUILDER` that calls
    ``Trainer(`` and ``add_checkpoint`` of ``"policy"`` (a literal or a name for it, :func:`_policy_names`)."""
    found = []
    for path in sorted(p for folder in scanned for p in (root / folder).rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        text = path.read_text()
        if "Trainer(" not in text or "add_checkpoint(" not in text:
            continue  # cannot hold a copy: not worth parsing
        tree = _tree(path)
        policy = _policy_names(tree)
        scopes = [("<module>", tree)] + [
            (n.name, n) for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        for name, scope in scopes:
            called = {(_called_name(c), _first_argument(c, policy)) for c in _own_calls(scope)}
            if (
                relative != BUILDER
                and any(c == "Trainer" for c, _ in called)
                and ("add_checkpoint", "policy") in called
            ):
                found.append(f"{relative}::{name}")
    return found


def _called_name(call: ast.Call) -> str | None:
    return call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)


def _first_argument(call: ast.Call, policy: set[str]) -> str | None:
    """``"policy"`` when the call's first argument is that literal or a name for it; otherwise None."""
    first = call.args[0] if call.args else None
    literal = isinstance(first, ast.Constant) and first.value == "policy"
    return "policy" if literal or (isinstance(first, ast.Name) and first.id in policy) else None


def test_every_trainer_with_one_policy_checkpoint_comes_from_the_one_builder() -> None:
    """Canaries, validation and tests build it with ``validation.trainers.trainer_with_policy``; a copy of
    ``Trainer(...)`` then ``add_checkpoint("policy", ...)`` in one function elsewhere is refused
    (:data:`BUILDER_EXEMPT`: the few that must build by hand, each with why; a stale exemption fails too)."""
    assert sorted(_builder_copies(ROOT)) == sorted(BUILDER_EXEMPT)


def test_the_builder_rule_reports_each_kind_of_copy_and_nothing_else(tmp_path: Path) -> None:
    """Negative control: a fake tree with every kind of copy, and look-alikes that are not copies."""
    copy = "    trainer = rt.Trainer(model)\n    trainer.add_checkpoint({name}, full=True)\n"
    _write(tmp_path, "canaries/literal.py", "def build(model):\n" + copy.format(name='"policy"'))
    _write(
        tmp_path,
        "validation/constant.py",
        "NAME = 'policy'\nclass C:\n    def build(self, model):\n    "
        + copy.format(name="NAME").replace("\n    ", "\n        "),
    )
    _write(
        tmp_path,
        "tests/imported.py",
        "from validation.trainers import POLICY\ndef build(model):\n" + copy.format(name="POLICY"),
    )
    _write(tmp_path, "tests/top.py", copy.format(name='"policy"').replace("    ", ""))
    _write(
        tmp_path,
        "tests/bare.py",
        "from reference_trainer import Trainer\ndef build(model):\n"
        "    t = Trainer(model)\n    t.add_checkpoint('policy', full=True)\n",
    )
    _write(tmp_path, "tests/other_name.py", "def build(model):\n" + copy.format(name='"critic"'))
    _write(
        tmp_path,
        "tests/second.py",
        "def add(trainer):\n    trainer.add_checkpoint('policy', full=True)\n"
        "def load(path, model):\n    return rt.Trainer.load(path, model)\n",
    )
    _write(
        tmp_path,
        "tests/split.py",
        "def build(model):\n    trainer = rt.Trainer(model)\n"
        "    def add():\n        trainer.add_checkpoint('policy', full=True)\n",
    )
    _write(tmp_path, BUILDER, "def trainer_with_policy(model):\n" + copy.format(name='"policy"'))
    _write(tmp_path, "examples/example.py", "def build(model):\n" + copy.format(name='"policy"'))
    assert _builder_copies(tmp_path) == [
        "canaries/literal.py::build",
        "tests/bare.py::build",
        "tests/imported.py::build",
        "tests/top.py::<module>",
        "validation/constant.py::build",
    ]


@pytest.mark.parametrize(
    "planted",
    [
        ("canaries.rollout.canary", "canaries.presets", "preset"),
        ("canaries.planner.canary", "canaries.presets", None),
        ("canaries.derivative.canary", "canaries.presets", "PRESETS"),
        ("canaries.memory.canary", "canaries.request", "canary_run"),
    ],
    ids=lambda edge: " -> ".join(map(str, edge)),
)
def test_a_preset_resolved_in_a_canary_of_the_real_tree_is_reported(planted: tuple[str, str, str | None]) -> None:
    real = _edges(ROOT, PACKAGES)
    assert planted[0] in {name for name, _, _ in real}, "plant in a module the tree has"
    assert _resolutions(real) == []
    assert [(v.rule, v.module) for v in _resolutions((*real, planted))] == [("resolve", planted[0])]
