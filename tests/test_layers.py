"""Imports follow the layers: keys and layouts -> policies -> backends -> tiers and managers ->
config -> CLI. Read from the source, so a late import that dodges a cycle cannot hide."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tiering"


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
        nodes = ast.walk(scope) if inside_functions else ast.iter_child_nodes(scope)
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


def test_no_late_imports_of_tiering_modules() -> None:
    """A function-level import of a tiering module is a cycle being dodged. The one exception:
    the package's ``__getattr__`` offers ``tiering.load_config`` without importing the config
    layer (above the managers) on ``import tiering``."""
    late = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {module}"
        for path in _module_files()
        for line, module in _imports(path, inside_functions=True)
        if not (path == PACKAGE / "__init__.py" and module == "tiering.config")
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
        # Policies sit below the backends and their registry.
        ("policies/registry.py", ("tiering.registry", "tiering.backends")),
        ("plugin_loader.py", ("tiering.policies", "tiering.backends", "tiering.registry")),
    ],
)
def test_lower_layers_do_not_import_higher_ones(module: str, forbidden: tuple[str, ...]) -> None:
    imported = [name for _, name in _imports(PACKAGE / module, inside_functions=False)]
    assert [name for name in imported if name.startswith(forbidden)] == []
