"""Checks of the deployment files: compose file, Dockerfiles, Kubernetes manifests, Prometheus and
Grafana configuration, and the commands that the images and manifests start.

Nothing here needs a container engine or a cluster. The external validators are Debian's
docker-compose (v1 parser), the `compose-spec` package (strict Compose Specification parser),
`kubernetes-validate` (Kubernetes OpenAPI schemas bundled offline) and promtool (from Debian's
prometheus package). `scripts/ci_deploy_checks.sh` installs the tools and runs every check:

    python tests/deploy/deploy_checks.py            # all checks, one line each, exit 1 on failure
    python tests/deploy/deploy_checks.py -k k8s     # the checks whose name contains "k8s"

`tests/deploy/test_deploy_files.py` runs the same checks under pytest. A missing validator is a
failure, never a skip.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import fnmatch
import functools
import importlib
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
K8S = DEPLOY / "k8s"
PROMETHEUS = DEPLOY / "prometheus"
GRAFANA = DEPLOY / "grafana"
DOCKERFILES = sorted(DEPLOY.glob("*.Dockerfile"))
PYTHON = sys.executable
BIN = Path(PYTHON).parent

PROFILES = ("", "cpu", "gpu")
ALWAYS_ON = {"postgres", "redis", "pool", "prometheus", "grafana"}
K8S_VERSIONS = ("1.29.0", "latest")
PUBLISHED = "/data/run/published"
POOL_PORT, WORKER_METRICS_PORT, TRAINER_METRICS_PORT = 8700, 9300, 9400

# Metrics the trainer is to expose on its metrics port (EXGRPO_TRAINER_METRICS_PORT). While the
# trainer does not define them in code, the dashboard is checked against these names.
TRAINER_METRICS = {"exgrpo_trainer_step_seconds": "gauge", "exgrpo_trainer_solved_fraction": "gauge"}


class CheckError(AssertionError):
    """A deployment file is wrong, or a validator is missing."""


def fail(msg: str) -> None:
    raise CheckError(msg)


def need(cond: object, msg: str) -> None:
    if not cond:
        raise CheckError(msg)


# ------------------------------------------------------------------------------------ tools
def tools_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("EXGRPO_CI_TOOLS") or Path(base) / "exgrpo-ci")


def tool(name: str) -> str:
    """Path of an external validator; a missing one fails the check (the CI script installs it)."""
    found = shutil.which(name) or shutil.which(name, path=str(tools_dir() / "bin"))
    if not found:
        fail(f"{name} is not installed: run `bash scripts/ci_deploy_checks.sh --install-only`")
    return str(found)


def py_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        fail(f"python package for {name!r} is missing ({e}): install the dev extra (pip install -e '.[dev]')")


def run(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    cwd: Path = ROOT,
    input_text: str | None = None,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, cwd=cwd, env=env, input=input_text, capture_output=True, text=True, timeout=timeout, check=False
    )


def clean_env(**extra: str) -> dict[str, str]:
    """A minimal environment, so variables of the caller's shell cannot change what is checked."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
    env.update(extra)
    return env


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


def env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            need(sep, f"{path.name}: line without '=': {line!r}")
            out[key.strip()] = value
    return out


@contextlib.contextmanager
def patched_environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items() if k.startswith("EXGRPO_")}
    for k in saved:
        del os.environ[k]
    os.environ.update(values)
    try:
        yield
    finally:
        for k in [k for k in os.environ if k.startswith("EXGRPO_")]:
            del os.environ[k]
        os.environ.update(saved)


def pool_settings(env: dict[str, str]) -> Any:
    """The pool service's Settings built from these EXGRPO_* variables (fails on a bad value)."""
    from pydantic import ValidationError

    from exgrpo_pool.config import Settings

    fields = set(Settings.model_fields)
    for key in env:
        if key.startswith("EXGRPO_") and key != "EXGRPO_CONFIG_FILE":
            need(
                key[len("EXGRPO_") :].lower() in fields,
                f"{key} is not a pool service setting (docs/configuration.md)",
            )
    try:
        with patched_environ({k: v for k, v in env.items() if k.startswith("EXGRPO_")}):
            return Settings()
    except ValidationError as e:
        fail(f"pool service settings do not validate: {e}")


def example_pool_settings(env: dict[str, str]) -> Any:
    """Settings of an example configuration that holds the placeholder secrets: the service must
    refuse them as they are, and accept them only with EXGRPO_ALLOW_EXAMPLE_SECRETS=true."""
    from pydantic import ValidationError

    from exgrpo_pool.config import Settings

    refused = ""
    try:
        with patched_environ({k: v for k, v in env.items() if k.startswith("EXGRPO_")}):
            Settings()
    except ValidationError as e:
        refused = str(e)
    need(
        "EXGRPO_ALLOW_EXAMPLE_SECRETS" in refused,
        f"the pool service accepts the example's placeholder secrets{': ' + refused if refused else ''}",
    )
    return pool_settings({**env, "EXGRPO_ALLOW_EXAMPLE_SECRETS": "true"})


def scope_allows_write(scopes: list[str], pool: str) -> bool:
    return bool({"admin", "write:*", f"write:{pool}"} & set(scopes))


def trainer_config(path: Path | str, overrides: list[str]) -> Any:
    from pydantic import ValidationError

    from exgrpo_trainer.config import load_config

    try:
        return load_config(str(path), overrides)
    except (ValidationError, ValueError, OSError) as e:
        fail(f"trainer config {path} {overrides}: {e}")


def option_values(argv: list[str]) -> dict[str, list[str]]:
    """`--name value` pairs of a command line (flags without a value are left out)."""
    out: dict[str, list[str]] = {}
    for i, arg in enumerate(argv[:-1]):
        if arg.startswith("--") and "=" not in arg and not argv[i + 1].startswith("--"):
            out.setdefault(arg, []).append(argv[i + 1])
    return out


def check_worker_matches_trainer(where: str, worker: list[str], cfg: Any) -> None:
    """A worker generates what the trainer's loss assumes: same lengths, sampling and grader."""
    opts = option_values(worker)
    expect = {
        "--temperature": cfg.rollout.temperature,
        "--top-p": cfg.rollout.top_p,
        "--max-new-tokens": cfg.rollout.max_new_tokens,
        "--min-new-tokens": cfg.rollout.min_new_tokens,
        "--max-prompt-len": cfg.model.max_prompt_len,
        "--grader": cfg.rollout.grader,
    }
    defaults = {
        "--temperature": 1.0,
        "--top-p": 1.0,
        "--max-new-tokens": 512,
        "--min-new-tokens": 0,
        "--max-prompt-len": 1024,
        "--grader": "math_think",
    }
    for flag, want in expect.items():
        raw = opts.get(flag, [str(defaults[flag])])[-1]
        got: Any = type(want)(raw) if not isinstance(want, str) else raw
        need(got == want, f"{where}: worker {flag} {raw} but the trainer uses {want}")


# ---------------------------------------------------------------------------- compose
@functools.cache
def compose_env() -> tuple[tuple[str, str], ...]:
    return tuple(sorted(env_file(ENV_EXAMPLE).items()))


def compose_cmd(*args: str) -> list[str]:
    return [tool("docker-compose"), "--env-file", str(ENV_EXAMPLE), "-f", str(COMPOSE), *args]


@functools.cache
def compose_resolved() -> dict[str, Any]:
    """The compose file with .env.example interpolated by docker-compose (all profiles)."""
    r = run(compose_cmd("--profile", "cpu", "--profile", "gpu", "config"), env=clean_env())
    need(r.returncode == 0, f"docker-compose config failed: {r.stderr.strip()}")
    return yaml.safe_load(r.stdout)


def services() -> dict[str, dict[str, Any]]:
    return compose_resolved()["services"]


def active_services(profile: str) -> set[str]:
    return {
        name
        for name, svc in services().items()
        if not svc.get("profiles") or (profile and profile in svc["profiles"])
    }


def compose_command(name: str) -> list[str]:
    svc = services()[name]
    cmd = svc.get("command")
    if cmd is None:
        return dockerfile_cmd(*build_of(name))
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def build_of(name: str) -> tuple[Path, str | None]:
    build = services()[name]["build"]
    return Path(build["context"]) / build["dockerfile"], build.get("target")


def mounts(name: str) -> dict[str, tuple[str, bool]]:
    """target -> (source, read_only) of a compose service."""
    out = {}
    for v in services()[name].get("volumes", []):
        if isinstance(v, str):
            parts = v.split(":")
            out[parts[1]] = (parts[0], len(parts) > 2 and "ro" in parts[2].split(","))
        else:
            out[v["target"]] = (str(v.get("source")), bool(v.get("read_only")))
    return out


def check_compose_v1_profiles() -> None:
    """docker-compose (v1 parser, Debian) validates the file with each profile and .env.example."""
    for profile in PROFILES:
        args = ["--profile", profile] if profile else []
        r = run(compose_cmd(*args, "config", "-q"), env=clean_env())
        need(r.returncode == 0, f"docker-compose config (profile {profile or 'none'}): {r.stderr.strip()}")
    # the required secrets really are required: without an env file, interpolation must refuse
    with tempfile.NamedTemporaryFile("w", suffix=".env") as empty:
        r = run(
            [tool("docker-compose"), "--env-file", empty.name, "-f", str(COMPOSE), "config", "-q"],
            env=clean_env(),
        )
    need(
        r.returncode != 0 and "POSTGRES_PASSWORD" in r.stderr + r.stdout,
        "docker-compose config passes without secrets: use ${VAR:?message} for them",
    )


