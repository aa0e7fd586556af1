"""Settings of the one-box job: one typed config, one owner per setting, every layer resolved here.

A one-box recipe (`recipes/cpu_demo.yaml`) is a trainer config (the sections of
`exgrpo_trainer.TrainConfig`) plus two sections of its own:

    pool:  the pool's own rules, the SDK's `PoolConfig`: K, collection bounds, bucket weighting, ...
    job:   the job's sizes: training and held-out questions, evaluation points and sampling, budget

Each setting has one owner; what other components need is derived from it here, once:

    experience.ratio / start_threshold / batch_size   the run's rules: the run on the service gets
    / max_replay_age                                  them (`TrainConfig.run_overrides`), and the
                                                      pool is created with the same values
    pool.k                                            K: the trainer reads it from the pool
    rollout.max_new_tokens                            also loss.max_response_len (trainer config) and
                                                      job.eval_max_new_tokens, unless set
    experience.enabled                                also the default run name (exgrpo / grpo)
    job.workers                                       also rollout.engine: remote with workers,
                                                      unless given (then it must be remote)

Layers, later wins: the recipe file, the command line's flags (`--seed`, `--out`, `--model`,
`--grpo`, `--heldout`, `--rollouts`), settings given as data (an experiment arm's), then
`key=value` overrides. `resolve` merges them and returns the one config every part of the job reads.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from exgrpo_client import PoolConfig
from exgrpo_onebox.synthetic import get_family
from exgrpo_rollout.engines.base import SamplingConfig
from exgrpo_rollout.graders.registry import get_grader
from exgrpo_trainer import TrainConfig, apply_overrides

RECIPES = Path(__file__).resolve().parent / "recipes"
"""The one-box job's recipes: `cpu_demo` (default) and `cpu_demo_quick` (`--quick`)."""

RUN_RULES = {
    "ratio": "experience_ratio",
    "start_threshold": "start_threshold",
    "batch_size": "batch_size",
    "max_replay_age": "max_replay_age",
}
"""Batch-level rules of the run (`experience.<key>`) and the pool fields that mirror them."""

MOVED = {"job.pool_k": "pool.k", "job.pool_batch_size": "experience.batch_size"}
"""Former names of settings that have another owner now."""

JOB_SET = {"run.pool_url": "the embedded service's address", "run.token": "the embedded service is open"}
"""Trainer settings the job sets itself."""


