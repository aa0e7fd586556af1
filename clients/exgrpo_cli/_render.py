"""Output of the CLI: plain JSON on stdout with `--json`, rich tables otherwise; progress bars and
errors on stderr, so stdout stays parseable."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from typing import Annotated, Any

import typer
from pydantic import BaseModel, ValidationError
from rich.console import Console, Group, RenderableType
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

from exgrpo_client import schemas as s
from exgrpo_client.logs import LOG_FORMAT_ENV, LogFormat

JsonOption = Annotated[
    bool, typer.Option("--json", help="Plain JSON on stdout instead of tables (also before the command).")
]
"""The --json option of a command that prints data; `exgrpo --json COMMAND` sets the same."""

LogFormatOption = Annotated[
    LogFormat | None,
    typer.Option(
        "--log-format",
        envvar=LOG_FORMAT_ENV,
        help="Log lines as JSON objects or plain text, the same fields either way (operations.md, Logs).",
        show_default=False,
    ),
]
"""The --log-format option of every command that starts a process (serve, rollout, train, run)."""


def stdout() -> Console:
    # built per call: the console must write to the sys.stdout of the moment (tests swap it)
    return Console(soft_wrap=False)


def stderr() -> Console:
    return Console(stderr=True)


def emit_json(data: Any) -> None:
    if isinstance(data, BaseModel):
        data = data.model_dump(mode="json")
    sys.stdout.write(json.dumps(data, default=str) + "\n")
    sys.stdout.flush()


def show(as_json: bool, data: Any, render: Callable[[], RenderableType]) -> None:
    """`data` as one JSON document with `--json`, else the rich rendering."""
    if as_json:
        emit_json(data)
    else:
        stdout().print(render())


def error_line(e: BaseException) -> str:
    """One line saying what went wrong, without a traceback."""
    if isinstance(e, ValidationError):
        parts = []
        for err in e.errors()[:3]:
            loc = ".".join(str(x) for x in err["loc"])
            parts.append(f"{loc}: {err['msg']}" if loc else err["msg"])
        more = f" (and {e.error_count() - 3} more)" if e.error_count() > 3 else ""
        text = f"invalid {e.title}: " + "; ".join(parts) + more
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split())


def print_error(e: BaseException) -> None:
    stderr().print(f"[bold red]error:[/] {error_line(e)}", markup=True, highlight=False, soft_wrap=True)


# ------------------------------------------------------------------------------------- progress
@contextmanager
def progress_bar(
    description: str, *, total: int | None, unit: str, enabled: bool = True
) -> Iterator[Callable[[int, int | None], None]]:
    """A rich progress bar on stderr, as an SDK `progress(done, total)` callback."""
    if not enabled:
        yield lambda done, total: None
        return
    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn()]
    if unit == "bytes":
        columns += [DownloadColumn(), TransferSpeedColumn()]
    else:
        columns += [MofNCompleteColumn(), TextColumn(unit)]
    with Progress(*columns, TimeElapsedColumn(), console=stderr(), transient=False) as bar:
        task = bar.add_task(description, total=total)

        def update(done: int, new_total: int | None) -> None:
            bar.update(task, completed=done, total=new_total if new_total is not None else total)

        yield update


# --------------------------------------------------------------------------------------- tables
def _when(value: datetime) -> str:
    return value.strftime("%Y-%m-%d %H:%M")


def titled(title: str, table: Table) -> Group:
    """A table under a bold title line (a table's own title wraps to the table's width)."""
    return Group(Text(title, style="bold"), table)


def kv_table(title: str, rows: Mapping[str, Any]) -> Group:
    table = Table(show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    for key, value in rows.items():
        table.add_row(key, _text(value))
    return titled(title, table)


def rows_table(title: str, columns: list[str], rows: list[list[Any]]) -> Group:
    table = Table()
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*(_text(v) for v in row))
    return titled(title, table)


def _text(value: Any) -> str:
    if isinstance(value, datetime):
        return _when(value)
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def pools_table(pools: s.PoolsPublic) -> Group:
    table = Table()
    table.add_column("name", no_wrap=True)
    for col in ("questions", "trajectories", "runs", "K", "batch", "ratio"):
        table.add_column(col, justify="right")
    table.add_column("weighting")
    table.add_column("created", no_wrap=True)
    for p in pools.data:
        c = p.config
        table.add_row(
            p.name,
            str(p.num_questions),
            str(p.num_trajectories),
            str(p.num_runs),
            str(c.k),
            str(c.batch_size),
            f"{c.experience_ratio:g}",
            c.weighting,
            _when(p.created_at),
        )
    return titled(f"{pools.count} pool(s)", table)


def pool_table(p: s.PoolPublic) -> Group:
    rows: dict[str, Any] = {
        "name": p.name,
        "description": p.description or "-",
        "questions": p.num_questions,
        "trajectories": p.num_trajectories,
        "runs": p.num_runs,
        "created": p.created_at,
        "updated": p.updated_at,
    }
    rows.update({f"config.{k}": v for k, v in p.config.model_dump().items()})
    return kv_table(f"pool {p.name}", rows)


def stats_table(st: s.PoolStats) -> Group:
    table = Table()
    table.add_column("run", no_wrap=True)
    table.add_column("phase")
    for col in ("step", "policy", "eligible", "retired", "seen", "trajectories"):
        table.add_column(col, justify="right")
    table.add_column("buckets")
    for r in st.runs:
        buckets = " ".join(f"{b.bucket}:{b.questions}" for b in r.buckets) or "-"
        table.add_row(
            r.run,
            r.phase,
            str(r.step),
            str(r.policy_version),
            str(r.eligible),
            str(r.retired),
            str(r.seen),
            str(r.trajectories),
            buckets,
        )
    title = (
        f"pool {st.pool}: {st.num_questions} questions, {st.num_trajectories} trajectories "
        f"({st.num_tokens} tokens), {st.num_runs} run(s)"
    )
    return titled(title, table)
