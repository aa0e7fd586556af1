"""The domain package must stay pure: it may import only the standard library and numpy."""

from __future__ import annotations

import sys
from pathlib import Path

from _imports import imported_top_level_names

import exgrpo_pool.domain as domain

DOMAIN_DIR = Path(domain.__file__).parent
ALLOWED = set(sys.stdlib_module_names) | {"numpy"}
EXPECTED_MODULES = {"__init__", "rules", "buckets", "sampler", "collection", "composition", "epoch"}


def test_the_checker_detects_a_third_party_import() -> None:
    names, levels = imported_top_level_names(
        "import numpy as np\nfrom pydantic import BaseModel\nfrom . import x"
    )
    assert names - ALLOWED == {"pydantic"}
    assert levels == [1]


def test_domain_modules_import_only_stdlib_and_numpy() -> None:
    files = sorted(DOMAIN_DIR.glob("*.py"))
    assert {f.stem for f in files} >= EXPECTED_MODULES
    for path in files:
        names, levels = imported_top_level_names(path.read_text(encoding="utf-8"))
        assert names <= ALLOWED, f"{path.name} imports {sorted(names - ALLOWED)}"
        assert all(level == 1 for level in levels), f"{path.name} imports from outside the domain package"