def check_compose_spec_strict() -> None:
    """The interpolated file parses under the strict Compose Specification parser (compose-spec)."""
    compose_spec = py_module("compose_spec")
    text = yaml.safe_dump(compose_resolved(), sort_keys=False)
    try:
        parsed = compose_spec.PyCompose.from_yaml(text)
        parsed.validate()
    except ValueError as e:
        fail(f"compose-spec rejects docker-compose.yml: {e}")
    need(
        set(parsed.service_names()) == set(services()), "compose-spec sees other services than docker-compose"
    )


def check_compose_profiles_and_dependencies() -> None:
    svcs = services()
    for name, svc in svcs.items():
        need(set(svc.get("profiles", [])) <= {"cpu", "gpu"}, f"{name}: unknown profile {svc.get('profiles')}")
    need(
        {n for n, s in svcs.items() if not s.get("profiles")} == ALWAYS_ON,
        f"services without a profile must be exactly {sorted(ALWAYS_ON)}",
    )
    for profile in PROFILES:
        active = active_services(profile)
        for name in active:
            for dep in svcs[name].get("depends_on", {}):
                need(
                    dep in active,
                    f"{name} depends on {dep}, which profile {profile or 'none'} does not start",
                )
    for profile in ("cpu", "gpu"):
        extra = active_services(profile) - ALWAYS_ON
        need(
            any(n.startswith("rollout") for n in extra) and any(n.startswith("trainer") for n in extra),
            f"profile {profile} must start rollout workers and a trainer",
        )
    pool = svcs["pool"]
    for dep in ("postgres", "redis"):
        need(
            pool["depends_on"].get(dep, {}).get("condition") == "service_healthy",
            f"pool must wait for {dep} with condition: service_healthy",
        )
        need("healthcheck" in svcs[dep], f"{dep} needs a healthcheck")
    need("/healthz" in " ".join(pool["healthcheck"]["test"]), "pool healthcheck must probe /healthz")
    for name in ("prometheus", "grafana"):
        need(
            "pool" not in (svcs[name].get("depends_on") or {}),
            f"{name} must not wait for the pool: monitoring is needed most while the pool is down",
        )
    for name in active_services("cpu") | active_services("gpu"):
        for dep, spec in svcs[name].get("depends_on", {}).items():
            if dep == "pool":
                need(spec.get("condition") == "service_healthy", f"{name} must wait for a healthy pool")
    cmd = " ".join(compose_command("pool"))
    need(
        re.search(r"exgrpo db upgrade\s*&&.*exgrpo serve", cmd),
        "pool must run `exgrpo db upgrade` then `exgrpo serve`",
    )


def gpu_devices(svc: dict[str, Any]) -> list[dict[str, Any]]:
    return (((svc.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []


def check_compose_gpu_reservations() -> None:
    svcs = services()
    for name, svc in svcs.items():
        devices = gpu_devices(svc)
        if "gpu" in svc.get("profiles", []) and (name.startswith("rollout") or name.startswith("trainer")):
            need(devices, f"{name}: a gpu-profile worker/trainer needs deploy.resources.reservations.devices")
            for d in devices:
                need(
                    d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []),
                    f"{name}: GPU reservation needs driver nvidia and capabilities [gpu]",
                )
                need(("count" in d) != ("device_ids" in d), f"{name}: give count or device_ids, not both")
        else:
            need(not devices, f"{name}: only gpu-profile services reserve GPUs")
    # the defaults (.env.example) fit a one-GPU host: every reserved GPU is GPU 0
    for name, svc in svcs.items():
        for d in gpu_devices(svc):
            ids = [i.strip() for x in d.get("device_ids", []) for i in str(x).split(",")]
            need(ids == ["0"] * len(ids), f"{name}: default GPUs {ids} do not exist on a one-GPU host")
    need("replicas" in (svcs["rollout-vllm"].get("deploy") or {}), "rollout-vllm: set deploy.replicas")
    need("replicas" in (svcs["rollout-cpu"].get("deploy") or {}), "rollout-cpu: set deploy.replicas")


def check_compose_images_and_builds() -> None:
    stages = {p: dockerfile_stages(p) for p in DOCKERFILES}
    for name, svc in services().items():
        image = svc.get("image", "")
        need(
            image and ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"),
            f"{name}: image {image!r} must carry a pinned tag",
        )
        if "build" in svc:
            dockerfile, target = build_of(name)
            need(
                Path(svc["build"]["context"]).resolve() == ROOT,
                f"{name}: build context must be the repository root",
            )
            need(dockerfile in stages, f"{name}: {dockerfile} is not one of deploy/*.Dockerfile")
            if target:
                need(
                    target in stages[dockerfile],
                    f"{name}: target {target!r} is not a stage of {dockerfile.name}",
                )
        else:
            need(name in ALWAYS_ON, f"{name}: project services are built from deploy/")


def check_compose_volumes() -> None:
    raw = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    need(
        {"pgdata", "checkpoints", "published"} <= set(raw.get("volumes") or {}),
        "named volumes pgdata, checkpoints and published are required",
    )
    svcs = services()
    need(
        mounts("postgres").get("/var/lib/postgresql/data", ("",))[0] == "pgdata",
        "postgres must keep its data in pgdata",
    )
    for name in svcs:
        m = mounts(name)
        for source, _ in m.values():
            if source.startswith("/") or source.startswith("."):
                need(Path(source).exists(), f"{name}: bind mount source {source} does not exist")
        if name.startswith("trainer"):
            need(
                m.get(PUBLISHED) == ("published", False),
                f"{name}: must write published weights to {PUBLISHED}",
            )
            need(
                m.get("/data/run", ("",))[0] == "checkpoints",
                f"{name}: the run folder /data/run is the checkpoints volume",
            )
        if name.startswith("rollout"):
            need(
                m.get(PUBLISHED) == ("published", True),
                f"{name}: must mount published weights read-only at {PUBLISHED}",
            )


def check_compose_pool_settings_and_tokens() -> None:
    svcs = services()
    env = {k: str(v) for k, v in svcs["pool"]["environment"].items()}
    settings = example_pool_settings(env)
    need(settings.redis_url, "the compose pool service should use Redis")
    need(settings.host == "0.0.0.0", "the pool must bind 0.0.0.0 inside its container")
    grants = {g.token: g for g in settings.tokens}
    need(any("admin" in g.scopes for g in grants.values()), "an admin token is needed")
    for name in active_services("cpu") | active_services("gpu"):
        if name.startswith(("rollout", "trainer")):
            svc_env = {k: str(v) for k, v in svcs[name].get("environment", {}).items()}
            token = svc_env.get("EXGRPO_TOKEN")
            need(token in grants, f"{name}: EXGRPO_TOKEN is not one of the pool's tokens")
            pool = env_file(ENV_EXAMPLE).get("EXGRPO_POOL", "demo")
            need(
                scope_allows_write(grants[token].scopes, pool),
                f"{name}: its token may not write to pool {pool}",
            )


def check_compose_env_example() -> None:
    text = COMPOSE.read_text(encoding="utf-8")
    used = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", text))
    required = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*):\?", text))
    defined = env_file(ENV_EXAMPLE)
    need(required <= set(defined), f".env.example lacks required variables {sorted(required - set(defined))}")
    defined_for_compose = {k for k in defined if not k.startswith("COMPOSE_")}
    need(
        defined_for_compose <= used,
        f".env.example defines variables docker-compose.yml never uses: {sorted(defined_for_compose - used)}",
    )
    for key in required:
        if "TOKEN" in key or "PASSWORD" in key:
            need(
                defined[key].startswith("replace-"),
                f".env.example: {key} must be a 'replace-...' placeholder",
            )


def image_env(path: Path, target: str | None) -> dict[str, str]:
    """ENV of a Dockerfile stage (KEY=VALUE pairs; values without spaces)."""
    stages = list(dockerfile_stages(path))
    want = target or stages[-1]
    out: dict[str, str] = {}
    current = None
    for word, rest in dockerfile_instructions(path):
        if word == "FROM":
            parts = rest.split()
            current = parts[2] if len(parts) > 2 and parts[1].upper() == "AS" else None
        elif word == "ENV" and current == want:
            out.update(dict(kv.split("=", 1) for kv in shlex.split(rest) if "=" in kv))
    return out


def worker_metrics_port(name: str) -> str:
    """The metrics port a compose worker serves: --metrics-port, else EXGRPO_WORKER_METRICS_PORT of
    the service's environment, else of its image."""
    opts = option_values(compose_command(name))
    if "--metrics-port" in opts:
        return opts["--metrics-port"][-1]
    env = {k: str(v) for k, v in (services()[name].get("environment") or {}).items()}
    return env.get("EXGRPO_WORKER_METRICS_PORT") or image_env(*build_of(name)).get(
        "EXGRPO_WORKER_METRICS_PORT", ""
    )


def check_compose_trainer_and_worker_settings() -> None:
    """Trainer configs validate with their command-line overrides; workers sample what the trainer expects."""
    svcs = services()
    for profile in ("cpu", "gpu"):
        trainer = next(
            n for n in active_services(profile) if n.startswith("trainer") and profile in svcs[n]["profiles"]
        )
        argv = compose_command(trainer)
        need(argv[0] == "exgrpo-launch-trainer", f"{trainer}: start the trainer with exgrpo-launch-trainer")
        config = argv[argv.index("--config") + 1]
        need(config.startswith("/etc/exgrpo/"), f"{trainer}: --config must name a file baked into the image")
        local = DEPLOY / "trainer" / Path(config).name
        need(local.is_file(), f"{trainer}: {local} does not exist")
        overrides = [a for a in argv if "=" in a and not a.startswith("-")]
        cfg = trainer_config(local, overrides)
        need(cfg.rollout.engine == "remote", f"{trainer}: the compose trainer uses remote workers")
        need(
            str(cfg.run.output_dir) + "/published" == PUBLISHED,
            f"{trainer}: run.output_dir must be /data/run",
        )
        need(
            cfg.run.pool_url.rstrip("/") == f"http://pool:{POOL_PORT}",
            f"{trainer}: run.pool_url must be the pool service",
        )
        env = svcs[trainer].get("environment", {})
        need(
            str(env.get("EXGRPO_TRAINER_METRICS_PORT")) == str(TRAINER_METRICS_PORT),
            f"{trainer}: EXGRPO_TRAINER_METRICS_PORT must be {TRAINER_METRICS_PORT} (Prometheus scrapes it)",
        )
        model = str(cfg.model.path)
        for worker in (
            n for n in active_services(profile) if n.startswith("rollout") and profile in svcs[n]["profiles"]
        ):
            wargv = compose_command(worker)
            opts = option_values(wargv)
            need(
                opts.get("--model", [""])[-1] == model,
                f"{worker}: --model must be the trainer's start model {model}",
            )
            need(
                worker_metrics_port(worker) == str(WORKER_METRICS_PORT),
                f"{worker}: the metrics port must be {WORKER_METRICS_PORT} (Prometheus scrapes it)",
            )
            need(
                opts.get("--pool") == [cfg.run.pool] and opts.get("--run") == [cfg.run.name],
                f"{worker}: --pool/--run must be the trainer's run.pool/run.name",
            )
            check_worker_matches_trainer(worker, wargv, cfg)


# ---------------------------------------------------------------------------- dockerfiles
def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def dockerfile_stages(path: Path) -> dict[str, dict[str, Any]]:
    """Stage name -> {from, user, cmd, healthcheck, copies}, with ARG defaults substituted in FROM."""
    args: dict[str, str] = {}
    stages: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    for word, rest in dockerfile_instructions(path):
        if word == "ARG" and current is None:
            key, _, default = rest.partition("=")
            args[key] = default
        elif word == "FROM":
            parts = rest.split()
            image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), parts[0])
            name = parts[2] if len(parts) > 2 and parts[1].upper() == "AS" else f"#{len(stages)}"
            current = {
                "from": image,
                "user": None,
                "cmd": None,
                "entrypoint": None,
                "healthcheck": None,
                "copies": [],
            }
            stages[name] = current
        elif current is not None:
            if word == "USER":
                current["user"] = rest
            elif word in ("CMD", "ENTRYPOINT"):
                need(rest.startswith("["), f"{path.name}: {word} must use the exec (JSON) form")
                current[word.lower()] = json.loads(rest)
            elif word == "HEALTHCHECK":
                current["healthcheck"] = rest
            elif word == "COPY" and "--from=" not in rest:
                current["copies"].extend(rest.split()[:-1])
    return stages


