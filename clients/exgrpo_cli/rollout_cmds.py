"""`exgrpo rollout` (a rollout worker serving the generation tasks of one or more runs and pools)
and `exgrpo eval` (benchmark evaluation, spec section 9.1). Both need the rollout extra (torch,
transformers, math-verify), or vLLM for `--engine vllm`; they import it only when run.

    exgrpo rollout --pool math --run r1 --model models/base --grader math_think
    exgrpo rollout --pool math --pool code --all-runs --engine vllm
    exgrpo eval --model out/published/v000100 --data test.id.parquet --out samples.jsonl
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, ParamSpec, TypeVar

import typer
import yaml
from pydantic import ValidationError
from rich.table import Table

from exgrpo_cli import _render as render
from exgrpo_client.errors import ExgrpoError

P = ParamSpec("P")
R = TypeVar("R")

Engine = Literal["transformers", "vllm"]


def _friendly(fn: Callable[P, R]) -> Callable[P, R]:
    """Expected failures print one line on stderr and exit with status 1."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except (ExgrpoError, ValidationError, ValueError, OSError, ImportError) as e:
            render.print_error(e)
            raise typer.Exit(1) from None

    return wrapper


def _need_rollout_extra(engine: str) -> None:
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        missing.append("vllm")
    if missing:
        raise ValueError(
            f"missing {', '.join(missing)}: install the rollout extra (pip install 'exgrpo-stack[rollout]'), "
            "and vLLM in its own environment for --engine vllm (docs/rollout.md)"
        )


