"""`exgrpo prepare`: the compose `cpu` profile's init job. Against a live service it builds the
warm-started model, creates the pool of synthetic questions with the recipe's rules and the run with
its batch rules; run again it keeps what is there; a pool of that name with other questions is
refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from exgrpo_cli.main import app
from exgrpo_client import Client, PoolConfig
from exgrpo_onebox.config import MainJobOptions
from exgrpo_onebox.prepare import prepare_service
from exgrpo_pool.config import Settings
from exgrpo_pool.embedded import serve_in_thread


@pytest.mark.timeout(300)
def test_prepare_builds_model_pool_and_run_once(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}",
        allow_anonymous=True,
        host="127.0.0.1",
        port=0,
        log_level="WARNING",
    )
    model = tmp_path / "models" / "arith-warm"
    with serve_in_thread(settings) as srv, Client(srv.url) as client:
        args = ["--url", srv.url, "prepare", "--model-out", str(model), "--quick", "--pool", "demo"]
        args += ["--run", "demo", "job.train_questions=40", "experience.start_threshold=0.05", "--json"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        facts = json.loads(result.stdout)
        assert facts == {
            "model": str(model),
            "pool": "demo",
            "run": "demo",
            "questions": 40,
            "pool_created": True,
        }
        assert (model / "model.safetensors").is_file() and (model / "warmstart.json").is_file()
        pool = client.get_pool("demo")
        assert (pool.config.k, pool.config.batch_size, pool.config.start_threshold) == (8, 16, 0.05)
        (run,) = client.list_runs("demo").data
        assert run.name == "demo" and run.overrides.start_threshold == 0.05
        assert run.overrides.batch_size == 16

        opts = MainJobOptions(quick=True, overrides=["run.pool=demo", "run.name=demo"])
        again = prepare_service(client, opts, model)
        assert (again.created, again.questions) == (False, 40)
        assert len(client.list_runs("demo").data) == 1

        client.create_pool("browse", config=PoolConfig(), description="demo pool: example questions")
        other = MainJobOptions(quick=True, overrides=["run.pool=browse", "run.name=demo"])
        with pytest.raises(ValueError, match="exists with other questions"):
            prepare_service(client, other, model)
        assert client.list_runs("browse").data == []
