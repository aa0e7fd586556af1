"""Trainer configuration: a tree of sections, from YAML plus `key=value` overrides.

    exgrpo train --config run.yaml optim.lr=2e-6 experience.enabled=false
    exgrpo train --config exgrpo model.path=... run.pool=math      # a recipe shipped in recipes/

Every field has a docstring underneath it; cross-field checks name the setting to change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from exgrpo_trainer.algo import LossConfig

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"
"""YAML recipes shipped with the trainer: `exgrpo` (spec defaults) and `grpo` (no replay)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunSection(_Section):
    pool_url: str = "http://127.0.0.1:8700"
    """Base URL of the pool service."""
    token: str | None = None
    """Bearer token for the pool service (or $EXGRPO_TOKEN)."""
    pool: str = "default"
    """Pool to train from."""
    name: str = "run-1"
    """Run name in the pool (created if missing)."""
    seed: int = 0
    """Seeds the run's fresh order and replay draws (service) and sampling/shuffles (trainer)."""
    steps: int = 100
    """Training steps to run (the run continues from the service's step when resumed)."""
    output_dir: Path = Path("exgrpo-data/runs/run-1")
    """Run folder: config, metrics, checkpoints, published weights (checkpoints and published
    weights in subfolders per pool and run, so runs may share the folder)."""
    lease_ttl_s: float = Field(60.0, ge=1, le=3600)
    """The run's writer lease lives this long without renewal; the trainer renews it every third
    of that, and a crashed trainer's run is free again after it."""
    takeover: bool = False
    """Take the run even from a live trainer, which is fenced out: its next write is refused and it
    stops (`exgrpo train --takeover`)."""
    lease_wait_s: float = Field(0.0, ge=0)
    """At start, wait up to this long for another trainer's lease to expire before giving up."""
    retry_budget_s: float = Field(600.0, ge=0)
    """How long a call to the pool service is retried (with backoff) before the trainer gives up,
    e.g. while the service restarts; writes carry idempotency keys, so a retried write applies once."""


class ModelSection(_Section):
    path: Path = Path("model")
    """Local folder in Hugging Face format (config, weights, tokenizer with a chat template)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Parameter dtype for compute: auto = bfloat16 mixed precision on GPU, float32 on CPU."""
    activation_checkpointing: bool = False
    """Recompute decoder layers in backward to save memory."""
    reference_path: Path | None = None
    """Reference model of the KL term (only loaded when loss.kl_coeff > 0); default: model.path,
    the starting weights."""
    max_prompt_len: int = Field(1024, ge=8)
    """Prompts longer than this (after the chat template) are cut from the left."""
    drop_system_prompt: bool = False
    """Drop system messages before applying the chat template."""


class RolloutSection(_Section):
    engine: Literal["colocated", "remote"] = "colocated"
    """colocated: the trainer generates with its own model; remote: rollout workers claim tasks."""
    max_policy_lag: int = Field(0, ge=0, le=1000)
    """Remote engine only. 0 (synchronous): every batch is generated with exactly the trainer's
    current weights (published every step). N >= 1 (asynchronous): the next batch is generated while
    the trainer updates, with any published version at most N steps older than the weights it is
    trained with; fresh tokens are corrected with the sampler's log-probs (docs/training.md)."""
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(512, ge=1)
    """Maximum response length (also L_max of the loss normaliser unless loss.max_response_len is set)."""
    min_new_tokens: int = Field(0, ge=0)
    grader: str = "math_think"
    """Reward function: math_think, boxed, choice, arithmetic, or a dotted path to a function."""
    grading_workers: int = Field(2, ge=0)
    """Processes grading in parallel with hard timeouts (0 grades in process)."""
    grading_timeout_s: float = Field(5.0, gt=0)
    results_timeout_s: float = Field(3600.0, gt=0)
    """Remote engine: how long to wait for the workers to complete a batch."""
    max_batch_rows: int = Field(256, ge=1)
    """Sequences generated at once by the colocated engine."""
    publish: Literal["file", "http", "shm"] = "file"
    """How published weights reach the rollout workers (`exgrpo_trainer.publisher`): file: a Hugging
    Face folder under the output folder (workers share the filesystem); http: served from the
    trainer's memory, no disk (workers on other hosts too when `publish_addr` is routable); shm: a
    POSIX shared-memory segment (workers on this host). Costs: docs/benchmarks.md."""
    publish_addr: str = "127.0.0.1"
    """publish=http: the address the weight server binds (0.0.0.0: every interface, uris then name
    this host)."""
    publish_port: int = Field(0, ge=0, le=65535)
    """publish=http: the weight server's port (0: a free one at start; fix it so that a restarted
    trainer serves the uris it registered before)."""


