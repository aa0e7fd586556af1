"""Every package folder is installed: pyproject lists packages explicitly (folders map to
collision-free import names), so a new sub-package must be added there."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_in_pyproject() -> None:
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    expected = set()
    for name, folder in setup["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            expected.add(".".join([name, *rel.parts]))
    assert expected - listed == set(), f"add to [tool.setuptools] packages: {sorted(expected - listed)}"
    assert listed - expected == set(), f"listed but missing on disk: {sorted(listed - expected)}"