def final_stages(path: Path) -> dict[str, dict[str, Any]]:
    """Stages that are images (not build stages): the last one, and named targets used elsewhere."""
    stages = dockerfile_stages(path)
    names = list(stages)
    finals = {names[-1]}
    finals |= {n for n in names if not n.startswith("build") and not n.startswith("#") and stages[n]["cmd"]}
    return {n: stages[n] for n in names if n in finals}


def dockerfile_cmd(path: Path, target: str | None) -> list[str]:
    stages = dockerfile_stages(path)
    stage = stages[target] if target else stages[list(stages)[-1]]
    return list(stage["entrypoint"] or []) + list(stage["cmd"] or [])


def dockerignore_allows(rel: str) -> bool:
    """Whether the root .dockerignore sends `rel` (a path relative to the root) to the builder."""
    rules = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if ln.strip() and not ln.strip().startswith("#")
    ]
    allowed = True
    parts = Path(rel).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for rule in rules:
        negate = rule.startswith("!")
        pattern = rule[1:] if negate else rule
        pattern = pattern.rstrip("/")
        if pattern == "**" or any(
            fnmatch.fnmatch(p, pattern) or fnmatch.fnmatch(Path(p).name, pattern.removeprefix("**/"))
            for p in prefixes
        ):
            allowed = negate
    return allowed


PIP_BUILD_ARGS = (
    "PIP_INDEX_URL",
    "PIP_EXTRA_INDEX_URL",
    "PIP_FIND_LINKS",
    "PIP_TRUSTED_HOST",
    "PIP_CA_CERTS",
)


def check_dockerfile_builds_offline_ready() -> None:
    """The Dockerfiles build with the classic builder and a site's package index: no `# syntax=`
    line (BuildKit would fetch a frontend image), every pip install goes through
    deploy/docker/pip-install.sh in a stage that declares the index build arguments, and the
    compose builds pass those arguments on."""
    for path in DOCKERFILES:
        text = path.read_text(encoding="utf-8")
        need(
            not re.search(r"^#\s*syntax\s*=", text, re.M | re.I),
            f"{path.name}: a `# syntax=` line needs a frontend image from a registry",
        )
        stage_args: set[str] = set()
        for word, rest in dockerfile_instructions(path):
            if word == "FROM":
                stage_args = set()
            elif word == "ARG":
                stage_args.add(rest.partition("=")[0])
            elif word == "RUN" and re.search(r"\bpip3? install\b", rest):
                fail(f"{path.name}: `RUN {rest[:60]}...` bypasses pip-install (the build's index settings)")
            elif word == "RUN" and "pip-install" in rest:
                missing = [a for a in PIP_BUILD_ARGS if a not in stage_args]
                need(not missing, f"{path.name}: a stage runs pip-install without ARG {', '.join(missing)}")
    for name, svc in services().items():
        if "build" in svc:
            args = svc["build"].get("args") or {}
            need(
                set(PIP_BUILD_ARGS) <= set(args),
                f"{name}: build args must pass {', '.join(PIP_BUILD_ARGS)} from the environment",
            )


def check_dockerfiles() -> None:
    need(len(DOCKERFILES) >= 4, "deploy/ must hold the pool, trainer, rollout and rollout-vllm Dockerfiles")
    names = {p.name for p in DOCKERFILES}
    need(
        {"pool.Dockerfile", "trainer.Dockerfile", "rollout.Dockerfile", "rollout-vllm.Dockerfile"} <= names,
        f"missing Dockerfiles: have {sorted(names)}",
    )
    for path in DOCKERFILES:
        stages = dockerfile_stages(path)
        need(len(stages) >= 2, f"{path.name}: use a multi-stage build")
        for name, stage in stages.items():
            image = stage["from"]
            if image in stages:
                continue
            need("${" not in image, f"{path.name}: FROM {image} uses an ARG without a default")
            tag = image.rsplit("/", 1)[-1]
            need(
                ("@sha256:" in image) or (":" in tag and not tag.endswith(":latest")),
                f"{path.name} stage {name}: base image {image} must be pinned to a version",
            )
            need(re.search(r":[^:]*\d", image), f"{path.name} stage {name}: {image} tag must name a version")
            for src in stage["copies"]:
                need((ROOT / src).exists(), f"{path.name}: COPY source {src} does not exist")
                need(dockerignore_allows(src), f"{path.name}: COPY source {src} is excluded by .dockerignore")
        for name, stage in final_stages(path).items():
            need(stage["cmd"] or stage["entrypoint"], f"{path.name} stage {name}: needs a CMD")
            user = stage["user"] or ""
            need(
                user and user.split(":")[0] not in ("root", "0"),
                f"{path.name} stage {name}: must run as a non-root USER",
            )
        if path.name != "trainer.Dockerfile":
            need(
                any(s["healthcheck"] for s in final_stages(path).values()), f"{path.name}: add a HEALTHCHECK"
            )
    need(
        set(dockerfile_stages(DEPLOY / "trainer.Dockerfile")) >= {"cpu", "gpu"},
        "trainer.Dockerfile needs cpu and gpu targets",
    )
    trainer = dockerfile_stages(DEPLOY / "trainer.Dockerfile")
    for stage in ("gpu", "build-gpu"):
        # one CUDA: PyPI's torch wheel brings its CUDA libraries, so no CUDA base image as well
        need(
            "cuda" not in trainer[stage]["from"].lower(),
            f"trainer.Dockerfile {stage}: {trainer[stage]['from']} is a CUDA image, and PyPI torch "
            "ships CUDA too: start from the Python image",
        )
    gpu_torch = [
        rest for word, rest in dockerfile_instructions(DEPLOY / "trainer.Dockerfile") if "torch==" in rest
    ]
    need(
        any("TORCH_CPU_INDEX" not in r for r in gpu_torch),
        "the trainer gpu build must install PyPI's (CUDA) torch, not the CPU index's",
    )
    text = (DEPLOY / "trainer.Dockerfile").read_text(encoding="utf-8")
    need("TORCH_VERSION=2.13.0" in text, "the trainer image must pin torch 2.13.0 (pyproject's train extra)")
    reqs = (DEPLOY / "rollout-vllm" / "requirements.txt").read_text(encoding="utf-8")
    need(re.search(r"^vllm==\S+", reqs, re.M), "deploy/rollout-vllm/requirements.txt must pin vllm")


