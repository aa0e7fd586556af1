"""The blocking `Client` against a real service on a loopback port (`live_server`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from shared_data import VALID, needs

from exgrpo_client import Client, GroupResult, NotFound, TransportError, rollout
from exgrpo_client.io import read_questions


def _group(question_id: int, k: int, *, replayed: bool = False) -> GroupResult:
    rows = [rollout(1.0, None, None, replayed=True)] if replayed else []
    for j in range(k - len(rows)):
        reward = 1.0 if (question_id + j) % 3 == 0 else 0.0
        rows.append(rollout(reward, np.array([question_id, j, 7]), [-0.1, -0.2, -0.3]))
    return GroupResult(question_id=question_id, rollouts=rows)


@needs(VALID)
def test_full_step_over_http(live_server: Any, pool_name: str, tmp_path: Path) -> None:
    with Client(live_server.url, timeout=60) as client:
        assert client.health().ok and client.ready().ok
        client.create_pool(pool_name, {"k": 4, "batch_size": 8, "start_threshold": 0.3})
        questions = [q for batch in read_questions(VALID, limit=600) for q in batch]
        imported = client.import_questions(pool_name, questions, 250)
        assert imported.received == 600 and imported.inserted == imported.num_questions > 100
        run = client.create_run(pool_name, "r1", 3)
        assert run.seed == 3

        for step in (1, 2, 3):
            plan = client.plan_batch(pool_name, "r1")
            groups = [_group(f.question_id, 4) for f in plan.fresh]
            groups += [_group(r.question_id, 4, replayed=True) for r in plan.replay]
            result = client.commit_batch(pool_name, plan.id, groups, policy_version=step)
            assert result.step == step

        stats = client.pool_stats(pool_name)
        (run_stats,) = stats.runs
        assert run_stats.step == 3 and run_stats.policy_version == 3 and run_stats.phase == "mixed"
        assert stats.num_trajectories == run_stats.trajectories > 0
        assert sum(1 for _ in client.iter_questions(pool_name, page_size=100)) == imported.num_questions

        exported = client.export_pool(pool_name, tmp_path / "export.ndjson")
        assert exported.header.num_trajectories == stats.num_trajectories
        copy = client.import_pool(tmp_path / "export.ndjson", name=f"{pool_name}-copy")
        assert (copy.questions, copy.trajectories, copy.runs) == (
            imported.num_questions,
            stats.num_trajectories,
            1,
        )
        assert client.run_stats(f"{pool_name}-copy", "r1").step == 3


def test_not_found_over_http(live_server: Any) -> None:
    with (
        Client(live_server.url) as client,
        pytest.raises(NotFound, match="pool 'does-not-exist' does not exist"),
    ):
        client.pool_stats("does-not-exist")


def test_unreachable_service() -> None:
    with (
        Client("http://127.0.0.1:9", retries=1, backoff=0, timeout=5) as client,
        pytest.raises(TransportError, match="is the pool service running"),
    ):
        client.list_pools()


def test_every_other_call_over_http(live_server: Any, pool_name: str) -> None:
    """The blocking twins of the calls the async tests cover in depth, once each."""
    questions = [{"prompt": f"{i} * 3 = ?", "ground_truth": str(3 * i)} for i in range(12)]
    questions = [{**q, "prompt": [{"role": "user", "content": q["prompt"]}]} for q in questions]
    with Client(live_server.url) as client:
        client.create_pool(pool_name, {"k": 2, "batch_size": 4})
        client.import_questions(pool_name, questions)
        assert client.update_pool(pool_name, config={"batch_size": 3}).config.batch_size == 3
        page = client.list_questions(pool_name, after=0, limit=5)
        assert page.count == 5 and client.question(pool_name, page.data[0].id).ground_truth == "0"
        assert pool_name in {p.name for p in client.list_pools().data}

        client.create_run(pool_name, "r1")
        assert client.get_run(pool_name, "r1").name == "r1"
        assert [r.name for r in client.list_runs(pool_name).data] == ["r1"]
        assert client.update_run(pool_name, "r1", phase="mixed").phase == "mixed"
        assert client.run_stats(pool_name, "r1").phase == "mixed"
        assert client.add_policy_version(pool_name, "r1", 1, "file:///w/1").version == 1
        assert client.list_policy_versions(pool_name, "r1").count == 1

        ids = [q.id for q in page.data]
        ingested = client.ingest(pool_name, "r1", [_group(ids[1], 2), _group(ids[2], 2)], 1)
        assert ingested.collected_groups + ingested.ignored_groups == 2
        assert client.select(pool_name, "r1", 2, seed=1).run == "r1"
        assert client.rebuild_index(pool_name) and "indexed_questions" in client.rebuild_index()

        plan = client.plan_batch(pool_name, "r1", create_tasks=True, batch_size=2, experience_ratio=0)
        assert client.get_batch(pool_name, plan.id) == plan
        claimed = client.claim_tasks(pool_name, "r1", "w", max_tasks=2).data
        assert len(claimed) == 2 and all(t.lease_token for t in claimed)
        first, second = claimed
        client.renew_task(pool_name, first.id, first.lease_token or "")
        client.complete_task(
            pool_name, first.id, first.lease_token or "", _group(first.question_id, 2).rollouts
        )
        assert client.fail_task(pool_name, second.id, second.lease_token or "", "boom").status == "pending"
        assert client.batch_status(pool_name, plan.id).tasks_completed == 1
        assert not client.batch_results(pool_name, plan.id, wait=0.1).complete
