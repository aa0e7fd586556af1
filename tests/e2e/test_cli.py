"""The `exgrpo` command line against a real service: JSON output parsed, errors, round trips,
and `exgrpo serve --demo` as a real process."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import Result
from shared_data import VALID, needs
from typer.testing import CliRunner

from exgrpo_cli.main import app
from exgrpo_client import Client, GroupResult, exports, rollout
from exgrpo_client.io import read_export, read_questions

needs_valid = needs(VALID)
EXAMPLE_QUESTIONS = 48
"""Questions in clients/exgrpo_cli/examples/questions.jsonl, the demo pool's default."""
EXGRPO = Path(sys.executable).with_name("exgrpo")


@pytest.fixture
def quiet_root() -> Iterator[None]:
    """A one-shot command runs in a fresh process whose log shows warnings and errors only; in this
    test process an earlier test may have configured the root logger at INFO (the SDK's retry lines)."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.WARNING)
    yield
    root.setLevel(level)


@pytest.fixture
def cli(live_server: Any, monkeypatch: pytest.MonkeyPatch, quiet_root: None) -> Any:
    monkeypatch.delenv("EXGRPO_TOKEN", raising=False)
    runner = CliRunner()

    def invoke(*args: str, as_json: bool = True, url: str | None = None) -> Result:
        base = ["--url", url or live_server.url] + (["--json"] if as_json else [])
        return runner.invoke(app, [*base, *args])

    return invoke


def _json(result: Result) -> Any:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _fails(result: Result, message: str) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    line = result.stderr.strip()
    assert "\n" not in line and line.startswith("error: ")
    assert message in line
    return line


# --------------------------------------------------------------------------------------- pools
def test_pool_create_list_show_stats(cli: Any, pool_name: str) -> None:
    created = _json(
        cli(
            "pool",
            "create",
            pool_name,
            "--k",
            "4",
            "--batch-size",
            "32",
            "--weighting",
            "linear",
            "--description",
            "from the CLI",
        )
    )
    assert created["name"] == pool_name and created["description"] == "from the CLI"
    assert (created["config"]["k"], created["config"]["batch_size"], created["config"]["weighting"]) == (
        4,
        32,
        "linear",
    )
    assert created["config"]["experience_ratio"] == 0.5

    listed = _json(cli("pool", "list"))
    assert pool_name in [p["name"] for p in listed["data"]] and listed["count"] == len(listed["data"])
    assert _json(cli("pool", "show", pool_name)) == created
    stats = _json(cli("pool", "stats", pool_name))
    assert stats == {
        "pool": pool_name,
        "num_questions": 0,
        "num_trajectories": 0,
        "num_tokens": 0,
        "num_runs": 0,
        "runs": [],
    }


def test_pool_and_run_delete(cli: Any, live_server: Any, pool_name: str) -> None:
    created = _json(
        cli(
            "pool",
            "create",
            pool_name,
            "--k",
            "2",
            "--sharing",
            "shared_trajectories",
            "--max-trajectories-per-question",
            "3",
        )
    )
    assert created["config"]["sharing"] == "shared_trajectories"
    assert created["config"]["max_trajectories_per_question"] == 3
    with Client(live_server.url) as client:
        client.create_run(pool_name, "r1")
        client.create_run(pool_name, "r2")
        lease = client.acquire_run_lease(pool_name, "r1", "trainer-x")
    assert [r["name"] for r in _json(cli("runs", "list", pool_name))["data"]] == ["r1", "r2"]
    _fails(cli("runs", "delete", pool_name, "r1", "--yes"), "trainer-x")
    deleted = _json(cli("runs", "delete", pool_name, "r1", "--yes", "--force"))
    assert deleted == {"deleted": "run", "pool": pool_name, "run": "r1"}
    assert lease.generation == 1
    assert [r["name"] for r in _json(cli("runs", "list", pool_name))["data"]] == ["r2"]
    # without --yes it asks, and no answer keeps the pool
    kept = cli("pool", "delete", pool_name)
    assert kept.exit_code == 1 and _json(cli("pool", "show", pool_name))["name"] == pool_name
    assert _json(cli("pool", "delete", pool_name, "-y")) == {"deleted": "pool", "pool": pool_name}
    _fails(cli("pool", "show", pool_name), "does not exist")


def test_pool_create_from_a_config_file(cli: Any, pool_name: str, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("k: 6\nbatch_size: 64\nexperience_ratio: 0.25\nsharing: pooled\n", encoding="utf-8")
    created = _json(cli("pool", "create", pool_name, "--config", str(rules), "--batch-size", "16"))
    config = created["config"]
    assert (config["k"], config["batch_size"], config["experience_ratio"], config["sharing"]) == (
        6,
        16,
        0.25,
        "pooled",
    )

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"config": {"k": 2}, "description": "from json"}), encoding="utf-8")
    other = _json(cli("pool", "create", f"{pool_name}-b", "--config", str(spec)))
    assert other["config"]["k"] == 2 and other["description"] == "from json"


def test_tables_for_people(cli: Any, pool_name: str) -> None:
    _json(cli("pool", "create", pool_name, "--k", "4"))
    listed = cli("pool", "list", as_json=False)
    assert listed.exit_code == 0 and pool_name in listed.stdout and "pool(s)" in listed.stdout
    shown = cli("pool", "show", pool_name, as_json=False)
    assert shown.exit_code == 0 and "config.k" in shown.stdout
    stats = cli("pool", "stats", pool_name, as_json=False)
    assert stats.exit_code == 0 and f"pool {pool_name}: 0 questions" in stats.stdout


# ----------------------------------------------------------------------------------- questions
@needs_valid
def test_questions_import_with_limit(cli: Any, pool_name: str) -> None:
    _json(cli("pool", "create", pool_name, "--k", "4"))
    rows = [q for batch in read_questions(VALID, limit=300) for q in batch]
    distinct = len({(json.dumps([m.model_dump() for m in q.prompt]), q.ground_truth) for q in rows})
    result = _json(
        cli("questions", "import", str(VALID), "--pool", pool_name, "--limit", "300", "--chunk-size", "128")
    )
    assert result == {
        "received": 300,
        "inserted": distinct,
        "duplicates": 300 - distinct,
        "num_questions": distinct,
    }
    again = _json(cli("questions", "import", str(VALID), "--pool", pool_name, "--limit", "300"))
    assert again["inserted"] == 0 and again["duplicates"] == 300
    assert _json(cli("pool", "show", pool_name))["num_questions"] == distinct


@needs_valid
def test_questions_import_shows_progress(cli: Any, pool_name: str) -> None:
    _json(cli("pool", "create", pool_name, "--k", "4"))
    result = cli("questions", "import", str(VALID), "--pool", pool_name, "--limit", "50", as_json=False)
    assert result.exit_code == 0, result.output
    assert "import valid.parquet" in result.stderr and "50/50" in result.stderr
    assert f"questions imported into {pool_name}" in result.stdout


def test_questions_import_of_jsonl(cli: Any, pool_name: str, tmp_path: Path) -> None:
    _json(cli("pool", "create", pool_name, "--k", "4"))
    path = tmp_path / "q.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}?", "answer": 2 * i}) + "\n" for i in range(7)), "utf-8"
    )
    assert _json(cli("questions", "import", str(path), "--pool", pool_name))["inserted"] == 7


def test_questions_import_checks_the_whole_file_before_sending(
    cli: Any, start_live_server: Any, tmp_path: Path
) -> None:
    """A bad row late in a file leaves the pool as it was: every row is validated before the
    first chunk is sent (here five chunks of two would go out before row 11). A server of its own:
    the questions it adds would shift the ids other tests of the shared server see."""
    with start_live_server(f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}") as server:
        _json(cli("pool", "create", "p", "--k", "4", url=server.url))
        path = tmp_path / "q.jsonl"
        rows = [{"prompt": f"{i}+{i}?", "answer": 2 * i} for i in range(10)]
        rows.append({"prompt": "bad\u0000row", "answer": 1})
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), "utf-8")
        args = ("questions", "import", str(path), "--pool", "p", "--chunk-size", "2")
        _fails(cli(*args, url=server.url), f"{path}, row 11")
        assert httpx.get(f"{server.url}/v1/pools/p/stats", timeout=10).json()["num_questions"] == 0
        path.write_text("".join(json.dumps(r) + "\n" for r in rows[:10]), "utf-8")
        assert _json(cli(*args, url=server.url))["inserted"] == 10


# ------------------------------------------------------------------------------ export / import
def _group(question_id: int, *, replayed: bool = False) -> GroupResult:
    rows = [rollout(1.0, None, None, replayed=True)] if replayed else []
    rows += [
        rollout(float(j < question_id % 4), [question_id, j], [-0.5, -0.5]) for j in range(4 - len(rows))
    ]
    return GroupResult(question_id=question_id, rollouts=rows)


@needs_valid
def test_export_import_round_trip(cli: Any, live_server: Any, pool_name: str, tmp_path: Path) -> None:
    from exgrpo_client import Client

    _json(cli("pool", "create", pool_name, "--k", "4", "--batch-size", "8"))
    _json(cli("questions", "import", str(VALID), "--pool", pool_name, "--limit", "400"))
    with Client(live_server.url) as client:  # a few committed steps, so there are trajectories to carry
        # mixed from the start: what is collected must not hang on the rewards of the questions the
        # first steps draw (they follow the question ids, which depend on the pools made before)
        client.create_run(pool_name, "r1", phase="mixed")
        for _ in range(3):
            plan = client.plan_batch(pool_name, "r1")
            groups = [_group(item.question_id) for item in plan.fresh]
            groups += [_group(item.question_id, replayed=True) for item in plan.replay]
            client.commit_batch(pool_name, plan.id, groups)
    original = _json(cli("pool", "show", pool_name))
    assert original["num_trajectories"] > 0

    file = tmp_path / "pool.ndjson"
    exported = _json(cli("pool", "export", pool_name, str(file)))
    assert exported == {
        "pool": pool_name,
        "path": str(file),
        "format": "ndjson",  # by the file's name
        "num_bytes": file.stat().st_size,
        "num_questions": original["num_questions"],
        "num_trajectories": original["num_trajectories"],
        "num_runs": 1,
    }
    imported = _json(cli("pool", "import", str(file), "--name", f"{pool_name}-copy"))
    assert imported["pool"] == f"{pool_name}-copy" and imported["runs"] == 1
    copy = _json(cli("pool", "show", f"{pool_name}-copy"))
    for key in ("num_questions", "num_trajectories", "num_runs", "config"):
        assert copy[key] == original[key], key
    stats = _json(cli("pool", "stats", f"{pool_name}-copy"))
    assert stats["runs"][0]["step"] == 3

    _fails(cli("pool", "import", str(file)), f"pool {pool_name!r} already exists")
    people = cli("pool", "export", pool_name, str(tmp_path / "again.ndjson"), as_json=False)
    assert people.exit_code == 0 and f"export {pool_name}" in people.stderr
    assert (tmp_path / "again.ndjson").stat().st_size == file.stat().st_size

    # the binary form: the default for other names, or asked for; an import tells the forms apart
    binary = tmp_path / "pool.exgrpo"
    assert _json(cli("pool", "export", pool_name, str(binary)))["format"] == "binary"
    assert binary.read_bytes().startswith(exports.MAGIC) and binary.stat().st_size < file.stat().st_size
    forced = tmp_path / "forced.ndjson"
    assert _json(cli("pool", "export", pool_name, str(forced), "--format", "binary"))["format"] == "binary"
    assert forced.read_bytes() == binary.read_bytes()
    text = tmp_path / "text.bin"
    assert _json(cli("pool", "export", pool_name, str(text), "--format", "ndjson"))["format"] == "ndjson"
    assert text.read_bytes() == file.read_bytes()
    assert list(read_export(binary)) == list(read_export(file))
    from_binary = _json(cli("pool", "import", str(binary), "--name", f"{pool_name}-bin"))
    assert {**from_binary, "pool": f"{pool_name}-copy"} == imported
    assert _json(cli("pool", "show", f"{pool_name}-bin"))["num_trajectories"] == original["num_trajectories"]
    bad = cli("pool", "export", pool_name, str(binary), "--format", "csv", as_json=False)
    assert bad.exit_code == 2 and "csv" in bad.output


# ---------------------------------------------------------------------------------------- --json
NO_DATA_COMMANDS = {"train", "run", "experiment", "rollout", "model smollm2"}
"""Commands that print no data document (they train, serve tasks or write a model folder)."""


def test_json_after_the_command(cli: Any, pool_name: str, tmp_path: Path) -> None:
    created = _json(cli("pool", "create", pool_name, "--k", "4", "--json", as_json=False))
    assert created["name"] == pool_name and created["config"]["k"] == 4
    for args in (("pool", "list"), ("pool", "show", pool_name), ("pool", "stats", pool_name)):
        after = _json(cli(*args, "--json", as_json=False))
        assert after == _json(cli(*args))  # the document of `exgrpo --json ...`
        assert _json(cli(*args, "--json")) == after  # given in both places
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        "".join(json.dumps({"prompt": f"{i} * 3?", "answer": 3 * i}) + "\n" for i in range(3)), "utf-8"
    )
    imported = _json(cli("questions", "import", str(questions), "--pool", pool_name, "--json", as_json=False))
    assert imported == {"received": 3, "inserted": 3, "duplicates": 0, "num_questions": 3}
    file = tmp_path / "pool.ndjson"
    exported = cli("pool", "export", pool_name, str(file), "--json", as_json=False)
    assert _json(exported)["num_questions"] == 3 and exported.stderr == ""  # no progress bar either
    copy = _json(cli("pool", "import", str(file), "--name", f"{pool_name}-2", "--json", as_json=False))
    assert copy["pool"] == f"{pool_name}-2" and copy["questions"] == 3


def test_every_command_that_prints_data_takes_json() -> None:
    import typer.main

    def leaves(group: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
        for name, command in group.commands.items():
            if hasattr(command, "commands"):  # a group (typer's own click classes)
                yield from leaves(command, f"{prefix}{name} ")
            else:
                yield f"{prefix}{name}", command

    commands = dict(leaves(typer.main.get_command(app)))
    assert set(commands) >= NO_DATA_COMMANDS
    assert {"serve", "db upgrade", "eval", "pool stats", "questions import"} <= set(commands)
    without = [
        name
        for name, command in commands.items()
        if name not in NO_DATA_COMMANDS and not any("--json" in p.opts for p in command.params)
    ]
    assert without == []


# ---------------------------------------------------------------------------------------- errors
def test_errors_print_one_line(cli: Any, tmp_path: Path) -> None:
    line = _fails(cli("pool", "show", "nope"), "pool 'nope' does not exist")
    assert "404 Not found" in line
    _fails(cli("pool", "stats", "nope", as_json=False), "pool 'nope' does not exist")
    _fails(cli("pool", "create", "bad name!"), "invalid PoolCreate: name: String should match pattern")
    _fails(
        cli("pool", "create", "ok-name", "--k", "1"), "config.k: Input should be greater than or equal to 2"
    )
    _fails(cli("questions", "import", str(tmp_path / "missing.parquet"), "--pool", "x"), "no such file")
    _fails(cli("pool", "import", str(tmp_path / "missing.ndjson")), "No such file")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "q"}\n', encoding="utf-8")
    _fails(cli("questions", "import", str(bad), "--pool", "x"), f"{bad}, row 1: no ground truth")
    _fails(cli("pool", "list", url="http://127.0.0.1:9"), "is the pool service running")


def test_client_commands_do_not_import_the_server() -> None:
    code = (
        "import sys, exgrpo_cli.main\n"
        "loaded = {'fastapi', 'uvicorn', 'sqlalchemy', 'alembic', 'exgrpo_pool'} & set(sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---------------------------------------------------------------------------------- serve and db
def test_db_upgrade(tmp_path: Path) -> None:
    db = tmp_path / "sub" / "pool.db"
    result = CliRunner().invoke(
        app, ["--json", "db", "upgrade", "--database-url", f"sqlite+aiosqlite:///{db}"]
    )
    assert _json(result) == {"database_url": f"sqlite+aiosqlite:///{db}", "revision": "head"}
    again = CliRunner().invoke(
        app, ["db", "upgrade", "--database-url", f"sqlite+aiosqlite:///{db}", "--json"]
    )
    assert _json(again) == _json(result)
    with sqlite3.connect(db) as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"alembic_version", "pool", "question", "run"} <= tables


def test_serve_refuses_settings_without_a_way_in(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("EXGRPO_ALLOW_ANONYMOUS", "EXGRPO_TOKENS", "EXGRPO_CONFIG_FILE"):
        monkeypatch.delenv(var, raising=False)
    result = CliRunner().invoke(
        app, ["serve", "--no-anonymous", "--database-url", f"sqlite+aiosqlite:///{tmp_path}/p.db"]
    )
    _fails(result, "no way in: set EXGRPO_TOKENS")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_serve_demo_as_a_process(tmp_path: Path) -> None:
    assert EXGRPO.is_file(), "the console script `exgrpo` is installed with the package"
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXGRPO_")}
    env["EXGRPO_LOG_LEVEL"] = "WARNING"
    command = [
        str(EXGRPO),
        "serve",
        "--anonymous",
        "--demo",
        "--port",
        str(port),
        "--database-url",
        f"sqlite+aiosqlite:///{tmp_path}/pool.db",
        "--json",
    ]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        pool = None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                response = httpx.get(f"{url}/v1/pools/demo", timeout=2)
                if response.status_code == 200 and response.json()["num_runs"] == 1:
                    pool = response.json()
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert pool is not None, "the demo pool did not appear"
        assert pool["num_questions"] == EXAMPLE_QUESTIONS
        assert pool["config"]["k"] == 8
        runs = httpx.get(f"{url}/v1/pools/demo/runs", timeout=5).json()
        assert [r["name"] for r in runs["data"]] == ["demo"]
    finally:
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr.decode()
    settings = json.loads(stdout.decode().splitlines()[0])
    assert (
        settings["port"] == port and settings["host"] == "127.0.0.1" and settings["allow_anonymous"] is True
    )
    assert settings["tokens"] == []


# ------------------------------------------------------------------------ serve, in process
def test_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from exgrpo_cli import _serve

    monkeypatch.setenv("EXGRPO_PORT", "9100")
    monkeypatch.setenv("EXGRPO_HOST", "127.0.0.2")
    monkeypatch.setenv("EXGRPO_ALLOW_ANONYMOUS", "true")
    settings = _serve.build_settings(host="0.0.0.0", port=None, database_url=None, allow_anonymous=None)
    assert (settings.host, settings.port, settings.allow_anonymous) == ("0.0.0.0", 9100, True)

    monkeypatch.setenv("EXGRPO_DATABASE_URL", "sqlite+aiosqlite:///from-env.db")
    assert _serve.database_url(None) == "sqlite+aiosqlite:///from-env.db"
    assert _serve.database_url("sqlite+aiosqlite:///flag.db") == "sqlite+aiosqlite:///flag.db"
    assert _serve.mask_url("postgresql+asyncpg://u:secret@db:5432/x") == "postgresql+asyncpg://***@db:5432/x"
    assert _serve.mask_url("sqlite+aiosqlite:///p.db") == "sqlite+aiosqlite:///p.db"


async def _pools_after_seeding(settings: Any, demo_data: Path | None, token: str | None = None) -> list[Any]:
    from asgi_lifespan import LifespanManager

    from exgrpo_cli import _serve
    from exgrpo_client import AsyncClient
    from exgrpo_pool.app import create_app

    application = create_app(settings)
    async with LifespanManager(application) as manager:
        await _serve._seed_demo(manager.app, settings, demo_data)
        await _serve._seed_demo(manager.app, settings, demo_data)  # a second start leaves it alone
        transport = httpx.ASGITransport(app=manager.app)
        async with AsyncClient("http://pool.test", transport=transport, token=token) as client:
            pools = (await client.list_pools()).data
            if pools:
                assert [r.name for r in (await client.list_runs("demo")).data] == ["demo"]
            return pools


async def test_demo_pool_from_the_shipped_examples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from exgrpo_pool.config import Settings

    monkeypatch.delenv("EXGRPO_DEMO_DATA", raising=False)
    settings = Settings(
        allow_anonymous=True, database_url=f"sqlite+aiosqlite:///{tmp_path}/p.db", log_level="ERROR"
    )
    (pool,) = await _pools_after_seeding(settings, None)
    assert pool.name == "demo" and pool.num_questions == EXAMPLE_QUESTIONS and pool.config.batch_size == 16
    assert pool.description == f"demo pool: {EXAMPLE_QUESTIONS} questions from the example questions"


async def test_demo_pool_from_a_file_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from exgrpo_pool.config import Settings

    questions = tmp_path / "q.jsonl"
    rows = [{"prompt": f"{i} + 1?", "answer": i + 1} for i in range(5)]
    questions.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    monkeypatch.setenv("EXGRPO_DEMO_DATA", str(questions))
    settings = Settings(
        allow_anonymous=True, database_url=f"sqlite+aiosqlite:///{tmp_path}/p.db", log_level="ERROR"
    )
    (pool,) = await _pools_after_seeding(settings, None)
    assert pool.num_questions == 5 and pool.description == f"demo pool: 5 questions from {questions}"

    # a file that is not there is said in the log, and no pool is made from something else
    missing = tmp_path / "missing.parquet"
    other = Settings(
        allow_anonymous=True, database_url=f"sqlite+aiosqlite:///{tmp_path}/o.db", log_level="WARNING"
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="exgrpo.cli"):
        assert await _pools_after_seeding(other, missing) == []
    assert f"demo pool not created: {missing}: no such file" in caplog.messages


@needs_valid
async def test_demo_pool_from_the_validation_set_with_a_token(tmp_path: Path) -> None:
    from exgrpo_pool.config import Settings, TokenGrant

    token = "demo-admin-token-0000001"
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path}/p.db",
        log_level="ERROR",
        tokens=[
            TokenGrant(token="reader-token-0000000001", scopes=["read"]),
            TokenGrant(token=token, scopes=["admin"]),
        ],
    )
    (pool,) = await _pools_after_seeding(settings, VALID, token)
    assert pool.num_questions == 200  # distinct questions: the file repeats some


async def test_demo_pool_needs_write_access(tmp_path: Path) -> None:
    from exgrpo_pool.config import Settings

    # anonymous callers only read when the service binds beyond loopback
    settings = Settings(
        allow_anonymous=True,
        host="0.0.0.0",
        database_url=f"sqlite+aiosqlite:///{tmp_path}/p.db",
        log_level="ERROR",
    )
    assert await _pools_after_seeding(settings, None) == []


def test_bearer_token_from_flag_or_environment(
    start_live_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from exgrpo_pool.config import TokenGrant

    admin, reader = "cli-admin-token-00000001", "cli-reader-token-0000001"
    grants = [TokenGrant(token=admin, scopes=["admin"]), TokenGrant(token=reader, name="ci", scopes=["read"])]
    monkeypatch.delenv("EXGRPO_TOKEN", raising=False)
    runner = CliRunner()
    with start_live_server(
        f"sqlite+aiosqlite:///{tmp_path}/p.db", tokens=grants, allow_anonymous=False
    ) as server:
        base = ["--url", server.url, "--json"]
        _fails(runner.invoke(app, [*base, "pool", "list"]), "needs a bearer token")
        assert _json(runner.invoke(app, [*base, "--token", admin, "pool", "create", "p1"]))["name"] == "p1"
        _fails(
            runner.invoke(app, [*base, "--token", reader, "pool", "create", "p2"]),
            "ci may not create pool 'p2'",
        )
        monkeypatch.setenv("EXGRPO_TOKEN", reader)
        assert _json(runner.invoke(app, [*base, "pool", "list"]))["count"] == 1