def check_healthcheck_script() -> None:
    """deploy/docker/healthcheck.py answers 0 for a live endpoint and 1 for a dead one."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/healthz" else 503)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        script = str(DEPLOY / "docker" / "healthcheck.py")
        ok = run([PYTHON, script, f"http://127.0.0.1:{port}/healthz"], timeout=20)
        bad = run([PYTHON, script, f"http://127.0.0.1:{port}/readyz"], timeout=20)
    finally:
        server.shutdown()
        server.server_close()
    dead = run([PYTHON, script, f"http://127.0.0.1:{port}/healthz", "1"], timeout=20)
    need(ok.returncode == 0, f"healthcheck.py fails on a healthy endpoint: {ok.stderr}")
    need(bad.returncode == 1 and dead.returncode == 1, "healthcheck.py must fail on 503 and on a closed port")


def docker_context(dest: Path) -> None:
    """Copy what `COPY pyproject.toml README.md`, `COPY services` and `COPY clients` send to the
    builder: the repository filtered by .dockerignore."""
    negations = [
        ln.strip()[1:].rstrip("/")
        for ln in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if ln.strip().startswith("!")
    ]
    for top in ("pyproject.toml", "README.md", "services", "clients"):
        src = ROOT / top
        if src.is_file():
            need(dockerignore_allows(top), f".dockerignore excludes {top}, which the images copy")
            shutil.copy2(src, dest / top)
            continue
        for dirpath, dirnames, filenames in os.walk(src):
            rel_dir = Path(dirpath).relative_to(ROOT).as_posix()
            dirnames[:] = [
                d
                for d in dirnames
                if dockerignore_allows(f"{rel_dir}/{d}")
                or any(n.startswith(f"{rel_dir}/{d}/") for n in negations)
            ]
            for f in filenames:
                rel = f"{rel_dir}/{f}"
                if dockerignore_allows(rel):
                    (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(ROOT / rel, dest / rel)


def check_image_install() -> None:
    """What the images' `pip install .[extra]` installs is complete: a wheel built from the
    .dockerignore-filtered context holds every module and data file, and `exgrpo db upgrade` runs
    its migrations from that wheel (an editable install would hide a missing package)."""
    import tomllib
    import zipfile

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    package_dir = pyproject["tool"]["setuptools"]["package-dir"]
    with tempfile.TemporaryDirectory() as tmp:
        ctx, out, unpacked = Path(tmp, "ctx"), Path(tmp, "wheel"), Path(tmp, "site")
        ctx.mkdir()
        docker_context(ctx)
        r = run(
            [
                PYTHON,
                "-m",
                "pip",
                "wheel",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "-w",
                str(out),
                str(ctx),
            ],
            env=clean_env(PIP_DISABLE_PIP_VERSION_CHECK="1"),
            timeout=300,
        )
        need(
            r.returncode == 0, f"building the project wheel from the image context failed: {r.stderr[-1500:]}"
        )
        (wheel,) = out.glob("*.whl")
        with zipfile.ZipFile(wheel) as zf:
            names = set(zf.namelist())
            zf.extractall(unpacked)
        missing = []
        for module, src in package_dir.items():
            for f in (ROOT / src).rglob("*"):
                rel = f.relative_to(ROOT / src)
                if (
                    f.is_dir()
                    or "__pycache__" in rel.parts
                    or not dockerignore_allows(f.relative_to(ROOT).as_posix())
                ):
                    continue
                if (
                    f.suffix in (".py", ".yaml", ".html", ".js", ".css")
                    and f"{module}/{rel.as_posix()}" not in names
                ):
                    missing.append(f"{src}/{rel.as_posix()}")
        need(not missing, f"the images would lack {missing[:10]}: list the packages/data in pyproject.toml")
        url = f"sqlite+aiosqlite:///{tmp}/pool.db"
        code = (
            "import sys, exgrpo_pool as p, exgrpo_trainer as t, exgrpo_rollout as r\n"
            "assert all(m.__file__.startswith(sys.argv[1]) for m in (p, t, r)), 'not the wheel'\n"
            "from exgrpo_cli.main import app\n"
            "app(['--json', 'db', 'upgrade', '--database-url', sys.argv[2]])\n"
        )
        r = run(
            [PYTHON, "-c", code, str(unpacked), url], env=clean_env(PYTHONPATH=str(unpacked)), timeout=120
        )
        need(r.returncode == 0, f"`exgrpo db upgrade` from the wheel failed: {r.stderr.strip()[-800:]}")
        need(Path(tmp, "pool.db").stat().st_size > 0, "`exgrpo db upgrade` created no database")


# ---------------------------------------------------------------------------- trainer launcher
LAUNCHER = DEPLOY / "docker" / "launch-trainer.sh"


def launcher_argv(env: dict[str, str], args: list[str]) -> list[str]:
    r = run(["sh", str(LAUNCHER), *args], env=clean_env(EXGRPO_LAUNCH_DRY_RUN="1", **env), timeout=20)
    need(r.returncode == 0, f"launch-trainer.sh {env}: {r.stderr.strip()}")
    return r.stdout.splitlines()


def parse_torchrun(argv: list[str]) -> tuple[Any, list[str]]:
    """torchrun's own parser on a launcher command: its options, and the trainer's arguments."""
    from torch.distributed.run import get_args_parser

    need(argv[0] == "torchrun", f"the launcher must exec torchrun, not {argv[0]}")
    args = get_args_parser().parse_args(argv[1:])
    need(args.module and args.training_script == "exgrpo_trainer", "torchrun must run -m exgrpo_trainer")
    return args, list(args.training_script_args)


def check_trainer_launcher() -> None:
    args, rest = parse_torchrun(launcher_argv({"NPROC_PER_NODE": "2"}, ["--config", "x.yaml", "a=b"]))
    need(
        args.standalone and args.nnodes == "1" and args.nproc_per_node == "2",
        "single node: --standalone, NPROC_PER_NODE",
    )
    need(rest == ["--config", "x.yaml", "a=b"], f"arguments must reach the trainer unchanged, got {rest}")
    endpoint = "exgrpo-trainer-0.exgrpo-trainer:29500"
    for rank_env, rank in (
        ({"JOB_COMPLETION_INDEX": "0"}, 0),
        ({"JOB_COMPLETION_INDEX": "1"}, 1),
        ({"HOSTNAME": "exgrpo-trainer-3"}, 3),
    ):
        env = {"NNODES": "4", "NPROC_PER_NODE": "8", "RDZV_ENDPOINT": endpoint, **rank_env}
        args, _ = parse_torchrun(launcher_argv(env, ["--config", "t.yaml"]))
        need(
            args.rdzv_backend == "c10d" and args.rdzv_endpoint == endpoint and args.nnodes == "4",
            f"multi-node launch must use the c10d rendezvous at {endpoint}",
        )
        need(
            f"is_host={'true' if rank == 0 else 'false'}" in args.rdzv_conf,
            f"only node 0 hosts the rendezvous ({rank_env})",
        )
        sargs, _ = parse_torchrun(launcher_argv({**env, "RDZV_BACKEND": "static"}, []))
        need(
            sargs.node_rank == rank
            and sargs.master_addr == endpoint.split(":")[0]
            and sargs.master_port == 29500,
            f"static rendezvous: node rank {rank} from {rank_env}",
        )
    r = run(["sh", str(LAUNCHER)], env=clean_env(EXGRPO_LAUNCH_DRY_RUN="1", NNODES="2"), timeout=20)
    need(
        r.returncode == 2 and "RDZV_ENDPOINT" in r.stderr, "NNODES > 1 without RDZV_ENDPOINT must be refused"
    )


# ---------------------------------------------------------------------------- kubernetes
@functools.cache
def k8s_kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text(encoding="utf-8"))


@functools.cache
def k8s_objects() -> tuple[tuple[str, dict[str, Any]], ...]:
    out = []
    for res in k8s_kustomization()["resources"]:
        for doc in load_yaml_docs(K8S / res):
            out.append((res, doc))
    return tuple(out)


def k8s(kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [
        d for _, d in k8s_objects() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


def k8s_one(kind: str, name: str) -> dict[str, Any]:
    found = k8s(kind, name)
    need(len(found) == 1, f"expected one {kind}/{name} in deploy/k8s, found {len(found)}")
    return found[0]


def check_k8s_kustomization() -> None:
    kz = k8s_kustomization()
    need(
        kz.get("kind") == "Kustomization" and kz.get("apiVersion", "").startswith("kustomize.config.k8s.io/"),
        "deploy/k8s/kustomization.yaml must be a Kustomization",
    )
    listed = set(kz["resources"])
    for res in listed:
        need((K8S / res).is_file(), f"kustomization lists {res}, which does not exist")
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    need(present == listed, f"files in deploy/k8s not in kustomization.yaml: {sorted(present - listed)}")
    need(
        kz.get("namespace") and k8s("Namespace", kz["namespace"]),
        "kustomization must set the namespace it creates",
    )
    images = {i["name"] for i in kz.get("images", [])}
    for _, doc in k8s_objects():
        for c in pod_containers(doc):
            repo = c["image"].split(":")[0]
            need(repo in images, f"image {repo} is not in kustomization images (retagging)")
            need(":" in c["image"].rsplit("/", 1)[-1], f"{c['name']}: image must carry a tag")


def check_k8s_schemas() -> None:
    """Every manifest validates (strict: no unknown fields) against the bundled Kubernetes schemas."""
    kv = py_module("kubernetes_validate")
    from kubernetes_validate import utils as kvu

    versions = [kvu.latest_version() if v == "latest" else v for v in K8S_VERSIONS]
    for version in versions:
        for res, doc in k8s_objects():
            try:
                kv.validate(doc, version, strict=True)
            except kvu.ValidationError as e:
                path = ".".join(str(p) for p in e.absolute_path)
                fail(
                    f"{res}: {doc['kind']}/{doc['metadata']['name']} against Kubernetes {version}: "
                    f"{path}: {e.message}"
                )
            except kvu.SchemaNotFoundError as e:
                fail(f"{res}: {e.message}")


def pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    if doc["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
        return doc["spec"]["template"]["spec"]
    return None


def pod_containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(doc)
    return [] if spec is None else list(spec.get("initContainers", [])) + list(spec["containers"])


def env_of(container: dict[str, Any]) -> dict[str, str]:
    """Plain values of a container's environment: configMap data, literal values, secret values."""
    out: dict[str, str] = {}
    for src in container.get("envFrom", []):
        if "configMapRef" in src:
            out.update(k8s_one("ConfigMap", src["configMapRef"]["name"])["data"])
    for e in container.get("env", []):
        if "value" in e:
            out[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out.get(m.group(1), m.group(0)), e["value"])
        elif "secretKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["secretKeyRef"]
            out[e["name"]] = k8s_one("Secret", ref["name"])["stringData"][ref["key"]]
        elif "configMapKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["configMapKeyRef"]
            out[e["name"]] = k8s_one("ConfigMap", ref["name"])["data"][ref["key"]]
    return out