def _options(items: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--vllm-option {item!r}: expected KEY=VALUE")
        out[key.strip()] = yaml.safe_load(value)
    return out


def _runs_or_all(ctx: typer.Context, param: typer.CallbackParam, value: Any) -> Any:
    """`--run` (repeatable) or `--all-runs`: exactly one of them (checked by whichever of the two
    options is parsed second)."""
    other = "all_runs" if param.name == "run" else "run"
    if ctx.resilient_parsing or other not in ctx.params:
        return value
    runs = value if param.name == "run" else ctx.params["run"]
    all_runs = value if param.name == "all_runs" else ctx.params["all_runs"]
    if runs and all_runs:
        raise typer.BadParameter("give --run R (repeatable) or --all-runs, not both")
    if not runs and not all_runs:
        raise typer.BadParameter("give --run R (repeatable) or --all-runs (every run of the pools)")
    return value


def _ctx_value(ctx: typer.Context, name: str) -> Any:
    # the app callback of exgrpo_cli.main stores url/token/json on ctx.obj
    return getattr(ctx.obj, name, None)


# ------------------------------------------------------------------------------------- rollout
def rollout(
    ctx: typer.Context,
    pool: Annotated[
        list[str],
        typer.Option(
            "--pool", envvar="EXGRPO_POOL", help="Pool to serve (repeatable: claims go to each in turn)."
        ),
    ],
    run: Annotated[
        list[str] | None,
        typer.Option(
            "--run",
            envvar="EXGRPO_RUN",
            callback=_runs_or_all,
            help="Run whose generation tasks to serve (repeatable; the service picks the run of "
            "each claim fairly).",
        ),
    ] = None,
    all_runs: Annotated[
        bool,
        typer.Option(
            "--all-runs", callback=_runs_or_all, help="Serve every run of the pools (instead of --run)."
        ),
    ] = False,
    engine: Annotated[Engine, typer.Option("--engine", help="Generation engine.")] = "transformers",
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            help="Model folder (HF format) to start from; serves runs that published no policy. "
            "Default: the newest policy published by the served runs.",
        ),
    ] = None,
    grader: Annotated[
        str, typer.Option("--grader", help="Reward: math_think, boxed, choice, arithmetic or pkg.mod:fn.")
    ] = "math_think",
    max_tasks: Annotated[
        int | None, typer.Option("--max-tasks", min=1, help="Exit 0 after completing this many tasks.")
    ] = None,
    lease_seconds: Annotated[
        float, typer.Option("--lease-seconds", min=0.1, help="Task lease; renewed every third of it.")
    ] = 120.0,
    worker_id: Annotated[
        str | None, typer.Option("--worker-id", help="Name sent with claims (default host-pid).")
    ] = None,
    tasks_per_claim: Annotated[
        int, typer.Option("--tasks-per-claim", min=1, help="Tasks claimed and generated together.")
    ] = 1,
    idle_exit: Annotated[
        float | None, typer.Option("--idle-exit", help="Exit 0 after this many seconds without tasks.")
    ] = None,
    temperature: Annotated[
        float,
        typer.Option(
            "--temperature", help="Sampling temperature, for tasks that carry no sampling settings."
        ),
    ] = 1.0,
    top_p: Annotated[
        float, typer.Option("--top-p", help="Nucleus sampling threshold, for tasks without settings.")
    ] = 1.0,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", min=1, help="Response length cap, for tasks without settings.")
    ] = 512,
    min_new_tokens: Annotated[
        int,
        typer.Option("--min-new-tokens", min=0, help="Minimum response length, for tasks without settings."),
    ] = 0,
    max_prompt_len: Annotated[
        int, typer.Option("--max-prompt-len", min=1, help="Prompts are cut from the left to this length.")
    ] = 1024,
    drop_system: Annotated[
        bool, typer.Option("--drop-system", help="Drop system messages (training keeps them).")
    ] = False,
    policy_poll: Annotated[
        float,
        typer.Option("--policy-poll", min=0.0, help="Seconds a run's list of published versions is reused."),
    ] = 10.0,
    retry_budget: Annotated[
        float,
        typer.Option(
            "--retry-budget-s",
            min=0.0,
            help="Seconds each pool call keeps retrying through an outage; then it is logged and "
            "the worker goes on.",
        ),
    ] = 600.0,
    heartbeat: Annotated[
        float, typer.Option("--heartbeat", min=0.1, help="Seconds between heartbeats.")
    ] = 30.0,
    backoff_max: Annotated[
        float, typer.Option("--backoff-max", min=0.01, help="Longest sleep when no task is available.")
    ] = 10.0,
    grading_workers: Annotated[
        int, typer.Option("--grading-workers", min=0, help="Grading processes (0: grade in this process).")
    ] = 2,
    grading_timeout: Annotated[
        float, typer.Option("--grading-timeout", min=0.01, help="Seconds per graded sample.")
    ] = 5.0,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            "--metrics-port",
            envvar="EXGRPO_WORKER_METRICS_PORT",
            help="Serve Prometheus metrics on this port.",
        ),
    ] = None,
    metrics_host: Annotated[
        str,
        typer.Option(
            "--metrics-host",
            envvar="EXGRPO_METRICS_HOST",
            help="Address the metrics port binds (127.0.0.1 on a host network).",
        ),
    ] = "0.0.0.0",
    device: Annotated[str | None, typer.Option("--device", help="transformers: cpu, cuda, cuda:1...")] = None,
    dtype: Annotated[
        str | None, typer.Option("--dtype", help="float32, bfloat16, float16 (vllm: auto).")
    ] = None,
    seed: Annotated[
        int | None, typer.Option("--seed", help="Engine seed (default: random per process).")
    ] = None,
    torch_threads: Annotated[
        int | None, typer.Option("--torch-threads", min=1, help="transformers: torch intra-op threads.")
    ] = None,
    vllm_option: Annotated[
        list[str] | None,
        typer.Option("--vllm-option", help="KEY=VALUE passed to vllm.LLM (repeatable).", show_default=False),
    ] = None,
    log_level: Annotated[str, typer.Option("--log-level", help="Log level.")] = "INFO",
    log_format: render.LogFormatOption = None,
) -> None:
    """Serve the generation tasks of runs of one or more pools: claim, load the policy version each
    task names, generate with the task's sampling settings, grade, complete. A pool outage is
    ridden through (each call retries for --retry-budget-s, then it is logged and tried again).

    Logs go to stderr, JSON lines unless --log-format plain. SIGTERM/SIGINT fail the in-flight
    tasks back to the queue and exit 0.
    """
    _friendly(_rollout)(**locals())


