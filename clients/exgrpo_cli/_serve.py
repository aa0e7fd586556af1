"""`exgrpo serve` and `exgrpo db upgrade`: the parts of the CLI that need the server extra.

`main.py` imports this module inside those two commands only, so the client commands work
with nothing but the SDK installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.process
import os
import shutil
import signal
import socket
import tempfile
import threading
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
import uvicorn
from prometheus_client import values as prometheus_values
from sqlalchemy.engine import make_url

from exgrpo_client import AsyncClient, NotFound
from exgrpo_client import schemas as s
from exgrpo_client.errors import ExgrpoError
from exgrpo_client.io import QuestionFileError, read_questions
from exgrpo_client.logs import configure_logging, fields
from exgrpo_pool.app import create_app
from exgrpo_pool.config import Settings
from exgrpo_pool.config import mask_url as mask_url  # main.py masks the URL of `db upgrade` with it
from exgrpo_pool.store import db as dbmod
from exgrpo_pool.store import repo

log = logging.getLogger("exgrpo.cli")

DEMO_POOL = "demo"
DEMO_RUN = "demo"
DEMO_QUESTIONS = 200
EXAMPLE_QUESTIONS = "examples/questions.jsonl"
"""Package data of `exgrpo_cli`: the demo pool's questions unless a file is given."""
DEMO_CONFIG = {"k": 8, "batch_size": 16}


def build_settings(**flags: Any) -> Settings:
    """Settings from EXGRPO_* (and EXGRPO_CONFIG_FILE); the flags that were given win."""
    return Settings(**{k: v for k, v in flags.items() if v is not None})


def database_url(flag: str | None) -> str:
    """The database to migrate: the flag, else what `exgrpo serve` would use."""
    if flag:
        return flag
    # only the database URL matters here, so the "no way in" check must not block a migration
    return Settings(allow_anonymous=True).database_url


def upgrade(url: str) -> None:
    dbmod.upgrade(url)


def check_tallies(url: str, *, repair: bool) -> list[dict[str, Any]]:
    """`exgrpo db tallies`: the tally cells that differ from counting their rows (set to the
    counts with `repair`), as plain dicts."""
    u = make_url(url)
    sqlite_file = u.get_backend_name() == "sqlite" and u.database not in (None, "", ":memory:")
    if sqlite_file and not Path(str(u.database)).is_file():
        raise ValueError(f"no database file {u.database}")

    async def check() -> list[repo.TallyDrift]:
        db = dbmod.Database(url)
        try:
            async with db.engine.connect() as conn:
                tables = await conn.run_sync(lambda c: set(sa.inspect(c).get_table_names()))
            if "state_tally" not in tables:
                raise ValueError(
                    f"database {mask_url(url)} keeps no tallies yet: run `exgrpo db upgrade` first"
                )
            return await db.check_tallies(repair=repair)
        finally:
            await db.close()

    return [d._asdict() for d in asyncio.run(check())]


# ------------------------------------------------------------------------------------- serving
def serve(settings: Settings, *, demo: bool, demo_data: Path | None, log_settings: bool = False) -> None:
    configure_logging(settings.log_format, settings.log_level)
    if log_settings:
        log.info("pool service settings", extra=fields(**settings.public_dict()))
    if settings.workers > 1:
        raise SystemExit(serve_workers(settings, demo=demo, demo_data=demo_data))
    # uvicorn shuts down gracefully, then re-raises the Ctrl-C it caught: that is a clean stop
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(settings, demo=demo, demo_data=demo_data))


# ------------------------------------------------------------------- several service processes
#: how long the workers get to finish their requests after a stop, before they are killed
STOP_GRACE_S = 30.0