def k8s_argv(container: dict[str, Any]) -> list[str]:
    env = env_of(container)
    argv = list(container.get("command", [])) + list(container.get("args", []))
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in argv]


def check_k8s_references() -> None:
    """Every Secret key, ConfigMap, PVC and Service selector that the workloads use exists."""
    for res, doc in k8s_objects():
        spec = pod_spec(doc)
        if spec is None:
            continue
        labels = doc["spec"]["template"]["metadata"].get("labels", {})
        if "selector" in doc["spec"]:
            sel = doc["spec"]["selector"].get("matchLabels", {})
            need(sel.items() <= labels.items(), f"{res}: selector does not match the pod labels")
        for vol in spec.get("volumes", []):
            if "persistentVolumeClaim" in vol:
                k8s_one("PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"])
            if "configMap" in vol:
                k8s_one("ConfigMap", vol["configMap"]["name"])
        vols = {v["name"] for v in spec.get("volumes", [])}
        for c in pod_containers(doc):
            for m in c.get("volumeMounts", []):
                need(m["name"] in vols, f"{res}: {c['name']} mounts undefined volume {m['name']}")
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    need(
                        ref["key"] in k8s_one("Secret", ref["name"])["stringData"],
                        f"{res}: secret key {ref['key']} missing",
                    )
                ref = e.get("valueFrom", {}).get("configMapKeyRef")
                if ref:
                    need(
                        ref["key"] in k8s_one("ConfigMap", ref["name"])["data"],
                        f"{res}: ConfigMap key {ref['name']}/{ref['key']} missing",
                    )
            env = env_of(c)
            for a in k8s_argv(c):
                need("$(" not in a, f"{res}: {c['name']} argument {a!r} refers to an undefined variable")
            need(
                all("$(" not in v for v in env.values()),
                f"{res}: {c['name']} env refers to an undefined variable",
            )
            need(c.get("resources", {}).get("requests"), f"{res}: {c['name']} needs resource requests")
        sc = spec.get("securityContext", {})
        need(sc.get("runAsNonRoot") and sc.get("runAsUser", 0) != 0, f"{res}: pods must run as non-root")
    for svc in k8s("Service"):
        sel = svc["spec"].get("selector", {})
        matched = [
            d
            for _, d in k8s_objects()
            if pod_spec(d) is not None
            and sel.items() <= d["spec"]["template"]["metadata"].get("labels", {}).items()
        ]
        need(matched, f"Service {svc['metadata']['name']} selects no workload")


def check_k8s_pool() -> None:
    dep = k8s_one("Deployment", "exgrpo-pool")
    need(dep["spec"]["replicas"] == 2, "the pool Deployment runs 2 replicas")
    spec = pod_spec(dep)
    assert spec is not None
    pool = next(c for c in spec["containers"] if c["name"] == "pool")
    need(pool["readinessProbe"]["httpGet"]["path"] == "/readyz", "pool readiness probe must be /readyz")
    need(pool["livenessProbe"]["httpGet"]["path"] == "/healthz", "pool liveness probe must be /healthz")
    need(pool["resources"].get("limits", {}).get("memory"), "pool needs a memory limit")
    need(k8s_argv(pool)[:2] == ["exgrpo", "serve"], "pool container runs `exgrpo serve`")
    init = spec.get("initContainers", [])
    need(
        init and k8s_argv(init[0])[:3] == ["exgrpo", "db", "upgrade"],
        "pool pods migrate in an init container",
    )
    env = env_of(pool)
    settings = example_pool_settings(env)
    need(settings.redis_url, "two API replicas need EXGRPO_REDIS_URL")
    need(not settings.auto_migrate, "the init container migrates: set EXGRPO_AUTO_MIGRATE=false")
    svc = k8s_one("Service", "exgrpo-pool")
    need(
        any(p["port"] == POOL_PORT for p in svc["spec"]["ports"]),
        f"Service exgrpo-pool must expose {POOL_PORT}",
    )
    secret = k8s_one("Secret", "exgrpo-secrets")["stringData"]
    need(
        {"EXGRPO_DATABASE_URL", "EXGRPO_REDIS_URL", *SECRET_TOKENS} <= set(secret),
        "Secret lacks pool settings",
    )
    values = list(secret.values())
    need(
        len(values) == len(set(values)) and not any(v in w for v in values for w in values if v != w),
        "each token is stored once in the Secret (the pool builds EXGRPO_TOKENS from them)",
    )
    need(
        {g.token for g in settings.tokens} == {secret[k] for k in SECRET_TOKENS},
        f"the pool's EXGRPO_TOKENS must be built from the Secret's {', '.join(SECRET_TOKENS)}",
    )
    for key, value in secret.items():
        need(
            "REPLACE-ME" in value or (key == "EXGRPO_REDIS_URL" and "example" in value),
            f"Secret {key} must hold a clearly marked placeholder (REPLACE-ME)",
        )
    grants = {g.token: g for g in settings.tokens}
    run_env = k8s_one("ConfigMap", "exgrpo-run")["data"]
    for key in ("EXGRPO_TRAINER_TOKEN", "EXGRPO_WORKER_TOKEN"):
        need(
            secret[key] in grants and scope_allows_write(grants[secret[key]].scopes, run_env["EXGRPO_POOL"]),
            f"Secret {key} must be one of EXGRPO_TOKENS with write access to pool {run_env['EXGRPO_POOL']}",
        )
    for key in k8s_one("ConfigMap", "exgrpo-pool-env")["data"]:
        pool_settings(
            {key: k8s_one("ConfigMap", "exgrpo-pool-env")["data"][key], "EXGRPO_ALLOW_ANONYMOUS": "true"}
        )


SECRET_TOKENS = ("EXGRPO_ADMIN_TOKEN", "EXGRPO_TRAINER_TOKEN", "EXGRPO_WORKER_TOKEN", "EXGRPO_READ_TOKEN")


def check_k8s_storage() -> None:
    for name in ("exgrpo-checkpoints", "exgrpo-published"):
        pvc = k8s_one("PersistentVolumeClaim", name)
        need(pvc["spec"]["accessModes"] == ["ReadWriteMany"], f"{name} must be ReadWriteMany")


def mount_of(doc: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, bool] | None:
    spec = pod_spec(doc)
    assert spec is not None
    claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in spec.get("volumes", [])}
    for m in container.get("volumeMounts", []):
        if m["mountPath"] == path:
            return claims.get(m["name"]) or m["name"], bool(m.get("readOnly"))
    return None


def check_k8s_rollout() -> None:
    dep = k8s_one("Deployment", "exgrpo-rollout")
    spec = pod_spec(dep)
    assert spec is not None
    c = spec["containers"][0]
    need(
        str(c["resources"].get("limits", {}).get("nvidia.com/gpu", "")).isdigit(),
        "rollout workers need nvidia.com/gpu limits",
    )
    argv = k8s_argv(c)
    need(
        argv[:2] == ["exgrpo", "rollout"] and option_values(argv).get("--engine") == ["vllm"],
        "rollout runs `exgrpo rollout --engine vllm`",
    )
    need(
        mount_of(dep, c, PUBLISHED) == ("exgrpo-published", True),
        f"rollout must mount exgrpo-published read-only at {PUBLISHED}",
    )
    need(
        option_values(argv).get("--metrics-port") == [str(WORKER_METRICS_PORT)],
        f"rollout --metrics-port {WORKER_METRICS_PORT}",
    )
    need(
        dep["spec"]["template"]["metadata"]["annotations"].get("prometheus.io/port")
        == str(WORKER_METRICS_PORT),
        "rollout pods need prometheus.io/* scrape annotations",
    )


