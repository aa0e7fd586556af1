"""The type check of the test command: mypy over the installed packages, as configured in
pyproject.toml ([tool.mypy]).

The packages live in folders named otherwise (`services/buffer_api` is `exgrpo_pool`, see
[tool.setuptools] package-dir) and the editable install finds them through an import hook that
mypy does not run. So this links each package under its import name into build/typecheck (the
`mypy_path` of the configuration), runs mypy, and prints its messages with the real file paths.

    .venv/bin/python scripts/typecheck.py            # what scripts/test.sh runs before pytest
    .venv/bin/python scripts/typecheck.py -p exgrpo_pool    # extra arguments go to mypy
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINKS = ROOT / "build" / "typecheck"


def package_dirs(pyproject: Path) -> dict[str, Path]:
    """Import name -> source folder of every top-level package (the package-dir mapping)."""
    config = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    mapping: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in mapping.items() if name}


def link_packages(packages: dict[str, Path], links: Path) -> dict[str, str]:
    """Point links/<name> at each package folder (stale links removed); answers the path
    rewrites link prefix -> folder prefix, relative to the repository root."""
    links.mkdir(parents=True, exist_ok=True)
    for entry in links.iterdir():
        if entry.is_symlink() and entry.name not in packages:
            entry.unlink()
    rewrites = {}
    for name, folder in packages.items():
        link = links / name
        if link.is_symlink() and Path(os.readlink(link)) != folder:
            link.unlink()
        if not link.is_symlink():
            link.symlink_to(folder, target_is_directory=True)
        rewrites[f"{link.relative_to(ROOT)}/"] = f"{folder.relative_to(ROOT)}/"
    return rewrites


def main(argv: list[str]) -> int:
    rewrites = link_packages(package_dirs(ROOT / "pyproject.toml"), LINKS)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mypy", *argv], cwd=ROOT, stdout=subprocess.PIPE, text=True, bufsize=1
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        for link, folder in rewrites.items():
            if line.startswith(link):
                line = folder + line[len(link) :]
                break
        sys.stdout.write(line)
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