def serve_workers(settings: Settings, *, demo: bool, demo_data: Path | None) -> int:
    """`settings.workers` service processes on one listening socket; answers the exit status.

    This process migrates the database once, binds the socket, forks the workers (each serving
    the socket with uvicorn; forked before any event loop or database connection exists here, and
    without the resource-tracker process a spawned start would add) and watches them. SIGTERM or SIGINT stops
    them all (each finishes its requests); a worker that dies stops the others too, and the status
    is then 1: a service with a process missing would answer some clients and not others, so it
    stops for its supervisor (systemd, Kubernetes, compose) to restart it whole. Metrics go
    through prometheus_client's multiprocess mode, in a directory made here and removed at the end.
    """
    if settings.auto_migrate:
        dbmod.upgrade(settings.database_url)
    sock = socket.create_server((settings.host, settings.port), backlog=2048)
    sock.set_inheritable(True)
    metrics_dir = tempfile.mkdtemp(prefix="exgrpo-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    worker_settings = settings.model_copy(update={"auto_migrate": False})
    fork = multiprocessing.get_context("fork")
    stopping = threading.Event()

    def stop(_signum: int, _frame: object) -> None:
        stopping.set()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    procs: list[multiprocessing.process.BaseProcess] = []
    proc: multiprocessing.process.BaseProcess
    status = 0
    try:
        for _ in range(settings.workers):
            proc = fork.Process(target=_worker, args=(worker_settings, sock), daemon=False)
            proc.start()
            procs.append(proc)
        log.info(
            "pool service: %d workers on %s:%d",
            settings.workers,
            settings.host,
            settings.port,
            extra=fields(workers=[p.pid for p in procs]),
        )
        if demo:
            asyncio.run(_seed_demo_in_parent(worker_settings, demo_data))
        while not stopping.wait(0.2):
            dead = [p for p in procs if p.exitcode is not None]
            if dead:
                for p in dead:
                    log.error("worker %s exited (%s): stopping the service", p.pid, _exit_reason(p.exitcode))
                status = 1
                break
    finally:
        for proc in procs:
            if proc.exitcode is None and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        for proc in procs:
            proc.join(STOP_GRACE_S)
            if proc.exitcode is None:
                log.warning("worker %s did not stop in %.0f s: killed", proc.pid, STOP_GRACE_S)
                proc.kill()
                proc.join()
        sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("pool service stopped")
    return status


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return signal.Signals(-code).name
    return f"status {code}"


def _worker(settings: Settings, sock: socket.socket) -> None:
    """One service process: the app on the shared socket until SIGTERM or SIGINT."""
    for sig in (signal.SIGTERM, signal.SIGINT):  # the parent's handlers came with the fork
        signal.signal(sig, signal.SIG_DFL)
    # prometheus_client chose its in-process values when the parent imported it: this process
    # writes its values to the shared directory instead, as an import with the variable set does
    prometheus_values.ValueClass = prometheus_values.MultiProcessValue()
    configure_logging(settings.log_format, settings.log_level)
    app = create_app(settings, freeze_heap=True)
    config = uvicorn.Config(app, log_level=settings.log_level.lower(), log_config=None, access_log=False)
    # uvicorn catches SIGINT and SIGTERM, finishes its requests and returns; a Ctrl-C it re-raises
    # after that is the clean stop it was asked for
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.Server(config).run(sockets=[sock])


async def _seed_demo_in_parent(settings: Settings, demo_data: Path | None) -> None:
    """The demo pool, created by this process through an app of its own (no socket)."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        await _seed_demo(app, settings, demo_data)


async def _serve(settings: Settings, *, demo: bool, demo_data: Path | None) -> None:
    app = create_app(settings, freeze_heap=True)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        log_config=None,  # uvicorn's lines go through the process's log format (exgrpo_client.logs)
        access_log=False,  # the service writes its own access log, with request ids
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    if demo:
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if server.started:
            await _seed_demo(app, settings, demo_data)
    await serving


def _writer_token(settings: Settings) -> str | None:
    """A configured token that may create the demo pool (None: go in anonymously)."""
    for grant in settings.tokens:
        if {"admin", "write:*", f"write:{DEMO_POOL}"} & set(grant.scopes):
            return grant.token
    return None


async def _seed_demo(app: Any, settings: Settings, demo_data: Path | None) -> None:
    """Create the demo pool and run unless the pool exists; failures are logged, not fatal."""
    transport = httpx.ASGITransport(app=app)
    async with AsyncClient(
        "http://exgrpo-demo", token=_writer_token(settings), transport=transport
    ) as client:
        try:
            await client.get_pool(DEMO_POOL)
            log.info("demo pool exists, left as it is")
            return
        except NotFound:
            pass
        try:
            questions, source = demo_questions(demo_data)
            await client.create_pool(
                DEMO_POOL, DEMO_CONFIG, f"demo pool: {len(questions)} questions from {source}"
            )
            imported = await client.import_questions(DEMO_POOL, questions)
            await client.create_run(DEMO_POOL, DEMO_RUN)
        except (ExgrpoError, QuestionFileError) as e:
            log.warning("demo pool not created: %s", e)
            return
        log.info(
            "demo pool %r ready: %d questions from %s, run %r",
            DEMO_POOL,
            imported.num_questions,
            source,
            DEMO_RUN,
        )


def demo_questions(path: Path | None) -> tuple[list[s.QuestionCreate], str]:
    """The first distinct questions of the demo file: `path`, else $EXGRPO_DEMO_DATA, else the
    example questions shipped with this package. A missing or unreadable file raises
    `QuestionFileError`."""
    given = path or os.environ.get("EXGRPO_DEMO_DATA")
    if given:
        return _distinct_questions(Path(given)), str(given)
    with resources.as_file(resources.files("exgrpo_cli") / EXAMPLE_QUESTIONS) as example:
        return _distinct_questions(example), "the example questions"


def _distinct_questions(path: Path) -> list[s.QuestionCreate]:
    # evaluation files repeat questions (avg@k); the demo wants distinct ones
    questions: dict[tuple[str, str], s.QuestionCreate] = {}
    for chunk in read_questions(path, batch_size=500):
        for q in chunk:
            questions.setdefault((q.model_dump_json(include={"prompt"}), q.ground_truth), q)
            if len(questions) == DEMO_QUESTIONS:
                return list(questions.values())
    return list(questions.values())
