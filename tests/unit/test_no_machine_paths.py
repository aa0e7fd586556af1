"""No tracked file depends on where a developer's machine keeps things.

1. No absolute path under a root that only a particular machine or user has: the checkout or
   shared-data root of the development machine, home folders, mount points (see `MACHINE_ROOTS`).
   Paths that are the same everywhere stay allowed: container paths (/data/run, /models, /opt,
   /etc), URL paths (/v1/pools), /dev/null, and /tmp in commands shown by the docs.
2. No Python string literal that is a fixed location under /tmp: code makes its temporary folders
   with `tempfile` (tests: `tmp_path`).
3. The product (services/, clients/) never reads the shared data folder beside the checkout; only
   tests and benchmarks do, through tests/shared_data.py and bench/_data.py.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MACHINE_ROOTS = ("work", "home", "root", "Users", "mnt", "media", "scratch")
"""First folders of absolute paths that exist only on some machine (written without slashes
here, so that this file does not match its own rule)."""
# the root must start a path: at the start, after a character that cannot be part of a relative
# path, or after `//` (file:///...); `a/home/b`, `~/work/x` and `http://host/home/x` do not match
MACHINE_PATH = re.compile(r"(?:^|(?<=[^\w.~/-])|(?<=//))/(?:" + "|".join(MACHINE_ROOTS) + r")/[\w.-]")
TMP_DIRS = tuple("/" + name for name in ("tmp", "var/tmp"))
"""Temporary folders (built here, so that this file's own literals do not match rule 2)."""
SHARED_FOLDER = re.compile(r"\.\./shared\b")
PRODUCT = ("services/", "clients/")
MAX_BYTES = 2 << 20


def machine_paths(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line of `text` that names a machine-specific absolute path."""
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if MACHINE_PATH.search(line)]


def fixed_tmp_literals(source: str) -> list[tuple[int, str]]:
    """(line number, value) of the string literals of a Python source that are paths under /tmp,
    in source order."""
    under = tuple(d + "/" for d in TMP_DIRS)
    return sorted(
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and (node.value.rstrip("/") in TMP_DIRS or node.value.startswith(under))
    )


@pytest.fixture(scope="module")
def tracked() -> dict[str, str]:
    """Path -> text of every tracked text file (as in the working tree)."""
    if shutil.which("git") is not None and (ROOT / ".git").exists():
        names = (
            subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True)
            .stdout.decode()
            .split("\0")
        )
    else:  # an unpacked source tree: every file but what the tools make
        made = {
            ".venv",
            "build",
            "exgrpo-data",
            "exgrpo_stack.egg-info",
            "__pycache__",
            ".mypy_cache",
            ".pytest_cache",
            ".ruff_cache",
        }
        names = [
            str(p.relative_to(ROOT))
            for p in ROOT.rglob("*")
            if p.is_file() and not made.intersection(p.relative_to(ROOT).parts)
        ]
    texts = {}
    for name in filter(None, names):
        path = ROOT / name
        if not path.is_file() or path.stat().st_size > MAX_BYTES:
            continue  # deleted in the working tree, or a large data file
        data = path.read_bytes()
        if b"\0" not in data:
            texts[name] = data.decode("utf-8", errors="replace")
    return texts


def test_the_rules_catch_machine_paths_and_allow_portable_ones() -> None:
    def p(root: str, rest: str) -> str:
        return "/" + root + "/" + rest

    caught = [
        f'DATA = Path("{p("work", "shared/data/exgrpo/valid.parquet")}")',
        f"see `{p('work', 'shared/notes/environment.md')}`",
        f"--model {p('home', 'alice/models/qwen')}",
        f"PATH=/usr/bin:{p('root', '.local/bin')}",
        f"file://{p('Users', 'bob/data.jsonl')}",
        p("mnt", "disk/run"),
    ]
    allowed = [
        "WORKDIR /data/run",
        "COPY deploy/docker/healthcheck.py /opt/exgrpo/healthcheck.py",
        "curl http://127.0.0.1:8700/v1/pools/math/runs",
        "exgrpo serve > /dev/null 2>&1",
        "RUN useradd -d /etc/exgrpo app",
        "python3.11 -m venv /tmp/vllmcpu-venv",
        "see services/work/notes.md and ~/work/x and ../home/y",
        "https://example.org/home/index.html",
    ]
    assert [n for n, _ in machine_paths("\n".join(caught))] == list(range(1, len(caught) + 1))
    assert machine_paths("\n".join(allowed)) == []

    tmp = TMP_DIRS[0]
    source = f'OUT = "{tmp}/results"\nNAME = f"{tmp}/run-{{1}}"\nTOP = "{tmp}"\n"""Usage: --out {tmp}/lc"""\n'
    assert fixed_tmp_literals(source) == [(1, f"{tmp}/results"), (2, f"{tmp}/run-"), (3, tmp)]


def test_no_tracked_file_names_a_machine_path(tracked: dict[str, str]) -> None:
    found = [f"{name}:{n}: {line}" for name, text in tracked.items() for n, line in machine_paths(text)]
    assert found == [], (
        "paths of a development machine (use paths relative to the repository):\n" + "\n".join(found)
    )


def test_no_python_code_writes_to_a_fixed_temporary_path(tracked: dict[str, str]) -> None:
    found = [
        f"{name}:{n}: {value!r}"
        for name, text in tracked.items()
        if name.endswith(".py")
        for n, value in fixed_tmp_literals(text)
    ]
    assert found == [], "use tempfile (tests: tmp_path) instead of:\n" + "\n".join(found)


def test_the_product_does_not_read_the_shared_data_folder(tracked: dict[str, str]) -> None:
    found = [
        f"{name}:{n}: {line.strip()}"
        for name, text in tracked.items()
        if name.startswith(PRODUCT)
        for n, line in enumerate(text.splitlines(), 1)
        if SHARED_FOLDER.search(line)
    ]
    assert found == [], "only tests and benchmarks may read ../shared:\n" + "\n".join(found)
