"""Every link between the project's Markdown files leads somewhere: the file exists, and an anchor
(`file.md#heading`, `#heading`) names a heading of that file, spelled as GitHub spells a heading's
anchor (lower case, punctuation dropped but hyphens and underscores, each space a hyphen; a second
heading of the same text gets `-1`)."""

from __future__ import annotations

import functools
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_SKIPPED = ("node_modules", "build", "dist", "out")


def _markdown_files() -> list[Path]:
    """The project's Markdown files: those git tracks or would (not what it ignores: a virtual
    environment, an older tree unpacked under `bench/out`), or without git every one outside the
    folders a checkout makes for itself."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "*.md"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return sorted(
            p
            for p in ROOT.rglob("*.md")
            if not any(part.startswith(".") or part in _SKIPPED for part in p.relative_to(ROOT).parts)
        )
    return sorted(ROOT / name for name in listed if name and (ROOT / name).is_file())


DOCS = _markdown_files()
_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")


def anchor_of(heading: str) -> str:
    """GitHub's anchor of a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _outside_code(path: Path) -> list[str]:
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


@functools.cache  # a file that hundreds of links lead into is read once
def anchors(path: Path) -> frozenset[str]:
    seen: Counter[str] = Counter()
    out = set()
    for line in _outside_code(path):
        m = _HEADING.match(line)
        if m is None:
            continue
        a = anchor_of(m.group(2))
        out.add(a if not seen[a] else f"{a}-{seen[a]}")
        seen[a] += 1
    return frozenset(out)


def links(path: Path) -> list[str]:
    found = []
    for line in _outside_code(path):
        line = re.sub(r"`[^`]*`", "", line)  # a link shown as code is no link
        found += _LINK.findall(line)
    return found


def test_the_project_has_markdown_to_check() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "docs/benchmarks.md", "docs/api.md"} <= names


def test_anchor_of_spells_headings_as_github_does() -> None:
    assert anchor_of("Binary frames and a Redis index without SCAN (issue 12)") == (
        "binary-frames-and-a-redis-index-without-scan-issue-12"
    )
    assert anchor_of("`exgrpo run`: the main job") == "exgrpo-run-the-main-job"
    assert anchor_of("Remote rollouts: synchronous vs asynchronous") == (
        "remote-rollouts-synchronous-vs-asynchronous"
    )


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_local_links_lead_somewhere(doc: Path) -> None:
    broken = []
    for target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = doc if not file_part else (doc.parent / file_part).resolve()
        if not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with this anchor in {dest.name}")
    assert not broken, "\n".join(broken)
