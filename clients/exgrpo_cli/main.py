"""The `exgrpo` command line: run the pool service, and manage pools through the SDK.

    exgrpo serve --anonymous --demo                  # the service on 127.0.0.1:8700
    exgrpo pool create math --k 8 --batch-size 128
    exgrpo questions import train.parquet --pool math
    exgrpo pool stats math --json                    # machine-readable output (or: exgrpo --json pool ...)
    exgrpo train --config exgrpo --nproc 2 model.path=models/m run.pool=math

Client commands talk HTTP through `exgrpo_client.Client`. `serve` and `db` need the server
extra, `train` the train extra; they import it only when run.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, ParamSpec, TypeVar

import typer
import yaml
from pydantic import ValidationError
from rich.console import RenderableType

from exgrpo_cli import _render as render
from exgrpo_cli import model_cmds, rollout_cmds
from exgrpo_client import Client
from exgrpo_client.errors import ExgrpoError
from exgrpo_client.io import read_questions

P = ParamSpec("P")
R = TypeVar("R")

app = typer.Typer(
    name="exgrpo",
    help="ExGRPO experience pool: run the service, manage pools and questions, train.",
    no_args_is_help=True,
    add_completion=False,
)
pool_app = typer.Typer(help="Create, inspect, export and import pools.", no_args_is_help=True)
questions_app = typer.Typer(help="Add questions to a pool.", no_args_is_help=True)
runs_app = typer.Typer(help="Manage the runs of a pool.", no_args_is_help=True)
db_app = typer.Typer(help="Database maintenance (needs the server extra).", no_args_is_help=True)
app.add_typer(pool_app, name="pool")
app.add_typer(questions_app, name="questions")
app.add_typer(runs_app, name="runs")
app.add_typer(db_app, name="db")
rollout_cmds.register(app)
model_cmds.register(app)


@dataclass
class State:
    url: str | None
    token: str | None
    json: bool

    def client(self) -> Client:
        return Client(self.url, token=self.token)


def _state(ctx: typer.Context, as_json: bool = False) -> State:
    """The options of `exgrpo` itself; `as_json`: the command's own --json was given."""
    state = ctx.find_object(State)
    assert state is not None, "the app callback sets the state"
    state.json = state.json or as_json
    return state


def friendly_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Expected failures print one line on stderr and exit with status 1, without a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except (ExgrpoError, ValidationError, ValueError, OSError) as e:
            render.print_error(e)
            raise typer.Exit(1) from None

    return wrapper


@app.callback()
def main(
    ctx: typer.Context,
    url: Annotated[
        str | None,
        typer.Option(envvar="EXGRPO_URL", help="Service URL (default http://127.0.0.1:8700)."),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(envvar="EXGRPO_TOKEN", help="Bearer token.", show_envvar=True, show_default=False),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Plain JSON on stdout instead of tables (also after the command).")
    ] = False,
) -> None:
    ctx.obj = State(url=url, token=token, json=as_json)


# ------------------------------------------------------------------------------------- service
@app.command()
@friendly_errors
def serve(
    ctx: typer.Context,
    host: Annotated[str | None, typer.Option(help="Address to bind (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (default 8700).")] = None,
    database_url: Annotated[
        str | None, typer.Option(help="SQLAlchemy async URL (EXGRPO_DATABASE_URL).")
    ] = None,
    redis_url: Annotated[str | None, typer.Option(help="Redis URL for the sampling index.")] = None,
    anonymous: Annotated[
        bool | None,
        typer.Option(
            "--anonymous/--no-anonymous", help="Serve requests without a token.", show_default=False
        ),
    ] = None,
    demo: Annotated[
        bool, typer.Option("--demo", help="Create a pool `demo` with a run `demo` if it does not exist.")
    ] = False,
    demo_data: Annotated[
        Path | None,
        typer.Option(
            help="Question file of the demo pool (EXGRPO_DEMO_DATA; default: the 48 example questions "
            "shipped with the CLI); its first 200 distinct questions are used."
        ),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Service processes on one socket (EXGRPO_WORKERS, default 1); more than one needs "
            "--redis-url.",
        ),
    ] = None,
    as_json: render.JsonOption = False,
    log_format: render.LogFormatOption = None,
) -> None:
    """Run the pool service. EXGRPO_* variables configure it; flags override them."""
    from exgrpo_cli import _serve

    state = _state(ctx, as_json)
    settings = _serve.build_settings(
        host=host,
        port=port,
        database_url=database_url,
        redis_url=redis_url,
        allow_anonymous=anonymous,
        log_format=log_format,
        workers=workers,
    )
    # the settings: a table in plain logs, one JSON line with --json, else a log record (so that
    # every line of a json-logging service is a record)
    shown = settings.log_format == "plain" or state.json
    if shown:
        public = settings.public_dict()
        render.show(state.json, public, lambda: render.kv_table("settings", public))
    _serve.serve(settings, demo=demo, demo_data=demo_data, log_settings=not shown)


