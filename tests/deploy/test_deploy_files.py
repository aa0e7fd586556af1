"""The deployment files are valid and start commands that exist: docker-compose.yml (each profile),
the Dockerfiles, the Kubernetes manifests, Prometheus and Grafana configuration.

The checks live in deploy_checks.py; scripts/ci_deploy_checks.sh runs the same ones. The session
fixture installs the external validators with that script (docker-compose and promtool from
Debian's packages); the Python validators come from the dev extra. A missing validator fails the
test, it is never skipped.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import deploy_checks as dc
import pytest


@pytest.fixture(scope="module", autouse=True)
def validators_installed() -> None:
    script = dc.ROOT / "scripts" / "ci_deploy_checks.sh"
    r = subprocess.run(
        ["bash", str(script), "--install-only"], capture_output=True, text=True, timeout=900, check=False
    )
    assert r.returncode == 0, f"installing the deployment validators failed:\n{r.stderr[-2000:]}"


@pytest.mark.parametrize("name", list(dc.CHECKS))
def test_deploy_check(name: str) -> None:
    dc.CHECKS[name]()


# ----------------------------------------------------------------- the checks catch mistakes
def test_unknown_option_is_caught() -> None:
    err = dc.check_command("t", "exgrpo", ["rollout", "--pool", "p", "--run", "r", "--max-tokens", "8"], True)
    assert err is not None and "--max-tokens" in err


def test_bad_value_and_missing_option_are_caught() -> None:
    bad = dc.check_command("t", "exgrpo", ["rollout", "--pool", "p", "--run", "r", "--engine", "tgi"], True)
    missing = dc.check_command("t", "exgrpo", ["rollout", "--pool", "p"], True)
    assert bad is not None and "--engine" in bad
    assert missing is not None and "--run" in missing


def test_dockerfile_default_command_only_needs_known_options() -> None:
    assert dc.check_command("t", "exgrpo", ["rollout", "--engine", "vllm"], False) is None
    assert dc.check_command("t", "exgrpo", ["rollout", "--bogus"], False) is not None
    assert dc.check_command("t", "exgrpo", ["no-such-command"], False) is not None


def test_trainer_arguments_are_parsed() -> None:
    assert dc.check_command("t", "trainer", ["--config", "x.yaml", "optim.lr=1e-6"], True) is None
    assert dc.check_command("t", "trainer", ["--confg", "x.yaml"], True) is not None


def test_python_c_imports_are_checked() -> None:
    assert dc.check_python_c("from exgrpo_onebox.tiny import build_tiny_model") is None
    assert dc.check_python_c("from exgrpo_onebox.tiny import build_huge_model") is not None
    assert dc.check_python_c("import no_such_module_here") is not None


def test_sh_c_scripts_are_split() -> None:
    probes = dc.expand_command(["sh", "-c", "exgrpo db upgrade && exec exgrpo serve --demo"], "t")
    assert [(kind, args) for _, kind, args in probes] == [
        ("exgrpo", ["db", "upgrade"]),
        ("exgrpo", ["serve", "--demo"]),
    ]


def test_dockerignore_rules() -> None:
    assert dc.dockerignore_allows("services/buffer_api/app.py")
    assert dc.dockerignore_allows("deploy/docker/healthcheck.py")
    assert not dc.dockerignore_allows(".venv/bin/python")
    assert not dc.dockerignore_allows("services/buffer_api/__pycache__/app.cpython-311.pyc")
    assert not dc.dockerignore_allows("tests/deploy/deploy_checks.py")


def test_worker_sampling_mismatch_is_caught() -> None:
    cfg = dc.trainer_config(dc.DEPLOY / "trainer" / "cpu.yaml", [])
    worker = ["exgrpo", "rollout", "--max-new-tokens", str(cfg.rollout.max_new_tokens + 1)]
    with pytest.raises(dc.CheckError, match="max-new-tokens"):
        dc.check_worker_matches_trainer("t", worker, cfg)


def test_k8s_schema_validation_rejects_unknown_fields() -> None:
    import kubernetes_validate
    from kubernetes_validate import utils

    doc = dc.k8s_one("Deployment", "exgrpo-pool")
    broken = {**doc, "spec": {**doc["spec"], "replica": 2}}
    with pytest.raises(utils.ValidationError):
        kubernetes_validate.validate(broken, "1.29.0", strict=True)


def test_compose_spec_rejects_a_bad_gpu_count(tmp_path: Path) -> None:
    import compose_spec
    import yaml

    resolved = dc.compose_resolved()
    svc = resolved["services"]["rollout-vllm"]
    device = svc["deploy"]["resources"]["reservations"]["devices"][0]
    broken = {**device, "count": "one"}
    broken.pop("device_ids", None)
    bad = {
        **resolved,
        "services": {"x": {**svc, "deploy": {"resources": {"reservations": {"devices": [broken]}}}}},
    }
    with pytest.raises(ValueError, match="count"):
        compose_spec.PyCompose.from_yaml(yaml.safe_dump(bad))


def test_promtool_rejects_bad_promql(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text("groups:\n  - name: g\n    rules:\n      - record: x\n        expr: sum(rate(x[5m])\n")
    r = dc.promtool("check", "rules", str(rules))
    assert r.returncode != 0


def test_tools_are_found() -> None:
    assert os.access(dc.tool("docker-compose"), os.X_OK)
    assert os.access(dc.tool("promtool"), os.X_OK)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["c10d", "static"])
def test_launcher_two_nodes_meet_at_the_rendezvous(backend: str) -> None:
    """Two launcher "nodes" on this machine find each other as the Kubernetes pods would."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dc.clean_env(
        NNODES="2",
        NPROC_PER_NODE="1",
        RDZV_BACKEND=backend,
        RDZV_ENDPOINT=f"127.0.0.1:{port}",
        RDZV_JOIN_TIMEOUT="120",
    )
    nodes = [
        subprocess.Popen(
            ["sh", str(dc.LAUNCHER), "--help"],
            env={**env, "JOB_COMPLETION_INDEX": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    for node, out in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, out[-2000:]
        assert "--config FILE" in out


def test_image_default_rollout_command_reads_pool_and_run_from_the_environment() -> None:
    cmd = ["rollout", "--engine", "transformers"]
    with dc.patched_environ({}):
        missing = dc.check_command("t", "exgrpo", cmd, True)
    with dc.patched_environ(dc.IMAGE_ENV):
        complete = dc.check_command("t", "exgrpo", cmd, True)
    assert missing is not None and "--pool" in missing
    assert complete is None


def test_placeholder_secrets_check_fails_when_they_are_accepted() -> None:
    real = {
        "EXGRPO_TOKENS": '[{"token": "0123456789abcdef-real", "scopes": ["admin"]}]',
        "EXGRPO_DATABASE_URL": "postgresql+asyncpg://u:s3cret-value@db:5432/x",
    }
    with pytest.raises(dc.CheckError, match="accepts the example"):
        dc.example_pool_settings(real)
    placeholder = {**real, "EXGRPO_TOKENS": '[{"token": "REPLACE-ME-admin-token-0000", "scopes": ["admin"]}]'}
    assert dc.example_pool_settings(placeholder).allow_example_secrets


def test_strategic_merge_merges_named_items_and_replaces_the_rest() -> None:
    base = {"spec": {"n": 2, "c": [{"name": "a", "env": [{"name": "X", "value": "1"}], "args": ["p", "q"]}]}}
    patch = {"spec": {"n": 1, "c": [{"name": "a", "env": [{"name": "Y", "value": "2"}], "args": ["r"]}]}}
    merged = dc.strategic_merge(base, patch)
    assert merged["spec"]["n"] == 1
    (container,) = merged["spec"]["c"]
    assert container["env"] == [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}]
    assert container["args"] == ["r"]


def test_compose_check_script_parses_and_refuses_a_gpu_run_here() -> None:
    script = dc.ROOT / "scripts" / "compose_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    r = subprocess.run(
        ["bash", str(script), "--profile", "gpu"], capture_output=True, text=True, timeout=60, check=False
    )
    assert r.returncode == 2 and "--dry-run" in r.stderr
    r = subprocess.run(
        ["bash", str(script), "--bogus"], capture_output=True, text=True, timeout=60, check=False
    )
    assert r.returncode == 2 and "unknown argument" in r.stderr