class JobSection(BaseModel):
    """Sizes of the one-box job (the recipe's `job:` section)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)

    train_questions: int = Field(2000, ge=1)
    """Training questions imported into the pool (synthetic, or from --data after the held-out rows)."""
    heldout_questions: int = Field(128, ge=1)
    """Held-out questions evaluated before, during and after training (`--heldout`)."""
    eval_every: int = Field(10, ge=1)
    """Evaluate every N steps, or with a rollout budget every N * K * B generated rollouts."""
    eval_temperature: float = Field(0.6, gt=0)
    """Sampling temperature of the held-out evaluation (training samples at rollout.temperature)."""
    eval_max_new_tokens: int | None = Field(None, ge=1)
    """Longest evaluated response; unset: rollout.max_new_tokens."""
    eval_grader: str = "auto"
    """Grader of the held-out evaluation: `auto` (`choice` for multiple-choice sources, `boxed`
    otherwise: `exgrpo_rollout.evaluate.grader_for`) or a grader name for every row."""
    rollouts: int | None = Field(None, ge=1)
    """Rollout budget (`--rollouts`): the run ends on the step that reaches it, and run.steps defaults
    to just past it."""
    workers: int = Field(0, ge=0, le=64)
    """Rollout worker processes (`--workers`): 0, the trainer generates (rollout.engine=colocated);
    N >= 1, N `exgrpo rollout` processes against the embedded service generate every batch
    (rollout.engine=remote, synchronous unless rollout.max_policy_lag says otherwise)."""
    worker_engine: Literal["transformers", "vllm"] = "transformers"
    """Generation engine of the rollout workers (`--workers`): transformers, or vllm (vLLM installed,
    a GPU; the workers share it with the trainer, so give job.worker_vllm.gpu_memory_utilization)."""
    worker_vllm: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """With worker_engine=vllm: keyword settings of `vllm.LLM` in each worker, e.g.
    job.worker_vllm.gpu_memory_utilization=0.3 job.worker_vllm.max_model_len=2048."""
    family: str = "arithmetic"
    """Synthetic task family of the training and held-out questions (`exgrpo_onebox.synthetic.FAMILIES`):
    `arithmetic` or `calibrated`; not used with --data."""

    @field_validator("eval_grader")
    @classmethod
    def _known_grader(cls, value: str) -> str:
        if value != "auto":
            get_grader(value)  # ValueError naming the built-in graders
        return value

    @field_validator("family")
    @classmethod
    def _known_family(cls, value: str) -> str:
        get_family(value)  # ValueError naming the known families
        return value


class OneBoxConfig(TrainConfig):
    """The trainer's settings with the job's `pool` and `job` sections; it is what the trainer gets,
    so the `config.yaml` it writes is the whole effective config of the job."""

    pool: PoolConfig = Field(default_factory=PoolConfig)
    """The pool's own rules; its batch-level rules are the run's (experience.*), copied in here."""
    job: JobSection = Field(default_factory=JobSection)

    @model_validator(mode="before")
    @classmethod
    def _derive(cls, data: Any) -> Any:
        """Fill what is derived from an owner; a derived setting given with another value is an error
        that names the owner."""
        if not isinstance(data, dict):
            return data
        sections = {k: _plain(v) for k, v in data.items()}
        exp, pool, job = (dict(sections.get(k) or {}) for k in ("experience", "pool", "job"))
        run, rollout = dict(sections.get("run") or {}), dict(sections.get("rollout") or {})
        for key, pool_key in RUN_RULES.items():
            value = exp.get(key)
            if value is None:
                value = PoolConfig.model_fields[pool_key].default
            if pool_key in pool and pool[pool_key] != value:
                raise ValueError(
                    f"pool.{pool_key} is the run's experience.{key} ({value}): set experience.{key}"
                )
            exp[key] = pool[pool_key] = value
        if job.get("eval_max_new_tokens") is None:
            job["eval_max_new_tokens"] = rollout.get("max_new_tokens", TrainConfig().rollout.max_new_tokens)
        workers = job.get("workers") or 0
        if workers and rollout.get("engine", "colocated") != "remote":
            raise ValueError(
                f"job.workers={workers} generates with rollout workers: set rollout.engine=remote"
            )
        if not workers and rollout.get("max_policy_lag"):
            raise ValueError(
                "rollout.max_policy_lag (asynchronous generation) needs rollout workers: --workers N"
            )
        if not workers and job.get("worker_engine", "transformers") != "transformers":
            raise ValueError(f"job.worker_engine={job['worker_engine']} is the workers' engine: --workers N")
        if job.get("worker_vllm") and job.get("worker_engine", "transformers") != "vllm":
            raise ValueError("job.worker_vllm are vLLM settings: set job.worker_engine=vllm")
        if not workers and rollout.get("engine") == "remote":
            raise ValueError("rollout.engine=remote in the one-box job needs its workers: --workers N")
        run.setdefault("pool", "main")
        run.setdefault("name", "exgrpo" if exp.get("enabled", True) else "grpo")
        return {**sections, "experience": exp, "pool": pool, "job": job, "run": run}

    @property
    def rollouts_per_eval(self) -> int:
        """Generated rollouts between evaluations under a rollout budget: eval_every * K * B."""
        return self.job.eval_every * self.pool.k * self._batch_size()

    def _batch_size(self) -> int:
        b = self.experience.batch_size
        assert b is not None  # filled by _derive
        return b

    def eval_sampling(self, seed: int) -> SamplingConfig:
        """Sampling of the held-out evaluation."""
        assert self.job.eval_max_new_tokens is not None  # filled from rollout.max_new_tokens
        return SamplingConfig(
            temperature=self.job.eval_temperature,
            top_p=1.0,
            max_new_tokens=self.job.eval_max_new_tokens,
            seed=seed,
        )

    def budget_steps(self) -> int | None:
        """With a rollout budget, a step cap just past it: the hook ends the run, and a step
        generates at least B * (K - 1) rollouts."""
        if self.job.rollouts is None:
            return None
        per_step = self._batch_size() * (self.pool.k - 1)
        return -(-self.job.rollouts // per_step) + 1


def _plain(value: Any) -> Any:
    return value.model_dump() if isinstance(value, BaseModel) else value


@dataclass
class MainJobOptions:
    """What `exgrpo run` takes: command-line flags, settings as data and `key=value` overrides."""

    quick: bool = False
    """About a minute end to end: the quick recipe and the smaller warm start."""
    recipe: Path | None = None
    """A one-box recipe file; default: recipes/cpu_demo.yaml (cpu_demo_quick.yaml with `quick`)."""
    model: Path | None = None
    """model.path: a Hugging Face model folder; default: the warm-started tiny model (built and cached)."""
    data: Path | None = None
    """Questions in the verl/ExGRPO parquet layout or JSONL; default: synthetic arithmetic."""
    out: Path | None = None
    """run.output_dir; default exgrpo-data/runs/<time>."""
    serve: bool = False
    """Keep the pool service up at the end (Ctrl-C stops it)."""
    grpo: bool = False
    """experience.enabled = false: plain on-policy GRPO."""
    seed: int | None = None
    """run.seed: also the data split and the run's draws on the service."""
    heldout: int | None = None
    """job.heldout_questions."""
    rollouts: int | None = None
    """job.rollouts: the rollout budget."""
    workers: int | None = None
    """job.workers: rollout worker processes (0: the trainer generates)."""
    max_policy_lag: int | None = None
    """rollout.max_policy_lag: with workers, 0 synchronous (default), N >= 1 asynchronous."""
    settings: Mapping[str, Any] = field(default_factory=dict)
    """Settings as nested data, e.g. {"experience": {"ratio": 0.25}} (an experiment arm's)."""
    overrides: list[str] = field(default_factory=list)
    """`key=value` settings, e.g. experience.ratio=0.25, pool.weighting=uniform, job.eval_every=5."""
    cache: Path = Path("exgrpo-data/cache")


