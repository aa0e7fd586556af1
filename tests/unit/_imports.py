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
