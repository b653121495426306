"""The package's layers, and the bounds that keep its rooms small.

Imports point one way, down this list (a package may import itself and any package above it in
the list, never one below or beside it):

    errors -> core -> model -> policies -> backends -> managers -> transfer -> config
      -> embed | observability -> replay | integrations -> cli | testing

Read from the source, so an import inside a function that dodges a cycle cannot hide.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tiering"

# Each layer: the packages (or top-level modules) in it. Peers in one layer do not import each
# other.
LAYERS: list[tuple[str, ...]] = [
    ("errors",),
    ("core",),
    ("model",),
    ("policies",),
    ("backends",),
    ("managers",),
    ("transfer",),
    ("config",),
    ("embed", "observability"),
    ("replay", "integrations"),
    ("cli", "testing"),
]
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400
MAX_TOP_LEVEL_MODULES = 6


def _unit(module: str) -> str:
    """The layer unit of a dotted ``tiering`` module: its first name under ``tiering``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _unit_of_file(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 else rel.stem


def _rank(unit: str) -> float:
    if unit == "":
        # ``from tiering import X``: the public API, whose names come from every layer up to the
        # configuration. Only what sits above the configuration may use it.
        return _rank("config") + 0.5
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def _imports(path: Path, *, inside_functions: bool) -> list[tuple[int, str]]:
    """``(line, module)`` of the imports of tiering modules in ``path``."""
    tree = ast.parse(path.read_text())
    scopes: list[ast.AST] = [tree]
    if inside_functions:
        scopes = [
            n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        ]
    found = []
    for scope in scopes:
        nodes = ast.walk(scope)
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            found += [(node.lineno, name) for name in names if name.split(".")[0] == "tiering"]
    return found


def _module_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _layered_files() -> list[Path]:
    # The package's own __init__ re-exports (lazily) from every layer: it is the roof, not a room.
    return [path for path in _module_files() if path != PACKAGE / "__init__.py"]


def test_every_module_is_in_a_layer() -> None:
    units = {_unit_of_file(path) for path in _layered_files()}
    assert sorted(u for u in units if not any(u in layer for layer in LAYERS)) == []


def test_imports_point_down_the_layers() -> None:
    upward = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {module}"
        for path in _layered_files()
        for line, module in _imports(path, inside_functions=False)
        if _unit(module) != _unit_of_file(path)
        and _rank(_unit(module)) >= _rank(_unit_of_file(path))
    ]
    assert upward == []


def test_no_late_imports_of_tiering_modules() -> None:
    """A function-level import of a tiering module is a cycle being dodged."""
    late = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {module}"
        for path in _layered_files()
        for line, module in _imports(path, inside_functions=True)
    ]
    assert late == []


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        # The settings rules know no backend; the backends take their types from them.
        (
            "backends/settings.py",
            ("tiering.backends.file", "tiering.backends.lmdb", "tiering.backends.memory"),
        ),
        # The policy registry knows no backend, nor the backend registry.
        ("policies/registry.py", ("tiering.backends",)),
    ],
)
def test_lower_modules_of_a_layer_do_not_import_higher_ones(
    module: str, forbidden: tuple[str, ...]
) -> None:
    imported = [name for _, name in _imports(PACKAGE / module, inside_functions=False)]
    assert [name for name in imported if name.startswith(forbidden)] == []


def test_the_layer_check_sees_an_upward_import() -> None:
    """The checker itself: a core module importing a manager is reported."""
    assert _rank(_unit("tiering.managers.pool")) > _rank(_unit_of_file(PACKAGE / "core/keys.py"))
    assert _rank(_unit("tiering.errors")) < _rank(_unit_of_file(PACKAGE / "embed.py"))


def test_at_most_six_modules_at_the_top_of_the_package() -> None:
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_no_module_over_600_lines() -> None:
    long = {
        str(path.relative_to(PACKAGE.parent)): n
        for path in _module_files()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_no_class_over_400_lines() -> None:
    long = {
        f"{path.relative_to(PACKAGE.parent)}:{node.name}": n
        for path in _module_files()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
        and (n := (node.end_lineno or node.lineno) - node.lineno + 1) > MAX_CLASS_LINES
    }
    assert long == {}


@pytest.mark.parametrize("module", ["tiering", "tiering.errors", "tiering.cli", "tiering.config"])
def test_importing_the_light_modules_imports_no_torch(module: str) -> None:
    """The CLI answers ``--version``, ``--help`` and ``config check`` without torch (about 2 s to
    import): the package's names load on first use."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_lazy_names_are_the_public_ones() -> None:
    import tiering

    assert sorted(tiering.__all__) == sorted([*tiering._EXPORTS, "__version__"])
    for name in tiering._EXPORTS:
        assert getattr(tiering, name).__name__ == name
