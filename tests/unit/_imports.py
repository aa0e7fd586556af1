"""Shared by the import-boundary tests of the pure packages."""

from __future__ import annotations

import ast


def imported_top_level_names(source: str) -> tuple[set[str], list[int]]:
    """Absolute top-level module names imported by ``source``, and the levels of relative imports."""
    names: set[str] = set()
    relative_levels: list[int] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                relative_levels.append(node.level)
            elif node.module is not None:
                names.add(node.module.split(".")[0])
    return names, relative_levels


def imported_modules(source: str) -> list[tuple[str, tuple[str, ...]]]:
    """Each absolute import of ``source`` as (module, names): ``import a.b`` gives ("a.b", ()),
    ``from a.b import c, d`` gives ("a.b", ("c", "d"))."""
    found: list[tuple[str, tuple[str, ...]]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module is not None:
            found.append((node.module, tuple(alias.name for alias in node.names)))
    return found


def attributes_of(source: str, name: str) -> set[str]:
    """Attributes read from the module-level name ``name`` (``exgrpo_trainer.run_training`` gives
    "run_training")."""
    return {
        node.attr
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == name
    }
