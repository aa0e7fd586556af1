"""The trainer's algorithm core stays pure: standard library, numpy and torch only, no I/O."""

from __future__ import annotations

import sys
from pathlib import Path

from _imports import imported_top_level_names

import exgrpo_trainer.algo as algo

ALGO_DIR = Path(algo.__file__).parent
ALLOWED = set(sys.stdlib_module_names) | {"numpy", "torch"}
EXPECTED_MODULES = {"__init__", "advantages", "loss", "metrics", "rollout_rows", "selection"}
IO_MODULES = {"io", "os", "pathlib", "shutil", "socket", "subprocess", "urllib", "http", "tempfile", "pickle"}


def test_algo_modules_import_only_stdlib_numpy_and_torch() -> None:
    files = sorted(ALGO_DIR.glob("*.py"))
    assert {f.stem for f in files} >= EXPECTED_MODULES
    for path in files:
        source = path.read_text(encoding="utf-8")
        names, levels = imported_top_level_names(source)
        assert names <= ALLOWED, f"{path.name} imports {sorted(names - ALLOWED)}"
        assert not names & IO_MODULES, f"{path.name} imports I/O modules {sorted(names & IO_MODULES)}"
        assert all(level == 1 for level in levels), f"{path.name} imports from outside the algo package"
        assert "open(" not in source, f"{path.name} opens files"


def test_public_surface_exists_without_duplicates() -> None:
    assert len(set(algo.__all__)) == len(algo.__all__)
    assert all(hasattr(algo, name) for name in algo.__all__)
