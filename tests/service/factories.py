"""Builders of requests for the service tests, and a reference model of the ExGRPO pool rules.

The defaults are deliberately small (K = 4 rollouts per question, B = 8 questions per step) so a
whole training loop of several steps runs in a fraction of a second.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from exgrpo_client.schemas import pack_ids, pack_logprobs, unpack_ids, unpack_logprobs

K = 4
B = 8

RewardFn = Callable[[int, int], float]
"""reward_fn(question_id, row) -> reward of row `row` (0..K-1) of the question's group. In the
group of a replayed question, row 0 is the replayed stored trajectory."""

TokenFn = Callable[[int, int], list[int]]
"""tokens(question_id, row) -> token ids of that rollout."""


def default_tokens(qid: int, row: int) -> list[int]:
    return [qid, row + 1, 7, 11 * (row + 1)]


def logprobs_for(ids: Iterable[int]) -> list[float]:
    """Deterministic log-probs that float32 represents exactly (multiples of 1/8 in [-1, -1/8])."""
    return [-((i % 8) + 1) / 8 for i in ids]


def question_body(i: int, *, data_source: str = "test") -> dict[str, Any]:
    return {
        "prompt": [{"role": "user", "content": f"What is {i} + 0? Put the answer in \\boxed{{}}."}],
        "ground_truth": str(i),
        "data_source": data_source,
        "external_id": f"q-{i}",
    }


def ok(r: httpx.Response, status: int = 200) -> Any:
    assert r.status_code == status, (
        f"{r.request.method} {r.request.url.path}: {r.status_code} {r.text[:2000]}"
    )
    return r.json()


# ------------------------------------------------------------------------------ resources
async def create_pool(
    client: httpx.AsyncClient,
    name: str = "p1",
    *,
    k: int = K,
    batch_size: int = B,
    description: str = "",
    **config: Any,
) -> dict[str, Any]:
    body = {"name": name, "description": description, "config": {"k": k, "batch_size": batch_size, **config}}
    return ok(await client.post("/v1/pools", json=body), 201)


async def import_questions(
    client: httpx.AsyncClient, pool: str = "p1", n: int = 24, *, start: int = 0
) -> dict[str, Any]:
    body = {"questions": [question_body(i) for i in range(start, start + n)]}
    return ok(await client.post(f"/v1/pools/{pool}/questions", json=body))


async def create_run(
    client: httpx.AsyncClient,
    pool: str = "p1",
    name: str = "r1",
    *,
    seed: int = 0,
    phase: str = "on_policy",
    **overrides: Any,
) -> dict[str, Any]:
    body = {"name": name, "seed": seed, "phase": phase, "overrides": overrides}
    return ok(await client.post(f"/v1/pools/{pool}/runs", json=body), 201)


async def setup_pool(
    client: httpx.AsyncClient,
    pool: str = "p1",
    *,
    questions: int = 24,
    runs: Iterable[str] = ("r1",),
    phase: str = "on_policy",
    seed: int = 0,
    **config: Any,
) -> None:
    """A pool with `questions` questions and the given runs."""
    await create_pool(client, pool, **config)
    await import_questions(client, pool, questions)
    for name in runs:
        await create_run(client, pool, name, seed=seed, phase=phase)


async def plan_batch(
    client: httpx.AsyncClient, pool: str = "p1", run: str = "r1", **body: Any
) -> dict[str, Any]:
    return ok(await client.post(f"/v1/pools/{pool}/runs/{run}/batches", json=body), 201)


async def commit_batch(
    client: httpx.AsyncClient, plan: dict[str, Any], body: dict[str, Any], **headers: str
) -> httpx.Response:
    return await client.post(
        f"/v1/pools/{plan['pool']}/batches/{plan['id']}/commit", json=body, headers=headers
    )


async def pool_stats(client: httpx.AsyncClient, pool: str = "p1") -> dict[str, Any]:
    return ok(await client.get(f"/v1/pools/{pool}/stats"))


async def run_stats(client: httpx.AsyncClient, pool: str = "p1", run: str = "r1") -> dict[str, Any]:
    return ok(await client.get(f"/v1/pools/{pool}/runs/{run}/stats"))


async def question_detail(
    client: httpx.AsyncClient, qid: int, pool: str = "p1", *, payload: bool = False
) -> dict[str, Any]:
    return ok(await client.get(f"/v1/pools/{pool}/questions/{qid}", params={"payload": payload}))


async def all_questions(client: httpx.AsyncClient, pool: str = "p1") -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    after = 0
    while True:
        page = ok(await client.get(f"/v1/pools/{pool}/questions", params={"after": after, "limit": 1000}))
        out += page["data"]
        if page["next_after"] is None:
            return out
        after = page["next_after"]


# --------------------------------------------------------------------------------- groups
def rollout(
    qid: int, row: int, reward: float, tokens: TokenFn = default_tokens, *, b64: bool = True
) -> dict[str, Any]:
    ids = tokens(qid, row)
    lps = logprobs_for(ids)
    r: dict[str, Any] = {"reward": reward, "finish_reason": "stop"}
    if b64:
        r |= {"token_ids_b64": pack_ids(ids), "logprobs_b64": pack_logprobs(lps)}
    else:
        r |= {"token_ids": ids, "logprobs": lps}
    return r


def group(
    qid: int,
    rewards: list[float],
    tokens: TokenFn = default_tokens,
    *,
    replay_trajectory_id: int | None = None,
    b64: bool = True,
) -> dict[str, Any]:
    """One graded group; with `replay_trajectory_id` row 0 is the replayed stored trajectory."""
    rows = []
    for row, reward in enumerate(rewards):
        if row == 0 and replay_trajectory_id is not None:
            rows.append({"reward": reward, "replayed": True})
        else:
            rows.append(rollout(qid, row, reward, tokens, b64=b64))
    g: dict[str, Any] = {"question_id": qid, "rollouts": rows}
    if replay_trajectory_id is not None:
        g["replay_trajectory_id"] = replay_trajectory_id
    return g


def make_groups(
    plan: dict[str, Any], reward_fn: RewardFn, tokens: TokenFn = default_tokens, *, b64: bool = True
) -> dict[str, Any]:
    """The commit body of a planned batch: one group of K rollouts per planned question, payloads
    as base64 packed arrays (or JSON lists with b64=False)."""
    k = plan["k"]
    groups = [
        group(f["question_id"], [reward_fn(f["question_id"], j) for j in range(k)], tokens, b64=b64)
        for f in plan["fresh"]
    ]
    for item in plan["replay"]:
        qid = item["question_id"]
        groups.append(
            group(
                qid,
                [reward_fn(qid, j) for j in range(k)],
                tokens,
                replay_trajectory_id=item["candidates"][0]["id"],
                b64=b64,
            )
        )
    return {"groups": groups}


def correct_first(num_correct: Callable[[int], int]) -> RewardFn:
    """A reward function where the first num_correct(qid) rows of a group are correct."""
    return lambda qid, row: 1.0 if row < num_correct(qid) else 0.0


def payload_of(r: dict[str, Any]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    if "token_ids_b64" in r:
        return tuple(unpack_ids(r["token_ids_b64"])), tuple(unpack_logprobs(r["logprobs_b64"]))
    return tuple(r["token_ids"]), tuple(r["logprobs"])


# ---------------------------------------------------------------------- reference model
@dataclass
class Scope:
    """What the service should know about one scope (a run, or a pooled pool)."""

    bucket: dict[int, int] = field(default_factory=dict)
    last_k: dict[int, int] = field(default_factory=dict)
    retired: set[int] = field(default_factory=set)

    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.bucket.values()).items()))

    @property
    def eligible(self) -> set[int]:
        return set(self.bucket)


@dataclass
class Model:
    """Spec 2-3 applied to the same groups the service gets: retire on k = K in every phase; in the
    mixed phase collect 0 < k < K (bucket k, store the correct non-replayed rollouts, de-duplicated
    per question); k = 0 keeps the old bucket; a retired question never comes back, and its
    trajectories are removed at the end of the request (`drop_retired`; not with shared
    trajectories, which other runs still replay)."""

    k: int = K
    drop_retired: bool = True
    scopes: dict[str, Scope] = field(default_factory=dict)
    trajectories: set[tuple[int, tuple[int, ...]]] = field(default_factory=set)

    def scope(self, name: str) -> Scope:
        return self.scopes.setdefault(name, Scope())

    def apply(self, scope: str, body: dict[str, Any], *, collect: bool) -> None:
        sc = self.scope(scope)
        retired: set[int] = set()
        for g in body["groups"]:
            qid = g["question_id"]
            correct = [r for r in g["rollouts"] if r["reward"] == 1.0]
            n = len(correct)
            sc.last_k[qid] = n
            if n == self.k:
                sc.retired.add(qid)
                sc.bucket.pop(qid, None)
                retired.add(qid)
            elif collect and 0 < n < self.k:
                if qid not in sc.retired:
                    sc.bucket[qid] = n
                for r in correct:
                    if not r.get("replayed"):
                        self.trajectories.add((qid, payload_of(r)[0]))
        if self.drop_retired:
            self.trajectories = {t for t in self.trajectories if t[0] not in retired}