def _rollout(ctx: typer.Context, **a: Any) -> None:
    _need_rollout_extra(a["engine"])
    from exgrpo_client.logs import configure_logging
    from exgrpo_rollout.worker import TEST_DELAY_ENV, WorkerConfig, default_worker_id, run_worker

    configure_logging(a["log_format"] or "json", a["log_level"].upper())
    cfg = WorkerConfig(
        pools=list(a["pool"]),
        runs=None if a["all_runs"] else list(a["run"]),
        worker_id=a["worker_id"] or default_worker_id(),
        lease_seconds=a["lease_seconds"],
        tasks_per_claim=a["tasks_per_claim"],
        max_tasks=a["max_tasks"],
        idle_exit_s=a["idle_exit"],
        grader=a["grader"],
        grading_timeout_s=a["grading_timeout"],
        temperature=a["temperature"],
        top_p=a["top_p"],
        max_new_tokens=a["max_new_tokens"],
        min_new_tokens=a["min_new_tokens"],
        max_prompt_len=a["max_prompt_len"],
        drop_system=a["drop_system"],
        policy_poll_s=a["policy_poll"],
        retry_budget_s=a["retry_budget"],
        heartbeat_s=a["heartbeat"],
        backoff_initial_s=min(0.5, a["backoff_max"]),
        backoff_max_s=a["backoff_max"],
        test_delay_s=float(os.environ.get(TEST_DELAY_ENV, "0") or 0),
    )
    code = run_worker(
        cfg,
        engine=a["engine"],
        model=None if a["model"] is None else str(a["model"]),
        url=_ctx_value(ctx, "url"),
        token=_ctx_value(ctx, "token"),
        metrics_port=a["metrics_port"],
        metrics_host=a["metrics_host"],
        grading_workers=a["grading_workers"],
        device=a["device"],
        dtype=a["dtype"],
        seed=a["seed"],
        torch_threads=a["torch_threads"],
        vllm_options=_options(a["vllm_option"]),
    )
    raise typer.Exit(code)


# ---------------------------------------------------------------------------------------- eval
def eval_command(
    ctx: typer.Context,
    model: Annotated[Path, typer.Option("--model", help="Model folder (HF format, with a chat template).")],
    data: Annotated[Path, typer.Option("--data", help="Question file: .parquet (verl layout) or .jsonl.")],
    engine: Annotated[Engine, typer.Option("--engine", help="Generation engine.")] = "transformers",
    limit: Annotated[
        int | None,
        typer.Option(
            "--limit",
            min=1,
            help="Keep the first N rows of EACH data_source (duplicated avg@k rows count as rows).",
        ),
    ] = None,
    grader: Annotated[
        str,
        typer.Option(
            "--grader", help="auto: choice for arc*/gpqa*/mmlu* sources, boxed otherwise; or a grader name."
        ),
    ] = "auto",
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature.")] = 0.6,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling threshold.")] = 1.0,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", min=1, help="Response length cap.")
    ] = 8192,
    min_new_tokens: Annotated[
        int, typer.Option("--min-new-tokens", min=0, help="Minimum response length.")
    ] = 0,
    max_prompt_len: Annotated[
        int | None,
        typer.Option("--max-prompt-len", min=1, help="Cut prompts from the left (default: no cut)."),
    ] = None,
    keep_system: Annotated[
        bool, typer.Option("--keep-system", help="Keep the system message (the protocol drops it).")
    ] = False,
    out: Annotated[Path | None, typer.Option("--out", help="Per-sample results as JSON Lines.")] = None,
    grading_workers: Annotated[
        int, typer.Option("--grading-workers", min=0, help="Grading processes (0: grade in this process).")
    ] = 2,
    grading_timeout: Annotated[
        float, typer.Option("--grading-timeout", min=0.01, help="Seconds per graded sample.")
    ] = 5.0,
    device: Annotated[str | None, typer.Option("--device", help="transformers: cpu, cuda, cuda:1...")] = None,
    dtype: Annotated[
        str | None, typer.Option("--dtype", help="float32, bfloat16, float16 (vllm: auto).")
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Engine seed.")] = 0,
    torch_threads: Annotated[
        int | None, typer.Option("--torch-threads", min=1, help="transformers: torch intra-op threads.")
    ] = None,
    vllm_option: Annotated[
        list[str] | None,
        typer.Option("--vllm-option", help="KEY=VALUE passed to vllm.LLM (repeatable).", show_default=False),
    ] = None,
    as_json: render.JsonOption = False,
) -> None:
    """Evaluate a model on a benchmark file (spec 9.1 protocol).

    avg@k from duplicated rows, accuracy per data_source, unweighted average over data sources;
    system prompt dropped, temperature 0.6, top_p 1.
    """
    _friendly(_eval)(**locals())