def check_k8s_trainer() -> None:
    job = k8s_one("Job", "exgrpo-trainer")
    svc = k8s_one("Service", "exgrpo-trainer")
    spec = pod_spec(job)
    assert spec is not None
    need(svc["spec"].get("clusterIP") == "None", "the trainer rendezvous Service must be headless")
    need(
        svc["spec"].get("publishNotReadyAddresses") is True,
        "headless Service must publish not-ready addresses",
    )
    need(
        job["spec"].get("completionMode") == "Indexed",
        "the trainer Job must be Indexed (node rank = completion index)",
    )
    need(
        spec.get("subdomain") == svc["metadata"]["name"], "trainer pods need subdomain = the headless Service"
    )
    c = spec["containers"][0]
    env = env_of(c)
    nnodes = int(env["NNODES"])
    need(
        job["spec"]["completions"] == job["spec"]["parallelism"] == nnodes,
        "completions = parallelism = NNODES",
    )
    need(
        env["RDZV_ENDPOINT"] == f"{job['metadata']['name']}-0.{svc['metadata']['name']}:29500",
        "RDZV_ENDPOINT must be pod 0 behind the headless Service, port 29500",
    )
    need(any(p["port"] == 29500 for p in svc["spec"]["ports"]), "the headless Service must expose 29500")
    need(
        int(c["resources"]["limits"]["nvidia.com/gpu"]) == int(env["NPROC_PER_NODE"]),
        "one trainer process per GPU",
    )
    argv = k8s_argv(c)
    need(argv[0] == "exgrpo-launch-trainer", "the trainer container starts exgrpo-launch-trainer")
    for index in range(nnodes):
        largv = launcher_argv(
            {
                **{k: v for k, v in env.items() if not k.startswith("EXGRPO_")},
                "JOB_COMPLETION_INDEX": str(index),
            },
            argv[1:],
        )
        args, rest = parse_torchrun(largv)
        need(
            args.nnodes == str(nnodes) and args.rdzv_endpoint == env["RDZV_ENDPOINT"],
            f"node {index}: torchrun arguments",
        )
    # the recipe from the ConfigMap, with the command-line overrides
    cm = k8s_one("ConfigMap", "exgrpo-trainer-config")["data"]["trainer.yaml"]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(cm)
    try:
        cfg = trainer_config(f.name, rest[2:])
    finally:
        os.unlink(f.name)
    gpu = yaml.safe_load((DEPLOY / "trainer" / "gpu.yaml").read_text(encoding="utf-8"))
    gpu["run"]["pool_url"] = f"http://exgrpo-pool:{POOL_PORT}"
    need(
        yaml.safe_load(cm) == gpu,
        "the trainer ConfigMap must be deploy/trainer/gpu.yaml with the in-cluster pool URL",
    )
    need(
        cfg.run.pool_url.rstrip("/") == env["EXGRPO_URL"].rstrip("/"),
        "trainer run.pool_url = the pool Service",
    )
    need(str(cfg.run.output_dir) + "/published" == PUBLISHED, "trainer output_dir must be /data/run")
    need(
        mount_of(job, c, PUBLISHED) == ("exgrpo-published", False),
        f"trainer writes exgrpo-published at {PUBLISHED}",
    )
    need(
        mount_of(job, c, "/data/run") == ("exgrpo-checkpoints", False),
        "trainer run folder is exgrpo-checkpoints",
    )
    need(mount_of(job, c, "/etc/exgrpo") == ("config", True), "trainer config mounted from the ConfigMap")
    rollout = k8s_one("Deployment", "exgrpo-rollout")["spec"]["template"]["spec"]["containers"][0]
    wargv = k8s_argv(rollout)
    need(
        option_values(wargv).get("--model") == [str(cfg.model.path)],
        "workers start from the trainer's model.path",
    )
    need(
        option_values(wargv).get("--pool") == [cfg.run.pool]
        and option_values(wargv).get("--run") == [cfg.run.name],
        "workers serve the trainer's run",
    )
    check_worker_matches_trainer("k8s rollout", wargv, cfg)
    need(env.get("EXGRPO_TRAINER_METRICS_PORT") == str(TRAINER_METRICS_PORT), "trainer metrics port 9400")


def strategic_merge(base: Any, patch: Any) -> Any:
    """A strategic merge patch as kustomize applies it to these manifests: mappings merge, lists of
    named items (containers, env, ports) merge by name, other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = strategic_merge(base[key], value) if key in base else value
        return out
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(x, dict) and "name" in x for x in base + patch)
    ):
        merged = {x["name"]: x for x in base}
        for item in patch:
            merged[item["name"]] = strategic_merge(merged.get(item["name"], {}), item)
        return list(merged.values())
    return patch


def check_k8s_single_node_overlay() -> None:
    """deploy/k8s/overlays/single-node: the base stack with the trainer on one node (one pod,
    torchrun --standalone), its GPU limit equal to its processes; the result validates."""
    folder = K8S / "overlays" / "single-node"
    kz = yaml.safe_load((folder / "kustomization.yaml").read_text(encoding="utf-8"))
    need(kz.get("resources") == ["../.."], "the single-node overlay builds on deploy/k8s (resources: ../..)")
    patches = [folder / p["path"] for p in kz.get("patches", [])]
    need(patches and all(p.is_file() for p in patches), "the single-node overlay's patch files must exist")
    job = k8s_one("Job", "exgrpo-trainer")
    for path in patches:
        patch = yaml.safe_load(path.read_text(encoding="utf-8"))
        need(
            (patch["kind"], patch["metadata"]["name"]) == ("Job", "exgrpo-trainer"),
            f"{path.name}: patches the trainer Job only",
        )
        job = strategic_merge(job, patch)
    kv = py_module("kubernetes_validate")
    kv.validate(job, K8S_VERSIONS[0], strict=True)
    c = job["spec"]["template"]["spec"]["containers"][0]
    env = env_of(c)
    need(env["NNODES"] == "1", "the single-node trainer runs NNODES=1")
    need(job["spec"]["completions"] == job["spec"]["parallelism"] == 1, "one trainer pod: completions 1")
    gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
    need(
        gpus == int(env["NPROC_PER_NODE"]) == int(c["resources"]["requests"]["nvidia.com/gpu"]),
        "one trainer process per GPU of the node",
    )
    args, _ = parse_torchrun(launcher_argv({k: v for k, v in env.items() if not k.startswith("EXGRPO_")}, []))
    need(args.standalone and args.nnodes == "1", "a single-node trainer starts torchrun --standalone")


def check_k8s_optional_monitoring() -> None:
    docs = load_yaml_docs(K8S / "optional" / "monitoring.yaml")
    kinds = {d["kind"]: d for d in docs}
    need(
        {"ServiceMonitor", "PodMonitor"} <= set(kinds),
        "optional/monitoring.yaml: ServiceMonitor and PodMonitor",
    )
    for d in docs:
        need(
            d["apiVersion"] == "monitoring.coreos.com/v1", f"{d['kind']}: apiVersion monitoring.coreos.com/v1"
        )
    sm = kinds["ServiceMonitor"]
    svc = k8s_one("Service", "exgrpo-pool")
    need(
        sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items(),
        "ServiceMonitor selects exgrpo-pool",
    )
    need(
        {e["port"] for e in sm["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]},
        "ServiceMonitor port names",
    )
    pm = kinds["PodMonitor"]
    values = set(pm["spec"]["selector"]["matchExpressions"][0]["values"])
    for name, kind in (("exgrpo-rollout", "Deployment"), ("exgrpo-trainer", "Job")):
        doc = k8s_one(kind, name)
        need(
            doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] in values,
            f"PodMonitor selects {name}",
        )
        ports = {p.get("name") for c in pod_containers(doc) for p in c.get("ports", [])}
        need("metrics" in ports, f"{name}: a container port named metrics")


# ---------------------------------------------------------------------------- prometheus
def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return run([tool("promtool"), *args], timeout=60)


def check_prometheus_config() -> None:
    r = promtool("check", "config", str(PROMETHEUS / "prometheus.yml"))
    need(r.returncode == 0, f"promtool check config: {r.stdout}{r.stderr}")
    r = promtool("check", "rules", str(PROMETHEUS / "alerts.yml"))
    need(r.returncode == 0, f"promtool check rules: {r.stdout}{r.stderr}")
    r = run([tool("promtool"), "test", "rules", "alerts_test.yml"], cwd=PROMETHEUS, timeout=60)
    need(r.returncode == 0, f"promtool test rules: {r.stdout}{r.stderr}")


def check_prometheus_targets() -> None:
    """Compose scrape jobs point at the compose services and their metrics ports."""
    cfg = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text(encoding="utf-8"))
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    want = {
        "exgrpo-pool": POOL_PORT,
        "exgrpo-rollout": WORKER_METRICS_PORT,
        "exgrpo-trainer": TRAINER_METRICS_PORT,
    }
    svcs = services()
    for job, port in want.items():
        need(job in jobs, f"prometheus.yml: missing scrape job {job}")
        names = [n for sd in jobs[job].get("dns_sd_configs", []) for n in sd["names"]]
        ports = {sd["port"] for sd in jobs[job].get("dns_sd_configs", [])}
        need(names and ports == {port}, f"{job}: scrape port {port} by compose DNS name")
        for n in names:
            need(n in svcs, f"{job}: {n} is not a compose service")
    component = {"exgrpo-rollout": "rollout", "exgrpo-trainer": "trainer"}
    for job, prefix in component.items():
        scraped = {n for sd in jobs[job]["dns_sd_configs"] for n in sd["names"]}
        need(scraped == {n for n in svcs if n.startswith(prefix)}, f"{job}: scrape every {prefix} service")
    need(
        any(str(POOL_PORT) in p for p in svcs["pool"].get("ports", []) if isinstance(p, str))
        or svcs["pool"].get("ports"),
        "pool port published",
    )


def check_prometheus_kubernetes_snippet() -> None:
    """kubernetes-scrape.yml: Debian's promtool is built without Kubernetes discovery, so check it here."""
    cfg = yaml.safe_load((PROMETHEUS / "kubernetes-scrape.yml").read_text(encoding="utf-8"))
    need(cfg["rule_files"] == ["alerts.yml"], "kubernetes-scrape.yml loads alerts.yml")
    (job,) = cfg["scrape_configs"]
    sd = job["kubernetes_sd_configs"][0]
    need(
        sd["role"] == "pod" and sd["namespaces"]["names"] == [k8s_kustomization()["namespace"]],
        "pod discovery in the namespace",
    )
    allowed = {"source_labels", "regex", "action", "target_label", "replacement", "separator", "modulus"}
    for rule in job["relabel_configs"]:
        need(set(rule) <= allowed, f"unknown relabel field in {rule}")
        need(
            rule.get("action", "replace")
            in {"replace", "keep", "drop", "labelmap", "labeldrop", "labelkeep", "hashmod"},
            f"bad relabel action {rule.get('action')}",
        )
        if "regex" in rule:
            re.compile(rule["regex"])
        for label in rule.get("source_labels", []):
            need(re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", label), f"bad label name {label}")
    # the annotations the snippet keys on are on every scraped workload
    for kind, name in (
        ("Deployment", "exgrpo-pool"),
        ("Deployment", "exgrpo-rollout"),
        ("Job", "exgrpo-trainer"),
    ):
        ann = k8s_one(kind, name)["spec"]["template"]["metadata"].get("annotations", {})
        need(
            ann.get("prometheus.io/scrape") == "true" and ann.get("prometheus.io/port"),
            f"{name}: scrape annotations",
        )


# ---------------------------------------------------------------------------- grafana
def known_metrics() -> dict[str, str]:
    """Sample names a scrape can return -> family type, from the code's own registries."""
    from exgrpo_pool.metrics import Metrics
    from exgrpo_rollout.worker import WorkerMetrics

    families: dict[str, str] = {}
    for registry in (Metrics().registry, WorkerMetrics().registry):
        for fam in registry.collect():
            families[fam.name] = fam.type
    families.update(trainer_metric_families())
    out = {}
    for name, kind in families.items():
        if kind == "counter":
            out[f"{name}_total"] = kind
        elif kind == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                out[name + suffix] = kind
        elif kind == "summary":
            for suffix in ("", "_sum", "_count"):
                out[name + suffix] = kind
        else:
            out[name] = kind
    return out


def trainer_metric_families() -> dict[str, str]:
    """The trainer's metrics: read from its code (`Gauge("exgrpo_trainer_...", ...)` and the like)
    once it defines them, else TRAINER_METRICS, the names the dashboard is written against."""
    kinds = {"Gauge": "gauge", "Counter": "counter", "Histogram": "histogram", "Summary": "summary"}
    found: dict[str, str] = {}
    pattern = re.compile(r"\b(Gauge|Counter|Histogram|Summary)\(\s*[\"'](exgrpo_trainer_[a-z0-9_]+)[\"']")
    for path in (ROOT / "services" / "trainer").rglob("*.py"):
        for kind, name in pattern.findall(path.read_text(encoding="utf-8")):
            found[name] = kinds[kind]
    if not found:
        return dict(TRAINER_METRICS)
    for name in TRAINER_METRICS:
        need(name in found, f"the trainer defines metrics but not {name}, which the dashboard plots")
    return found


def dashboard() -> dict[str, Any]:
    try:
        return json.loads((GRAFANA / "dashboards" / "exgrpo.json").read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        fail(f"exgrpo.json is not JSON: {e}")


def dashboard_exprs() -> list[tuple[str, str]]:
    out = []
    for panel in dashboard()["panels"]:
        for t in panel.get("targets", []):
            out.append((panel["title"], t["expr"]))
    return out


def check_grafana_provisioning() -> None:
    ds = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text(encoding="utf-8")
    )
    need(ds["apiVersion"] == 1 and len(ds["datasources"]) == 1, "one provisioned datasource")
    src = ds["datasources"][0]
    need(
        src["type"] == "prometheus" and src["url"] == "http://prometheus:9090",
        "datasource: the compose Prometheus",
    )
    prov = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "exgrpo.yml").read_text(encoding="utf-8")
    )
    (provider,) = prov["providers"]
    need(provider["type"] == "file", "dashboard provider of type file")
    grafana_mounts = mounts("grafana")
    need(
        grafana_mounts.get(provider["options"]["path"], ("",))[0].endswith("deploy/grafana/dashboards"),
        "compose must mount deploy/grafana/dashboards where the provider reads",
    )
    need(
        grafana_mounts.get("/etc/grafana/provisioning", ("",))[0].endswith("deploy/grafana/provisioning"),
        "compose must mount deploy/grafana/provisioning",
    )
    dash = dashboard()
    var = next(v for v in dash["templating"]["list"] if v["type"] == "datasource")
    need(
        var["query"] == "prometheus" and var["current"]["value"] == src["uid"],
        "dashboard datasource = provisioned uid",
    )
    home = services()["grafana"]["environment"].get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH", "")
    need(home == provider["options"]["path"] + "/exgrpo.json", "home dashboard path")


