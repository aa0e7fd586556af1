"""How `python -m exgrpo_trainer` ends as a rank of a torchrun run (WORLD_SIZE > 1): with the
status `main` gave, its messages and output flushed, without the interpreter's teardown."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _python(args: list[str], world: int) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXGRPO_")}
    env.update(WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0")
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=120)


def _trainer(*args: str, world: int) -> subprocess.CompletedProcess[str]:
    return _python(["-m", "exgrpo_trainer", *args], world)


@pytest.mark.parametrize("world", [1, 2])
def test_a_refused_setting_prints_one_line_and_exits_1(world: int) -> None:
    proc = _trainer("optim.lr=fast", world=world)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "optim.lr" in lines[0], proc.stderr


@pytest.mark.parametrize("world", [1, 2])
def test_help_is_printed_whole_and_exits_0(world: int) -> None:
    proc = _trainer("--help", world=world)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: ") and "--takeover" in proc.stdout, proc.stdout


def test_a_rank_leaves_without_the_interpreters_teardown() -> None:
    """An exit handler registered in the process runs for one process and not for a rank (the
    teardown is skipped there; its output was flushed before)."""
    code = (
        "import atexit, sys; from exgrpo_trainer import cli; "
        "atexit.register(lambda: print('teardown ran', flush=True)); "
        "print('output before the end', end=''); "
        "cli.main_process(['optim.lr=fast'])"
    )
    for world, teardown in ((1, True), (2, False)):
        proc = _python(["-c", code], world)
        assert proc.returncode == 1, proc.stderr
        assert proc.stdout.startswith("output before the end"), proc.stdout
        assert ("teardown ran" in proc.stdout) is teardown, (world, proc.stdout)