@db_app.command("upgrade")
@friendly_errors
def db_upgrade(
    ctx: typer.Context,
    database_url: Annotated[
        str | None, typer.Option(envvar="EXGRPO_DATABASE_URL", help="SQLAlchemy async URL.")
    ] = None,
    as_json: render.JsonOption = False,
) -> None:
    """Apply the database migrations (alembic upgrade head)."""
    from exgrpo_cli import _serve

    url = _serve.database_url(database_url)
    _serve.upgrade(url)
    result = {"database_url": _serve.mask_url(url), "revision": "head"}
    render.show(
        _state(ctx, as_json).json,
        result,
        lambda: f"database {result['database_url']} is at the latest revision",
    )


@db_app.command("tallies")
@friendly_errors
def db_tallies(
    ctx: typer.Context,
    repair: Annotated[
        bool, typer.Option(help="Set the cells that differ to the counts of their rows.")
    ] = False,
    database_url: Annotated[
        str | None, typer.Option(envvar="EXGRPO_DATABASE_URL", help="SQLAlchemy async URL.")
    ] = None,
    as_json: render.JsonOption = False,
) -> None:
    """Check the tallies that stats read (questions, states, trajectories per pool and run)
    against counts of their rows; exit status 1 when a cell differs and --repair was not given.
    Counts every row (seconds at 1M questions); safe while the service runs."""
    from exgrpo_cli import _serve

    url = _serve.database_url(database_url)
    drift = _serve.check_tallies(url, repair=repair)
    result = {"database_url": _serve.mask_url(url), "cells_off": drift, "repaired": repair and bool(drift)}

    def table() -> RenderableType:
        if not drift:
            return f"database {result['database_url']}: every tally agrees with its rows"
        cells = f"{len(drift)} tally cell" + ("s" if len(drift) != 1 else "")
        title = f"{cells} differed from their rows" + (
            ", now set to the counts" if repair else " (--repair sets them to the counts)"
        )
        return render.rows_table(
            title,
            ["tally", "cell", "kept", "counted"],
            [[d["tally"], _pairs(d["cell"]), _pairs(d["kept"]), _pairs(d["counted"])] for d in drift],
        )

    render.show(_state(ctx, as_json).json, result, table)
    if drift and not repair:
        raise typer.Exit(1)


def _pairs(values: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in values.items())