def check_grafana_dashboard_structure() -> None:
    dash = dashboard()
    for key in ("uid", "title", "schemaVersion", "panels", "templating", "time"):
        need(key in dash, f"dashboard lacks {key}")
    ids = [p["id"] for p in dash["panels"]]
    need(len(ids) == len(set(ids)), "panel ids must be unique")
    cells: set[tuple[int, int]] = set()
    var_names = {v["name"] for v in dash["templating"]["list"]}
    for p in dash["panels"]:
        g = p["gridPos"]
        need(
            g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0,
            f"panel {p['title']}: gridPos outside 24 columns",
        )
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                need((x, y) not in cells, f"panel {p['title']} overlaps another panel")
                cells.add((x, y))
        if p["type"] == "row":
            continue
        need(
            p["type"] in {"timeseries", "stat", "gauge", "bargauge", "table", "heatmap"},
            f"panel type {p['type']}",
        )
        need(p["datasource"]["uid"] == "${datasource}", f"panel {p['title']}: use the datasource variable")
        refs = [t["refId"] for t in p["targets"]]
        need(p["targets"] and len(refs) == len(set(refs)), f"panel {p['title']}: targets with unique refIds")
        for t in p["targets"]:
            for v in re.findall(r"\$(\w+)", t["expr"]):
                need(v in var_names or v.startswith("__"), f"panel {p['title']}: unknown variable ${v}")


def check_grafana_queries() -> None:
    """Every dashboard query is valid PromQL (promtool) on metric names the stack exposes."""
    metrics = known_metrics()
    used = set()
    for title, expr in dashboard_exprs():
        for name in re.findall(r"\b(exgrpo_[a-z0-9_]+)", expr):
            need(
                name in metrics,
                f"panel {title!r}: {name} is not exposed by the pool, the workers or the trainer",
            )
            used.add(name)
    for v in dashboard()["templating"]["list"]:
        if v["type"] == "query":
            for name in re.findall(r"\b(exgrpo_[a-z0-9_]+)", v["definition"]):
                need(name in metrics, f"variable {v['name']}: unknown metric {name}")
    topics = {
        "request latency": "exgrpo_http_request_seconds_bucket",
        "ingest": "exgrpo_trajectories_ingested_total",
        "replay": "exgrpo_replay_picks_total",
        "pool sizes": "exgrpo_pool_questions",
        "queue depth": "exgrpo_task_queue_depth",
        "lease expiries": "exgrpo_task_lease_expiries_total",
        "worker tokens/s": "exgrpo_worker_tokens_per_second",
        "grading latency": "exgrpo_worker_grading_seconds_bucket",
        "trainer step split": "exgrpo_trainer_step_seconds",
        "solved fraction": "exgrpo_trainer_solved_fraction",
    }
    for topic, name in topics.items():
        need(name in used, f"the dashboard needs a panel for {topic} ({name})")
    exprs = " ".join(e for _, e in dashboard_exprs())
    need(
        "histogram_quantile(0.5" in exprs
        and "histogram_quantile(0.99" in exprs
        and "by (le, route)" in exprs,
        "request latency p50 and p99 by route",
    )
    need("by (part)" in exprs, "trainer step time split by part")
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {
                        "record": f"dashboard:q{i}",
                        "expr": re.sub(r"\$__\w+", "5m", e).replace("$pool", ".*").replace("$run", ".*"),
                    }
                    for i, (_, e) in enumerate(dashboard_exprs())
                ],
            }
        ]
    }
    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as f:
        yaml.safe_dump(rules, f)
    try:
        r = promtool("check", "rules", f.name)
    finally:
        os.unlink(f.name)
    need(r.returncode == 0, f"dashboard PromQL does not parse: {r.stdout}{r.stderr}")
    r = promtool("check", "rules", str(PROMETHEUS / "alerts.yml"))
    for name in re.findall(r"\b(exgrpo_[a-z0-9_]+)", (PROMETHEUS / "alerts.yml").read_text(encoding="utf-8")):
        need(name in metrics, f"alerts.yml: unknown metric {name}")


