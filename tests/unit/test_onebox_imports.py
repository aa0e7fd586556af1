"""Import boundaries of the one-box job: the trainer never imports the pool service (or the one-box
job, or the CLI), and the one-box job uses only the public APIs of the trainer and of the pool
service (its settings and embedded server), and never runs a CLI."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from _imports import attributes_of, imported_modules, imported_top_level_names

import exgrpo_trainer


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations is not None
    return Path(next(iter(spec.submodule_search_locations)))


TRAINER_DIR = _package_dir("exgrpo_trainer")
ONEBOX_DIR = _package_dir("exgrpo_onebox")
POOL_PUBLIC = {"exgrpo_pool.config", "exgrpo_pool.embedded"}
"""The pool service's settings and its app served in a thread: what embedding it needs."""
ONEBOX_MODULES = {
    "__init__",
    "main_job",
    "experiment",
    "synthetic",
    "warmstart",
    "tiny",
    "report",
    "hf_import",
}


def boundary_errors(source: str) -> list[str]:
    """What a one-box module imports past the public APIs."""
    errors = []
    for module, names in imported_modules(source):
        top = module.split(".")[0]
        if top == "exgrpo_trainer":
            if module != "exgrpo_trainer":
                errors.append(f"imports {module} (use `from exgrpo_trainer import ...`)")
            errors += [
                f"imports exgrpo_trainer.{n} (not public)" for n in names if n not in exgrpo_trainer.__all__
            ]
        elif top == "exgrpo_pool" and module not in POOL_PUBLIC:
            errors.append(f"imports {module} (the pool service's public parts: {sorted(POOL_PUBLIC)})")
        elif top in ("exgrpo_cli", "subprocess"):
            errors.append(f"imports {module}: call functions, not the command line")
    hidden = attributes_of(source, "exgrpo_trainer") - set(exgrpo_trainer.__all__)
    errors += [f"reads exgrpo_trainer.{n} (not public)" for n in sorted(hidden)]
    return errors


def test_the_checker_detects_private_imports() -> None:
    source = (
        "import exgrpo_trainer\nfrom exgrpo_trainer.trainer import Trainer\nfrom exgrpo_trainer import dist\n"
        "from exgrpo_pool.service.convert import rules_for\nimport subprocess\n"
        "exgrpo_trainer.model.unsharded\nexgrpo_trainer.run_training\n"
        "from exgrpo_trainer import TrainConfig\nfrom exgrpo_pool.embedded import serve_in_thread\n"
    )
    assert boundary_errors(source) == [
        "imports exgrpo_trainer.trainer (use `from exgrpo_trainer import ...`)",
        "imports exgrpo_trainer.dist (not public)",
        "imports exgrpo_pool.service.convert (the pool service's public parts: "
        "['exgrpo_pool.config', 'exgrpo_pool.embedded'])",
        "imports subprocess: call functions, not the command line",
        "reads exgrpo_trainer.model (not public)",
    ]


def test_no_trainer_module_imports_the_pool_service_the_one_box_job_or_the_cli() -> None:
    files = sorted(TRAINER_DIR.rglob("*.py"))
    assert {f.stem for f in files} >= {"__init__", "config", "trainer"}
    for path in files:
        names, _ = imported_top_level_names(path.read_text(encoding="utf-8"))
        forbidden = names & {"exgrpo_pool", "exgrpo_onebox", "exgrpo_cli"}
        assert not forbidden, f"{path.relative_to(TRAINER_DIR)} imports {sorted(forbidden)}"


def test_the_one_box_job_uses_only_public_apis() -> None:
    files = sorted(ONEBOX_DIR.glob("*.py"))
    assert {f.stem for f in files} >= ONEBOX_MODULES
    for path in files:
        errors = boundary_errors(path.read_text(encoding="utf-8"))
        assert not errors, f"{path.name}: {'; '.join(errors)}"


def test_prepare_imports_without_the_server_extra() -> None:
    """`exgrpo prepare` runs in the trainer image (train and rollout extras, no server extra): its
    module must not pull the pool service or its dependencies in."""
    import subprocess
    import sys

    code = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'exgrpo_pool', 'pydantic_settings', 'fastapi', 'sqlalchemy'}:\n"
        "            raise ImportError(f'{name} is not installed here')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import exgrpo_onebox.prepare\n"
        "from exgrpo_cli.main import app\n"
        "from typer.testing import CliRunner\n"
        "r = CliRunner().invoke(app, ['prepare', '--help'])\n"
        "assert r.exit_code == 0 and '--model-out' in r.output, r.output\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-1500:]