# ------------------------------------------------------------------------------------ training
@app.command()
@friendly_errors
def train(
    ctx: typer.Context,
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            help="Trainer settings (YAML), or a shipped recipe: exgrpo, grpo. Unset fields keep defaults.",
        ),
    ] = None,
    nproc: Annotated[
        int, typer.Option("--nproc", min=1, help="Processes (one per GPU); above 1 runs under torchrun.")
    ] = 1,
    takeover: Annotated[
        bool,
        typer.Option(
            "--takeover",
            help="Take the run over from the trainer that owns it (run.takeover=true); that one stops.",
        ),
    ] = False,
    log_format: render.LogFormatOption = None,
    overrides: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[KEY=VALUE]...",
            help="Settings that replace the file's, e.g. optim.lr=2e-6 experience.enabled=false.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Train a policy against a pool (needs the train extra).

    --url/--token (EXGRPO_URL/EXGRPO_TOKEN) replace run.pool_url/run.token; KEY=VALUE wins over all.
    A run another trainer owns is refused (exit status 3) unless --takeover.
    """
    if importlib.util.find_spec("torch") is None:
        raise ValueError("training needs the train extra: pip install 'exgrpo-stack[train]'")
    from exgrpo_trainer.config import load_config

    state = _state(ctx)
    given = ([f"run.pool_url={state.url}"] if state.url else []) + (["run.token=null"] if state.token else [])
    items = given + list(overrides or []) + (["run.takeover=true"] if takeover else [])
    cfg = load_config(config, items)  # fails here, before any process starts
    if state.token:
        os.environ["EXGRPO_TOKEN"] = state.token  # read by the trainer's client, kept off argv
    if nproc == 1:
        from exgrpo_trainer.cli import run as run_trainer

        run_trainer(cfg, log_format)
        return
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    command += ["-m", "exgrpo_trainer", *(["--config", config] if config else [])]
    command += [*(["--log-format", log_format] if log_format else []), *items]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, command)


@app.command("run")
@friendly_errors
def run_job(
    quick: Annotated[
        bool, typer.Option("--quick", help="About a minute end to end (for tests and a first look).")
    ] = False,
    recipe: Annotated[
        Path | None,
        typer.Option(help="One-box recipe file (default: cpu_demo, or cpu_demo_quick with --quick)."),
    ] = None,
    model: Annotated[
        Path | None, typer.Option(help="Hugging Face model folder (default: the warm-started tiny model).")
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option(help="Questions (verl/ExGRPO parquet or JSONL); default: synthetic arithmetic."),
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Run folder (default exgrpo-data/runs/<time>).")] = None,
    serve: Annotated[bool, typer.Option("--serve", help="Keep the pool service up at the end.")] = False,
    grpo: Annotated[bool, typer.Option("--grpo", help="Plain on-policy GRPO instead of ExGRPO.")] = False,
    seed: Annotated[
        int | None, typer.Option(help="Seed of data, run and sampling (run.seed).", show_default="0")
    ] = None,
    heldout: Annotated[
        int | None, typer.Option(min=1, help="Held-out questions to evaluate on.", show_default="128")
    ] = None,
    rollouts: Annotated[
        int | None,
        typer.Option(min=1, help="Rollout budget: stop after this many generated rollouts, not run.steps."),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Rollout worker processes generating every batch against the embedded service "
            "(rollout.engine=remote); 0: the trainer generates.",
            show_default="0",
        ),
    ] = None,
    max_policy_lag: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="With --workers: 0 synchronous (exact), N >= 1 asynchronous generation at most N "
            "policy versions behind (rollout.max_policy_lag).",
            show_default="0",
        ),
    ] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[KEY=VALUE]...",
            help="Trainer settings (run.steps=20, experience.batch_size=8), pool rules (pool.k=4, "
            "pool.weighting=uniform), job sizes (job.train_questions=500, job.eval_every=5).",
            show_default=False,
        ),
    ] = None,
    log_format: render.LogFormatOption = None,
) -> None:
    """The main job: embedded pool service, warm-started model, ExGRPO training with held-out
    evaluation before and after, a report with plots. Needs no services and no arguments."""
    if importlib.util.find_spec("torch") is None:
        raise ValueError(
            "the main job needs the train extra: pip install 'exgrpo-stack[server,train,rollout]'"
        )
    from exgrpo_client.logs import configure_logging
    from exgrpo_onebox.main_job import MainJobOptions, run_main_job

    configure_logging(log_format or "plain")

    run_main_job(
        MainJobOptions(
            quick=quick,
            recipe=recipe,
            model=model,
            data=data,
            out=out,
            serve=serve,
            grpo=grpo,
            seed=seed,
            heldout=heldout,
            rollouts=rollouts,
            workers=workers,
            max_policy_lag=max_policy_lag,
            overrides=list(overrides or []),
        )
    )


@app.command("prepare")
@friendly_errors
def prepare(
    ctx: typer.Context,
    model_out: Annotated[
        Path, typer.Option("--model-out", help="Folder of the warm-started tiny model (built once).")
    ],
    quick: Annotated[
        bool, typer.Option("--quick", help="The quick recipe and its smaller warm start.")
    ] = False,
    recipe: Annotated[
        Path | None,
        typer.Option(help="One-box recipe file (default: cpu_demo, or cpu_demo_quick with --quick)."),
    ] = None,
    pool: Annotated[str, typer.Option("--pool", envvar="EXGRPO_POOL", help="Pool to create.")] = "main",
    run: Annotated[str, typer.Option("--run", envvar="EXGRPO_RUN", help="Run to create.")] = "exgrpo",
    overrides: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[KEY=VALUE]...",
            help="Recipe settings: experience.start_threshold=0.1, pool.k=4, job.train_questions=500.",
            show_default=False,
        ),
    ] = None,
    as_json: render.JsonOption = False,
) -> None:
    """Prepare a running service for the one-box recipe: the warm-started tiny model, a pool of
    synthetic arithmetic questions with the recipe's rules, and the run (the compose `cpu` profile's
    init job). What exists already is kept."""
    if importlib.util.find_spec("torch") is None:
        raise ValueError("prepare needs the train extra: pip install 'exgrpo-stack[train,rollout]'")
    from exgrpo_onebox.config import MainJobOptions
    from exgrpo_onebox.prepare import prepare_service  # no server extra needed: runs in the trainer image

    state = _state(ctx, as_json)
    opts = MainJobOptions(
        quick=quick,
        recipe=recipe,
        overrides=[f"run.pool={pool}", f"run.name={run}", *(overrides or [])],
    )
    with state.client() as client:
        done = prepare_service(client, opts, model_out)
    facts = {
        "model": str(done.model),
        "pool": done.pool,
        "run": done.run,
        "questions": done.questions,
        "pool_created": done.created,
    }
    render.show(state.json, facts, lambda: render.kv_table("prepared", facts))


@app.command("experiment")
@friendly_errors
def experiment(
    out: Annotated[Path, typer.Option(help="Experiment folder.")] = Path("exgrpo-data/experiment"),
    seeds: Annotated[
        str, typer.Option(help="Seeds of every arm: N (0..N-1), a list 3,4,5 or a range 10-14.")
    ] = "3",
    family: Annotated[
        str | None,
        typer.Option(help="Synthetic task family of every run: arithmetic (default) or calibrated."),
    ] = None,
    arms: Annotated[
        str,
        typer.Option(
            help="Comma-separated arms: grpo, exgrpo, choice-random, buckets-uniform, "
            "ratio-0.25, ratio-0.75, no-delayed-start, delayed-start-0.6, shaping-beta-1 (default: all)."
        ),
    ] = "all",
    rollouts: Annotated[int, typer.Option(min=1, help="Rollout budget of every run.")] = 7680,
    heldout: Annotated[int, typer.Option(min=1, help="Held-out questions per evaluation.")] = 512,
    jobs: Annotated[int, typer.Option(min=1, help="Runs at a time (one torch thread each).")] = 1,
    quick: Annotated[bool, typer.Option("--quick", help="The --quick main job in every arm.")] = False,
    report_only: Annotated[
        bool, typer.Option("--report-only", help="Only rebuild the table and plots from finished runs.")
    ] = False,
    overrides: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[KEY=VALUE]...", help="Passed to every run (see `exgrpo run`).", show_default=False
        ),
    ] = None,
) -> None:
    """GRPO vs ExGRPO at equal rollout budgets over several seeds, plus the paper's ablations
    (trajectory choice, bucket weights, experience ratio, delayed start): a table and learning curves."""
    if importlib.util.find_spec("torch") is None:
        raise ValueError(
            "the experiment needs the train extra: pip install 'exgrpo-stack[server,train,rollout]'"
        )
    from exgrpo_onebox.experiment import ARM_NAMES, ExperimentOptions, parse_seeds, run_experiment

    chosen = ARM_NAMES if arms == "all" else tuple(a.strip() for a in arms.split(",") if a.strip())
    run_experiment(
        ExperimentOptions(
            out=out,
            seeds=parse_seeds(seeds),
            family=family,
            arms=chosen,
            rollouts=rollouts,
            heldout=heldout,
            jobs=jobs,
            quick=quick,
            report_only=report_only,
            overrides=list(overrides or []),
        )
    )


# --------------------------------------------------------------------------------------- pools
def _config_file(path: Path) -> tuple[dict[str, Any], str | None]:
    """Pool rules from a YAML/JSON file: the PoolConfig fields, or {config, description}."""
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of pool config fields")
    if isinstance(data.get("config"), dict):
        return dict(data["config"]), data.get("description")
    return data, None


@pool_app.command("create")
@friendly_errors
def pool_create(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Pool name (letters, digits, _ . -).")],
    k: Annotated[int | None, typer.Option("--k", help="Rollouts per question.", show_default="8")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Questions per step.", show_default="128")] = None,
    experience_ratio: Annotated[
        float | None, typer.Option(help="Share of replayed questions.", show_default="0.5")
    ] = None,
    weighting: Annotated[
        Literal["normal", "linear", "sqrt", "linear_clip", "uniform"] | None,
        typer.Option(help="Bucket weighting of replay sampling.", show_default="normal"),
    ] = None,
    sharing: Annotated[
        Literal["per_run", "pooled", "shared_trajectories"] | None,
        typer.Option(
            help="What the pool's runs share: nothing (per_run), buckets, retirement and trajectories "
            "(pooled), or trajectories only (shared_trajectories).",
            show_default="per_run",
        ),
    ] = None,
    max_trajectories_per_question: Annotated[
        int | None,
        typer.Option(help="Keep the newest N stored trajectories per question.", show_default="no limit"),
    ] = None,
    max_payload_bytes: Annotated[
        int | None,
        typer.Option(
            help="Evict the oldest trajectories beyond this many payload bytes.", show_default="no limit"
        ),
    ] = None,
    config: Annotated[
        Path | None, typer.Option("--config", help="YAML or JSON file of pool rules (flags override it).")
    ] = None,
    description: Annotated[str | None, typer.Option(help="Free text.")] = None,
    as_json: render.JsonOption = False,
) -> None:
    """Create a pool."""
    rules, file_description = _config_file(config) if config is not None else ({}, None)
    flags = {
        "k": k,
        "batch_size": batch_size,
        "experience_ratio": experience_ratio,
        "weighting": weighting,
        "sharing": sharing,
        "max_trajectories_per_question": max_trajectories_per_question,
        "max_payload_bytes": max_payload_bytes,
    }
    rules.update({key: value for key, value in flags.items() if value is not None})
    with _state(ctx, as_json).client() as client:
        pool = client.create_pool(name, rules, description or file_description or "")
    render.show(_state(ctx).json, pool, lambda: render.pool_table(pool))


@pool_app.command("list")
@friendly_errors
def pool_list(ctx: typer.Context, as_json: render.JsonOption = False) -> None:
    """List the pools."""
    with _state(ctx, as_json).client() as client:
        pools = client.list_pools()
    render.show(_state(ctx).json, pools, lambda: render.pools_table(pools))


@pool_app.command("show")
@friendly_errors
def pool_show(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Pool name.")],
    as_json: render.JsonOption = False,
) -> None:
    """Show a pool and its rules."""
    with _state(ctx, as_json).client() as client:
        pool = client.get_pool(name)
    render.show(_state(ctx).json, pool, lambda: render.pool_table(pool))


@pool_app.command("stats")
@friendly_errors
def pool_stats(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Pool name.")],
    as_json: render.JsonOption = False,
) -> None:
    """Counts of a pool, and per run: phase, step, buckets, retired questions."""
    with _state(ctx, as_json).client() as client:
        stats = client.pool_stats(name)
    render.show(_state(ctx).json, stats, lambda: render.stats_table(stats))


def _confirm(yes: bool, what: str) -> None:
    if not yes and not typer.confirm(f"{what}? This cannot be undone", err=True):
        raise typer.Exit(1)


@pool_app.command("delete")
@friendly_errors
def pool_delete(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Pool name.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    force: Annotated[bool, typer.Option(help="Delete even while trainers hold leases of its runs.")] = False,
    as_json: render.JsonOption = False,
) -> None:
    """Delete a pool and everything in it: questions, runs, states, trajectories (admin)."""
    state = _state(ctx, as_json)
    _confirm(yes, f"delete pool {name!r} and everything in it")
    with state.client() as client:
        client.delete_pool(name, force=force)
    result = {"deleted": "pool", "pool": name}
    render.show(state.json, result, lambda: render.kv_table(f"deleted pool {name}", result))


@runs_app.command("list")
@friendly_errors
def runs_list(
    ctx: typer.Context,
    pool: Annotated[str, typer.Argument(help="Pool name.")],
    as_json: render.JsonOption = False,
) -> None:
    """The runs of a pool."""
    with _state(ctx, as_json).client() as client:
        runs = client.list_runs(pool)
    rows = {r.name: f"{r.phase}, step {r.step}, policy version {r.policy_version}" for r in runs.data}
    render.show(_state(ctx).json, runs, lambda: render.kv_table(f"runs of {pool}", rows))


@runs_app.command("delete")
@friendly_errors
def runs_delete(
    ctx: typer.Context,
    pool: Annotated[str, typer.Argument(help="Pool name.")],
    run: Annotated[str, typer.Argument(help="Run name.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    force: Annotated[bool, typer.Option(help="Delete even while a trainer holds its lease.")] = False,
    as_json: render.JsonOption = False,
) -> None:
    """Delete a run: its states, own trajectories, batches, tasks and metrics (admin)."""
    state = _state(ctx, as_json)
    _confirm(yes, f"delete run {run!r} of pool {pool!r}")
    with state.client() as client:
        client.delete_run(pool, run, force=force)
    result = {"deleted": "run", "pool": pool, "run": run}
    render.show(state.json, result, lambda: render.kv_table(f"deleted run {run} of {pool}", result))


NDJSON_SUFFIXES = (".ndjson", ".jsonl", ".json")
"""File names that get an NDJSON export unless --format says otherwise."""


ExportFormat = Literal["ndjson", "binary"]


def export_format(file: Path, given: ExportFormat | None) -> ExportFormat:
    """--format, or by the file's name: NDJSON for .ndjson, .jsonl and .json, else binary."""
    if given is not None:
        return given
    return "ndjson" if file.suffix.lower() in NDJSON_SUFFIXES else "binary"