# ---------------------------------------------------------------------------- entry points
def expand_command(argv: list[str], where: str) -> list[tuple[str, str, list[str]]]:
    """(where, kind, arguments) of the project commands in a container command line.

    kind: `exgrpo` (arguments after `exgrpo`), `trainer` (arguments of `python -m exgrpo_trainer`,
    also under exgrpo-launch-trainer/torchrun) or `python-c` (the code). `sh -c` scripts are split
    on && ; ||."""
    if not argv:
        return []
    head = argv[0]
    if head == "sh" and len(argv) >= 3 and argv[1] == "-c":
        out = []
        for part in re.split(r"&&|;|\|\|", argv[2]):
            words = shlex.split(part)
            if words and words[0] == "exec":
                words = words[1:]
            out += expand_command(words, where)
        return out
    if head == "exgrpo-launch-trainer":
        _, rest = parse_torchrun(launcher_argv({}, argv[1:]))
        return [(where, "trainer", rest)]
    if head == "exgrpo":
        return [(where, "exgrpo", argv[1:])]
    if head in ("python", "python3") and argv[1:3] == ["-m", "exgrpo_trainer"]:
        return [(where, "trainer", argv[3:])]
    if head in ("python", "python3") and argv[1:2] == ["-c"]:
        return [(where, "python-c", [argv[2]])]
    fail(f"{where}: cannot check command {argv}")
    return []


def parse_exgrpo(args: list[str]) -> str:
    """Parse an `exgrpo` command line with the CLI's own parser, without running it: unknown
    options, bad values and missing required options raise. Returns the command's name."""
    import typer

    from exgrpo_cli.main import app

    cmd: Any = typer.main.get_command(app)
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        ctx = cmd.make_context("exgrpo", list(args))
        while hasattr(cmd, "resolve_command"):
            rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
            need(rest, f"`exgrpo {' '.join(args)}` names no command")
            name, cmd, rest = cmd.resolve_command(ctx, rest)
            ctx = cmd.make_context(name, rest, parent=ctx)
    return str(cmd.name)


def check_command(where: str, kind: str, args: list[str], complete: bool) -> str | None:
    """None when the command exists and accepts these arguments, else what is wrong."""
    try:
        if kind == "python-c":
            return check_python_c(args[0])
        if kind == "trainer":
            from exgrpo_trainer.cli import parse_args

            sink = io.StringIO()
            with contextlib.redirect_stderr(sink):
                try:
                    parse_args(args)
                except SystemExit as e:
                    usage = sink.getvalue().strip()
                    return f"python -m exgrpo_trainer {' '.join(args)}: {usage} (exit {e.code})"
            return None
        try:
            parse_exgrpo(args if complete else [*args, "--help"])
        except Exception as e:
            code = getattr(e, "exit_code", getattr(e, "code", None))
            if not complete and type(e).__name__ == "Exit" and code == 0:
                return None  # --help printed the usage: every option before it was known
            message = e.format_message() if hasattr(e, "format_message") else str(e)
            return f"exgrpo {' '.join(args)}: {type(e).__name__}: {message}"
        return None if complete else f"exgrpo {' '.join(args)} --help did not print its usage"
    except CheckError as e:
        return f"{where}: {e}"


def check_python_c(code: str) -> str | None:
    """A `python -c` script compiles and everything it imports exists (it is not run)."""
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        return f"syntax error: {e}"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            defined = module_names(node.module)
            if defined is None:
                return f"no module {node.module}"
            for alias in node.names:
                if alias.name not in defined:
                    return f"{node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if importlib.util.find_spec(alias.name) is None:
                    return f"no module {alias.name}"
    return None


def module_names(module: str) -> set[str] | None:
    """Top-level names a module defines, read from its source without importing it (importing
    the model code would pull torch and transformers in); None when it does not exist."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        return None
    if not spec.origin or not spec.origin.endswith(".py"):
        return set(dir(importlib.import_module(module)))
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for tgt in targets for n in ast.walk(tgt) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def started_commands() -> list[tuple[str, list[str], bool]]:
    """(where, argv, complete) of every command a Dockerfile CMD, compose service or manifest runs.
    Every one is complete: the Dockerfile CMDs with the environment a deployment gives them
    (IMAGE_ENV: a worker image's default command reads --pool/--run from it)."""
    out: list[tuple[str, list[str], bool]] = []
    for path in DOCKERFILES:
        for name, stage in final_stages(path).items():
            out.append(
                (f"{path.name}:{name}", list(stage["entrypoint"] or []) + list(stage["cmd"] or []), True)
            )
    for name, svc in services().items():
        if "build" in svc:
            out.append((f"compose:{name}", compose_command(name), True))
    for res, doc in k8s_objects():
        for c in pod_containers(doc):
            out.append((f"k8s:{res}:{c['name']}", k8s_argv(c), True))
    return out


IMAGE_ENV = {"EXGRPO_POOL": "math", "EXGRPO_RUN": "exgrpo-1"}
"""What a deployment sets for an image's default command (docker-compose.yml, deploy/k8s)."""

CONSOLE_PROBES = (
    ["exgrpo", "--help"],
    ["exgrpo", "serve", "--help"],
    ["exgrpo", "db", "upgrade", "--help"],
    ["exgrpo", "rollout", "--help"],
    ["python", "-m", "exgrpo_trainer", "--help"],
)


def check_console_entry_points() -> None:
    """The console script and modules that the images start exist in the environment (--help)."""

    def one(cmd: list[str]) -> str | None:
        argv = [str(BIN / "exgrpo"), *cmd[1:]] if cmd[0] == "exgrpo" else [PYTHON, *cmd[1:]]
        r = run(argv, env=clean_env(), timeout=120)
        if r.returncode != 0 or "usage" not in (r.stdout + r.stderr).lower():
            tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
            return f"`{' '.join(cmd)}` exited {r.returncode}: {' | '.join(tail)}"
        return None

    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as pool:
        errors = [e for e in pool.map(one, CONSOLE_PROBES) if e]
    need(not errors, "\n".join(errors))


def check_started_commands() -> None:
    """Every command that an image, the compose file or a manifest starts parses with the
    command's own parser: Dockerfile CMDs with --help (known options), compose and Kubernetes
    commands in full (values, choices, required options), without running anything."""
    errors = []
    seen = set()
    for where, argv, complete in started_commands():
        env = IMAGE_ENV if ".Dockerfile:" in where else {}
        for w, kind, args in expand_command(argv, where):
            key = (kind, tuple(args), complete, bool(env))
            if key in seen:
                continue
            seen.add(key)
            with patched_environ(env):  # also: nothing of the caller's EXGRPO_* completes a command
                err = check_command(w, kind, args, complete)
            if err:
                errors.append(f"{w}: {err}")
    need(seen, "no command found to check")
    need(not errors, "\n".join(errors))


# ---------------------------------------------------------------------------- registry
CHECKS: dict[str, Callable[[], None]] = {
    "compose_v1_profiles": check_compose_v1_profiles,
    "compose_spec_strict": check_compose_spec_strict,
    "compose_profiles_and_dependencies": check_compose_profiles_and_dependencies,
    "compose_gpu_reservations": check_compose_gpu_reservations,
    "compose_images_and_builds": check_compose_images_and_builds,
    "compose_volumes": check_compose_volumes,
    "compose_pool_settings_and_tokens": check_compose_pool_settings_and_tokens,
    "compose_env_example": check_compose_env_example,
    "compose_trainer_and_worker_settings": check_compose_trainer_and_worker_settings,
    "dockerfiles": check_dockerfiles,
    "dockerfile_builds_offline_ready": check_dockerfile_builds_offline_ready,
    "healthcheck_script": check_healthcheck_script,
    "image_install": check_image_install,
    "trainer_launcher": check_trainer_launcher,
    "k8s_kustomization": check_k8s_kustomization,
    "k8s_schemas": check_k8s_schemas,
    "k8s_references": check_k8s_references,
    "k8s_pool": check_k8s_pool,
    "k8s_storage": check_k8s_storage,
    "k8s_rollout": check_k8s_rollout,
    "k8s_trainer": check_k8s_trainer,
    "k8s_single_node_overlay": check_k8s_single_node_overlay,
    "k8s_optional_monitoring": check_k8s_optional_monitoring,
    "prometheus_config": check_prometheus_config,
    "prometheus_targets": check_prometheus_targets,
    "prometheus_kubernetes_snippet": check_prometheus_kubernetes_snippet,
    "grafana_provisioning": check_grafana_provisioning,
    "grafana_dashboard_structure": check_grafana_dashboard_structure,
    "grafana_queries": check_grafana_queries,
    "console_entry_points": check_console_entry_points,
    "started_commands": check_started_commands,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default="", help="run only the checks whose name contains this")
    args = parser.parse_args(argv)
    passed = failed = 0
    for name, check in CHECKS.items():
        if args.k not in name:
            continue
        start = time.perf_counter()
        try:
            check()
        except Exception as e:  # report every check, then fail
            failed += 1
            sys.stdout.write(f"FAIL {name} ({time.perf_counter() - start:.1f}s): {type(e).__name__}: {e}\n")
        else:
            passed += 1
            sys.stdout.write(f"ok   {name} ({time.perf_counter() - start:.1f}s)\n")
        sys.stdout.flush()
    sys.stdout.write(f"deploy-checks: {passed} passed, {failed} failed\n")
    return 1 if failed or not passed else 0


if __name__ == "__main__":
    sys.exit(main())
