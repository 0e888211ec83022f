"""The package's layers, read from its imports with ast (every import, in functions too): a module imports
only from its own layer or the ones below; torch is imported at module level only where the arithmetic
is; only the CLI starts processes; no test scaffolding ships in the package. docs/layout.md states the
same order."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fp8conv"
# lowest first; a module's layer is its sub-package, or its own name for the top-level modules
LAYERS = [
    ("errors", "version", "dtypes", "threads", "records"),
    ("backends",),
    ("storage",),
    ("source",),
    ("model",),
    ("options",),
    ("plan",),
    ("output",),
    ("rewrite",),
    ("check",),
    ("run",),
    ("__init__",),
    ("cli",),
    ("__main__",),
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
# the modules whose work is the arithmetic (or reading tensors for it): torch at module level is theirs
TORCH_AT_MODULE_LEVEL = ("backends", "rewrite", "check", "run")
PROCESS_MODULES = ("subprocess", "multiprocessing")


def _modules(package: Path = PACKAGE) -> list[tuple[str, Path]]:
    found = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        found.append((".".join(parts), path))
    return found


def _layer(module: str) -> str:
    return module.split(".")[0]


def _imports(path: Path, module: str) -> list[tuple[str, int, bool]]:
    """(imported fp8conv module, line, at module level) for every import in the file."""
    tree = ast.parse(path.read_text())
    package = module.split(".")[:-1]  # a module's package; an __init__'s is its own
    top_level = {id(n) for n in tree.body} | {
        id(n) for stmt in tree.body if isinstance(stmt, (ast.If, ast.Try)) for n in ast.walk(stmt)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join([*base, *([node.module] if node.module else [])])
                names = [target] if node.module else [f"{target}.{a.name}".strip(".") for a in node.names]
                found += [("fp8conv." + n if n else "fp8conv", node.lineno, id(node) in top_level) for n in names]
            elif node.module:
                found.append((node.module, node.lineno, id(node) in top_level))
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno, id(node) in top_level) for a in node.names]
    return found


def _type_checking_only(path: Path) -> set[int]:
    """Lines of imports under `if TYPE_CHECKING:` (never run)."""
    lines = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            lines |= {n.lineno for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return lines


def test_every_module_has_a_layer() -> None:
    assert {_layer(m) for m, _ in _modules()} <= set(RANK), "a new top-level module or package needs its layer"


def upward_imports(package: Path) -> list[str]:
    upward = []
    for module, path in _modules(package):
        mine = RANK[_layer(module)]
        for target, line, _ in _imports(path, module):
            if not target.startswith("fp8conv.") or line in _type_checking_only(path):
                continue
            theirs = RANK[_layer(target.removeprefix("fp8conv."))]
            if theirs > mine:
                upward.append(f"{path.relative_to(package)}:{line} imports {target}")
    return upward


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    assert upward_imports(PACKAGE) == []


@pytest.mark.parametrize(
    ("source", "seen"),
    [
        ("from ..run.convert import convert\n", ["plan/conversion.py:1 imports fp8conv.run.convert"]),
        ("def f():\n    from ..cli import commands\n", ["plan/conversion.py:2 imports fp8conv.cli"]),
        ("from fp8conv.output import manifest\n", ["plan/conversion.py:1 imports fp8conv.output"]),
        ("from ..model import families\nfrom . import strategy\n", []),
    ],
)
def test_the_layer_check_sees_an_upward_import(tmp_path: Path, source: str, seen: list[str]) -> None:
    """The rule run over a package of one module: an import from above is named, in a function too."""
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "conversion.py").write_text(source)
    assert upward_imports(tmp_path) == seen


def test_torch_is_imported_at_module_level_only_where_the_arithmetic_is() -> None:
    found = []
    for module, path in _modules():
        if _layer(module) in TORCH_AT_MODULE_LEVEL:
            continue
        checking = _type_checking_only(path)
        for target, line, top in _imports(path, module):
            if top and line not in checking and (target == "torch" or target.startswith("torch.")):
                found.append(f"{path.relative_to(PACKAGE)}:{line}")
    assert found == []


def test_only_the_cli_starts_processes() -> None:
    found = []
    for module, path in _modules():
        if _layer(module) == "cli":
            continue
        for target, line, _ in _imports(path, module):
            if target.split(".")[0] in PROCESS_MODULES:
                found.append(f"{path.relative_to(PACKAGE)}:{line} imports {target}")
        if "os.fork(" in path.read_text() or "posix_spawn" in path.read_text():
            found.append(f"{path.relative_to(PACKAGE)} forks")
    assert found == []


def test_no_test_scaffolding_in_the_package() -> None:
    names = [n for m, p in _modules() for n in _class_names(p) if n.startswith(("Local", "Fake", "Mock", "Dummy"))]
    assert names == []


def _class_names(path: Path) -> list[str]:
    return [n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)]


def test_docs_layout_names_every_package_in_layer_order() -> None:
    text = (PACKAGE.parent / "docs" / "layout.md").read_text()
    assert len(text.splitlines()) < 80
    packages = [names[0] for names in LAYERS if (PACKAGE / names[0]).is_dir()]
    positions = [text.find(f"\n  {p}/ ") for p in packages]  # the tree, one package a line
    assert -1 not in positions, [p for p, at in zip(packages, positions, strict=True) if at == -1]
    assert positions == sorted(positions)


TESTS = Path(__file__).resolve().parent


def test_tests_mirror_the_packages_and_share_only_through_support() -> None:
    """Each test folder is a package of fp8conv (or support/); code shared between tests lives in
    tests/support, and no test module imports another test module."""
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders - {"support"} <= {names[0] for names in LAYERS} and "support" in folders
    loose = [p.name for p in TESTS.rglob("*.py") if not p.name.startswith(("test_", "__init__", "conftest"))]
    assert sorted(n for n in loose if not (TESTS / "support" / n).exists()) == []
    imports_tests = []
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[-1].startswith("test_"):
                imports_tests.append(f"{path.relative_to(TESTS)}:{node.lineno} imports {node.module}")
    assert imports_tests == []


def _private_uses(path: Path) -> list[str]:
    """fp8conv's private names a test takes: imported by name, or read off a module it imported."""
    tree = ast.parse(path.read_text())
    modules, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fp8conv"):
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"{path.name}:{node.lineno} imports {a.name}")
                elif (PACKAGE.joinpath(*node.module.split(".")[1:]) / f"{a.name}.py").exists():
                    modules.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name.startswith("fp8conv.") and a.asname}
    for node in ast.walk(tree):
        named = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
        if named and node.attr.startswith("_") and not node.attr.startswith("__"):
            found.append(f"{path.name}:{node.lineno} reads {node.value.id}.{node.attr}")
    return found