class ExperienceSection(_Section):
    enabled: bool = True
    """False trains plain on-policy GRPO on the same machinery (no replay, no phase switch)."""
    ratio: float | None = Field(None, ge=0, le=1)
    """Experience ratio rho; None uses the pool's."""
    start_threshold: float | None = Field(None, ge=0, le=1)
    """Delayed-start threshold; None uses the pool's."""
    max_replay_age: int | None = Field(None, ge=1)
    """Replay only stored trajectories collected at most this many steps before the run's current
    step; None uses the pool's (no limit by default)."""
    metric: Literal["ent", "ppl", "random"] = "ent"
    """Trajectory choice for replayed questions: lowest mean token entropy under the current policy."""
    select_mode: Literal["argmin", "argmax"] = "argmin"
    batch_size: int | None = Field(None, ge=1)
    """Questions per step; None uses the pool's."""


class OptimSection(_Section):
    lr: float = Field(1e-6, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    grad_clip: float = Field(1.0, gt=0)
    skip_grad_above: float = Field(500.0, gt=0)
    """Skip the optimizer step when the pre-clip gradient norm is non-finite or above this."""
    mini_batches: int = Field(2, ge=1)
    """Optimizer steps per training step (the batch's rows are split into this many)."""
    micro_batch_tokens: int = Field(16384, ge=64)
    """Token budget (rows x padded length) of one forward/backward."""


class ScheduleSection(_Section):
    publish_every: int = Field(10, ge=0)
    """Publish weights (safetensors + policy version on the service) every N steps; 0 = never.
    Colocated engine only: with rollout.engine=remote the trainer publishes every step (the workers
    generate each batch with the version it names), whatever this says."""
    checkpoint_every: int = Field(50, ge=0)
    """Save a resumable checkpoint every N steps (and at the end); 0 = only at the end."""
    keep_checkpoints: int = Field(2, ge=1)


class LoggingSection(_Section):
    jsonl: bool = True
    tensorboard: bool = True
    wandb: bool = False
    """Log to Weights & Biases when it is installed."""
    wandb_project: str = "exgrpo"
    progress: bool = True
    """A live progress bar on the terminal."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Serve Prometheus metrics (step time split, solved fraction) on this port; unset reads
    $EXGRPO_TRAINER_METRICS_PORT, and neither means off."""
    send_to_service: bool = True
    """Send each step's metrics with the commit, so the API and dashboard show curves."""


class TrainConfig(_Section):
    run: RunSection = Field(default_factory=RunSection)
    model: ModelSection = Field(default_factory=ModelSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    experience: ExperienceSection = Field(default_factory=ExperienceSection)
    loss: LossConfig = Field(default_factory=LossConfig)
    """The loss's own settings class (algo.LossConfig), embedded; `loss.max_response_len` defaults to
    `rollout.max_new_tokens`."""
    optim: OptimSection = Field(default_factory=OptimSection)
    schedule: ScheduleSection = Field(default_factory=ScheduleSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)

    @model_validator(mode="before")
    @classmethod
    def _resolve_defaults(cls, data: Any) -> Any:
        """Settings whose default is another setting are filled here, once, so the config that is
        printed and saved is the one every component reads."""
        if isinstance(data, dict):
            loss = data.get("loss")
            if loss is None or (isinstance(loss, dict) and loss.get("max_response_len") is None):
                rollout = data.get("rollout") or {}
                max_new = (
                    rollout.max_new_tokens
                    if isinstance(rollout, RolloutSection)
                    else rollout.get("max_new_tokens", RolloutSection.model_fields["max_new_tokens"].default)
                )
                data = {**data, "loss": {**(loss or {}), "max_response_len": max_new}}
        return data

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.rollout.min_new_tokens > self.rollout.max_new_tokens:
            raise ValueError("rollout.min_new_tokens must not exceed rollout.max_new_tokens")
        if self.rollout.max_policy_lag > 0 and self.rollout.engine != "remote":
            raise ValueError(
                "rollout.max_policy_lag > 0 (asynchronous generation) needs rollout.engine=remote: "
                "the colocated engine always generates with the current weights; set "
                "rollout.max_policy_lag=0 or rollout.engine=remote"
            )
        return self

    @property
    def asynchronous(self) -> bool:
        """Remote generation overlapping the update, at most `rollout.max_policy_lag` versions old."""
        return self.rollout.engine == "remote" and self.rollout.max_policy_lag > 0

    @property
    def max_response_len(self) -> int:
        return self.loss.max_response_len

    def run_overrides(self) -> dict[str, Any]:
        """The run's batch-level rules on the service (`RunOverrides` fields) from this config."""
        exp = self.experience
        return {
            "experience": exp.enabled,
            "experience_ratio": exp.ratio,
            "start_threshold": exp.start_threshold,
            "max_replay_age": exp.max_replay_age,
            "batch_size": exp.batch_size,
        }

    def public_dict(self) -> dict[str, Any]:
        """The settings as plain data, with the service token masked (for logs and config.yaml)."""
        data = self.model_dump(mode="json")
        if data["run"].get("token"):
            data["run"]["token"] = "***"
        return data

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.public_dict(), sort_keys=False)


def recipes() -> list[str]:
    """Names of the shipped recipes (usable as `--config NAME`)."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def resolve_config_path(name: str | Path) -> Path:
    """A config file: the path itself if it exists, else a shipped recipe of that name."""
    path = Path(name)
    if path.exists():
        return path
    recipe = RECIPES_DIR / f"{name}.yaml"
    if path.suffix == "" and path.parent == Path(".") and recipe.is_file():
        return recipe
    raise FileNotFoundError(
        f"config file {str(name)!r} does not exist (shipped recipes: {', '.join(recipes()) or 'none'})"
    )


def format_config_error(e: ValidationError) -> str:
    """One line naming the offending settings, e.g. `invalid config: optim.lr: Input should be ...`."""
    parts = []
    for err in e.errors()[:3]:
        loc = ".".join(str(x) for x in err["loc"])
        parts.append(f"{loc}: {err['msg']}" if loc else err["msg"])
    more = f" (and {e.error_count() - 3} more)" if e.error_count() > 3 else ""
    return " ".join(("invalid config: " + "; ".join(parts) + more).split())


def _parse_value(raw: str) -> Any:
    """YAML scalars and lists (`1e-6`, `true`, `[0.9, 0.99]`, `null`); unparsable text stays a string."""
    if raw == "":
        return ""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`section.key=value` pairs; values are parsed as YAML (numbers, booleans, lists)."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r}: expected key=value, e.g. optim.lr=1e-6")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if any(not p for p in parts):
            raise ValueError(f"override {item!r}: expected section.key=value, e.g. optim.lr=1e-6")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {p} is not a section")
        node[parts[-1]] = _parse_value(raw)
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Settings from a YAML file (a path or a shipped recipe name) plus `key=value` overrides.

    Raises `pydantic.ValidationError` for bad values (`format_config_error` makes it one line),
    `ValueError` for a malformed file or override, `FileNotFoundError` for a missing file."""
    data: dict[str, Any] = {}
    if path is not None:
        file = resolve_config_path(path)
        try:
            loaded = yaml.safe_load(file.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            raise ValueError(f"{file}: not valid YAML ({' '.join(str(e).split())})") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{file}: expected a mapping of sections at the top level")
        data = dict(loaded or {})
    return TrainConfig.model_validate(apply_overrides(data, overrides or []))