@pool_app.command("export")
@friendly_errors
def pool_export(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Pool name.")],
    file: Annotated[Path, typer.Argument(help="Where to write the export.")],
    fmt: Annotated[
        ExportFormat | None,
        typer.Option(
            "--format",
            help="ndjson (one JSON record a line, payloads as base64: jq and other languages read it) "
            "or binary (msgpack records, payloads as raw buffers: smaller and faster). Default: ndjson "
            "for a file named *.ndjson, *.jsonl or *.json, binary otherwise.",
            show_default=False,
        ),
    ] = None,
    as_json: render.JsonOption = False,
) -> None:
    """Export a pool (questions, runs, states, trajectories) to a file; `pool import` reads both
    formats."""
    state = _state(ctx, as_json)
    form = export_format(file, fmt)
    with (
        state.client() as client,
        render.progress_bar(f"export {name}", total=None, unit="bytes", enabled=not state.json) as progress,
    ):
        exported = client.export_pool(name, file, progress, binary=form == "binary")
    h = exported.header
    result = {
        "pool": h.pool.name,
        "path": str(file),
        "format": form,
        "num_bytes": exported.num_bytes,
        "num_questions": h.num_questions,
        "num_trajectories": h.num_trajectories,
        "num_runs": h.num_runs,
    }
    render.show(state.json, result, lambda: render.kv_table(f"exported pool {h.pool.name}", result))