def test_no_test_takes_a_private_name_of_the_package() -> None:
    assert [u for path in TESTS.rglob("*.py") for u in _private_uses(path)] == []


def import_cycles(package: Path) -> list[list[str]]:
    """Modules that import one another round a circle, at module level or in a function (a lazy import
    that breaks a circle at run time still ties the two modules together); TYPE_CHECKING imports aside."""
    modules = {m for m, _ in _modules(package)}
    graph: dict[str, set[str]] = {}
    for module, path in _modules(package):
        checking = _type_checking_only(path)
        targets = set()
        for target, line, _ in _imports(path, module):
            name = target.removeprefix("fp8conv.")
            if not target.startswith("fp8conv.") or line in checking:
                continue
            while name and name not in modules:  # `from .x import f` names f: its module is x
                name = name.rpartition(".")[0]
            if name and name != module and not name.endswith("__init__"):
                targets.add(name)
        graph[module] = targets
    cycles, seen = [], set()
    for start in sorted(graph):  # each circle once: found from its smallest module
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    key = frozenset(path)
                    if key not in seen:
                        seen.add(key)
                        cycles.append(path)
                elif nxt > start and nxt not in path:
                    stack.append((nxt, [*path, nxt]))
    return cycles


def test_no_modules_import_each_other() -> None:
    assert import_cycles(PACKAGE) == []


def test_the_cycle_check_sees_a_lazy_circle(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "families.py").write_text("def f():\n    from .roles import rule\n")
    (tmp_path / "model" / "roles.py").write_text("from .families import f\n")
    (tmp_path / "model" / "other.py").write_text("from .families import f\n")
    assert import_cycles(tmp_path) == [["model.families", "model.roles"]]