def _eval(ctx: typer.Context, **a: Any) -> None:
    _need_rollout_extra(a["engine"])
    from exgrpo_rollout.engines.base import SamplingConfig
    from exgrpo_rollout.engines.factory import load_engine
    from exgrpo_rollout.evaluate import aggregate, evaluate, load_rows, write_jsonl
    from exgrpo_rollout.graders import GradingPool

    as_json = bool(_ctx_value(ctx, "json")) or a["as_json"]
    rows = load_rows(a["data"], a["limit"])
    if not rows:
        raise ValueError(f"{a['data']}: no rows")
    sampling = SamplingConfig(
        temperature=a["temperature"],
        top_p=a["top_p"],
        max_new_tokens=a["max_new_tokens"],
        min_new_tokens=a["min_new_tokens"],
    )
    engine, tokenizer = load_engine(
        a["engine"],
        str(a["model"]),
        device=a["device"],
        dtype=a["dtype"],
        seed=a["seed"],
        torch_threads=a["torch_threads"],
        vllm_options=_options(a["vllm_option"]),
    )
    grading = GradingPool(a["grading_workers"]) if a["grading_workers"] > 0 else None
    try:
        with render.progress_bar("eval", total=len(rows), unit="rows", enabled=not as_json) as bar:
            records = evaluate(
                engine,
                tokenizer,
                rows,
                sampling=sampling,
                grader=a["grader"],
                grading=grading,
                grading_timeout_s=a["grading_timeout"],
                drop_system=not a["keep_system"],
                max_prompt_len=a["max_prompt_len"],
                progress=lambda done: bar(done, None),
            )
    finally:
        if grading is not None:
            grading.close()
    summary = aggregate(records)
    if a["out"] is not None:
        write_jsonl(records, a["out"])
    result = summary.to_dict() | {
        "rows": len(records),
        "samples_file": None if a["out"] is None else str(a["out"]),
    }
    render.show(as_json, result, lambda: _eval_table(summary, str(a["data"])))


def _eval_table(summary: Any, data: str) -> Any:
    from exgrpo_rollout.evaluate import format_accuracy

    table = Table()
    for col, justify in (
        ("benchmark", "left"),
        ("metric", "left"),
        ("rows", "right"),
        ("questions", "right"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    table.add_column("accuracy %", justify="right")
    for b in summary.benchmarks:
        table.add_row(
            b.data_source, b.metric, str(b.num_rows), str(b.num_questions), format_accuracy(b.accuracy)
        )
    table.add_section()
    table.add_row("average (unweighted)", "", "", "", format_accuracy(summary.average), style="bold")
    return render.titled(f"evaluation of {data}", table)


def register(app: typer.Typer) -> None:
    """Add `rollout` and `eval` to the `exgrpo` app."""
    app.command("rollout")(rollout)
    app.command("eval")(eval_command)
