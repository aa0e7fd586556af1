"""The import graph of this repository's packages is the one docs/architecture.md ("Packages")
describes: dependencies point from the command line down to the SDK, and the services never
import each other. Imports inside functions count too (the CLI's lazy imports are edges)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from _imports import imported_top_level_names

ROOT = Path(__file__).resolve().parents[2]
ALLOWED: dict[str, set[str]] = {
    "exgrpo_client": set(),
    "exgrpo_pool": {"exgrpo_client"},
    "exgrpo_rollout": {"exgrpo_client"},
    "exgrpo_trainer": {"exgrpo_client", "exgrpo_rollout"},
    "exgrpo_onebox": {"exgrpo_client", "exgrpo_pool", "exgrpo_rollout", "exgrpo_trainer"},
    "exgrpo_cli": {"exgrpo_client", "exgrpo_pool", "exgrpo_rollout", "exgrpo_trainer", "exgrpo_onebox"},
}
"""Package -> the other packages of this repository it may import."""


def _package_dirs() -> dict[str, Path]:
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in setup["package-dir"].items()}


def imports_of(folder: Path, ours: set[str]) -> dict[str, set[str]]:
    """Our packages imported by the modules of `folder`: package -> its files that import it."""
    found: dict[str, set[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        names, _ = imported_top_level_names(path.read_text(encoding="utf-8"))
        for name in names & ours:
            found.setdefault(name, set()).add(path.relative_to(folder).as_posix())
    return found


def test_every_package_has_its_place_in_the_graph() -> None:
    assert set(_package_dirs()) <= set(ALLOWED), "add the new package to ALLOWED and to docs/architecture.md"


def test_packages_import_only_what_the_graph_allows() -> None:
    dirs = _package_dirs()
    ours = set(dirs)
    wrong = {}
    for name, folder in dirs.items():
        found = imports_of(folder, ours - {name})
        if extra := {dep: files for dep, files in found.items() if dep not in ALLOWED[name]}:
            wrong[name] = extra
    assert wrong == {}


def test_the_graph_has_no_cycles() -> None:
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"cycle: {' -> '.join((*path, name))}"
        if name not in done:
            for dep in ALLOWED[name]:
                visit(dep, (*path, name))
            done.add(name)

    for name in ALLOWED:
        visit(name, ())


def test_the_checker_sees_imports_inside_functions(tmp_path: Path) -> None:
    (tmp_path / "mod.py").write_text(
        "import exgrpo_client\n\ndef later():\n    from exgrpo_pool.app import create_app\n",
        encoding="utf-8",
    )
    found = imports_of(tmp_path, {"exgrpo_client", "exgrpo_pool", "exgrpo_trainer"})
    assert set(found) == {"exgrpo_client", "exgrpo_pool"}