@dataclass(frozen=True)
class ResolvedJob:
    config: OneBoxConfig
    """The effective settings: every part of the job reads these."""
    warm_start: bool
    """model.path is the cached warm-started model (built on first use), not a given folder."""


def default_recipe(quick: bool) -> Path:
    return RECIPES / ("cpu_demo_quick.yaml" if quick else "cpu_demo.yaml")


def read_recipe(path: Path) -> dict[str, Any]:
    """A recipe file's sections as data."""
    if not path.is_file():
        raise FileNotFoundError(f"recipe {path}: no such file")
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if data is not None and not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of sections at the top level")
    return dict(data or {})


def warm_start_path(opts: MainJobOptions) -> Path:
    return (opts.cache / ("warmstart-quick" if opts.quick else "warmstart")).resolve()


def _flags(opts: MainJobOptions) -> dict[str, Any]:
    """The command line's flags as settings."""
    run: dict[str, Any] = {}
    if opts.seed is not None:
        run["seed"] = opts.seed
    if opts.out is not None:
        run["output_dir"] = opts.out
    flags: dict[str, Any] = {"run": run}
    if opts.model is not None:
        flags["model"] = {"path": opts.model}
    if opts.grpo:
        flags["experience"] = {"enabled": False}
    if opts.max_policy_lag is not None:
        flags["rollout"] = {"max_policy_lag": opts.max_policy_lag}
    job = {"heldout_questions": opts.heldout, "rollouts": opts.rollouts, "workers": opts.workers}
    flags["job"] = {k: v for k, v in job.items() if v is not None}
    return flags


def _merge(base: dict[str, Any], layer: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in layer.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def _keys(data: Mapping[str, Any], prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for key, value in data.items():
        name = f"{prefix}{key}"
        keys |= _keys(value, f"{name}.") if isinstance(value, Mapping) else {name}
    return keys


def resolve(opts: MainJobOptions) -> ResolvedJob:
    """The effective settings of a run: the recipe, then the flags, then `opts.settings`, then the
    `key=value` overrides. Bad or misplaced settings fail here, before anything starts (ValueError,
    or pydantic's ValidationError naming the setting)."""
    recipe = read_recipe(opts.recipe or default_recipe(opts.quick))
    given = _merge(dict(opts.settings), apply_overrides({}, list(opts.overrides)))
    for key in sorted(_keys(given) | _keys(recipe)):
        if key in MOVED:
            raise ValueError(f"{key}: the one-box job's setting is {MOVED[key]}")
    for key in sorted(_keys(given)):
        if key in JOB_SET:
            raise ValueError(f"{key}: set by the one-box job ({JOB_SET[key]})")
    data = _merge(_merge(recipe, _flags(opts)), given)
    if (data.get("job") or {}).get("workers") and "rollout.engine" not in _keys(given):
        data = _merge(data, {"rollout": {"engine": "remote"}})  # the recipe's engine is the colocated one
    run, model = dict(data.get("run") or {}), dict(data.get("model") or {})
    out = run.get("output_dir") or Path("exgrpo-data/runs") / time.strftime("%Y%m%d-%H%M%S")
    run["output_dir"] = Path(out).resolve()
    warm_start = model.get("path") is None
    model["path"] = warm_start_path(opts) if warm_start else Path(model["path"]).resolve()
    cfg = OneBoxConfig.model_validate({**data, "run": run, "model": model})
    steps = cfg.budget_steps()
    if steps is not None and "run.steps" not in _keys(given):
        cfg.run.steps = steps
    return ResolvedJob(cfg, warm_start)