@pool_app.command("import")
@friendly_errors
def pool_import(
    ctx: typer.Context,
    file: Annotated[
        Path, typer.Argument(help="An export written by `exgrpo pool export` (NDJSON or binary).")
    ],
    name: Annotated[str | None, typer.Option(help="Import under this name instead.")] = None,
    as_json: render.JsonOption = False,
) -> None:
    """Create a pool from an export file (in one transaction: all or nothing)."""
    state = _state(ctx, as_json)
    total = file.stat().st_size
    with (
        state.client() as client,
        render.progress_bar(
            f"import {file.name}", total=total, unit="bytes", enabled=not state.json
        ) as progress,
    ):
        imported = client.import_pool(file, name, progress)
    render.show(
        state.json, imported, lambda: render.kv_table(f"imported pool {imported.pool}", imported.model_dump())
    )


# ----------------------------------------------------------------------------------- questions
@questions_app.command("import")
@friendly_errors
def questions_import(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="Parquet (verl/ExGRPO layout), JSONL or JSON file.")],
    pool: Annotated[str, typer.Option(help="Pool to add the questions to.")],
    limit: Annotated[int | None, typer.Option(min=0, help="Import only the first N rows.")] = None,
    chunk_size: Annotated[int, typer.Option(min=1, max=50_000, help="Questions per request.")] = 2000,
    as_json: render.JsonOption = False,
) -> None:
    """Add questions from a file. Every row is checked first, with the service's own models, so a
    bad row anywhere leaves the pool as it was; then the questions go out in requests of
    --chunk-size. Questions already in the pool are skipped, so re-running an import that stopped
    midway (network, service) finishes it."""
    state = _state(ctx, as_json)
    # the whole file is read and validated before the first request (a second read sends it)
    total = sum(len(chunk) for chunk in read_questions(file, batch_size=chunk_size, limit=limit))
    questions = itertools.chain.from_iterable(read_questions(file, batch_size=chunk_size, limit=limit))
    with (
        state.client() as client,
        render.progress_bar(
            f"import {file.name}", total=total, unit="questions", enabled=not state.json
        ) as progress,
    ):
        result = client.import_questions(pool, questions, chunk_size, progress)
    render.show(
        state.json, result, lambda: render.kv_table(f"questions imported into {pool}", result.model_dump())
    )


def run() -> None:  # pragma: no cover - console entry for `python -m exgrpo_cli.main`
    app()


if __name__ == "__main__":  # pragma: no cover
    run()
