"""Export and import of a whole pool as NDJSON: one header line, then runs, policy versions,
questions, per-run states and trajectories (payloads as base64 packed arrays).

Import happens in one transaction: a broken line anywhere leaves the database unchanged.
Epoch orders are not exported: an imported run starts a new epoch on its next batch.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from pydantic import ValidationError

from exgrpo_client import schemas as s
from exgrpo_pool.domain import trajectory_key
from exgrpo_pool.errors import BadRequest, Conflict
from exgrpo_pool.service.context import Context
from exgrpo_pool.service.convert import b64, content_hash, pool_config
from exgrpo_pool.store import repo
from exgrpo_pool.store.models import POOLED_SCOPE, PolicyVersion, Pool, Run, utcnow

_PAGE = 2000


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, separators=(",", ":"), default=str) + "\n").encode()


async def export_pool(ctx: Context, pool: Pool) -> AsyncIterator[bytes]:
    async with ctx.db.read() as session:
        nq, nt, nr = await repo.pool_counts(session, pool.id)
        header = s.ExportHeader(
            pool=s.PoolCreate(name=pool.name, config=pool_config(pool), description=pool.description),
            num_questions=nq,
            num_trajectories=nt,
            num_runs=nr,
        )
        yield _line({"type": "header", **header.model_dump()})
        for r in await repo.list_runs(session, pool.id):
            yield _line(
                {
                    "type": "run",
                    "id": r.id,
                    "name": r.name,
                    "seed": r.seed,
                    "phase": r.phase,
                    "switched_at_step": r.switched_at_step,
                    "step": r.step,
                    "policy_version": r.policy_version,
                    "overrides": r.overrides,
                }
            )
            for pv in await repo.policy_versions(session, r.id):
                yield _line(
                    {
                        "type": "policy_version",
                        "run": r.id,
                        "version": pv.version,
                        "uri": pv.uri,
                        "step": pv.step,
                    }
                )
        after = 0
        while qs := await repo.list_questions(session, pool.id, after, _PAGE):
            for q in qs:
                yield _line(
                    {
                        "type": "question",
                        "id": q.id,
                        "prompt": q.prompt,
                        "ground_truth": q.ground_truth,
                        "data_source": q.data_source,
                        "external_id": q.external_id,
                        "metadata": q.meta,
                    }
                )
            after = qs[-1].id
        key = (-1, 0)
        while states := await repo.pool_states(session, pool.id, key, _PAGE):
            for st in states:
                yield _line(
                    {
                        "type": "state",
                        "scope": st.scope,
                        "question": st.question_id,
                        "last_k": st.last_k,
                        "bucket": st.bucket,
                        "retired": st.retired,
                        "last_step": st.last_step,
                    }
                )
            key = (states[-1].scope, states[-1].question_id)
        after = 0
        while ts := await repo.pool_trajectories(session, pool.id, after, _PAGE // 4):
            for t in ts:
                yield _line(
                    {
                        "type": "trajectory",
                        "question": t.question_id,
                        "source_run": t.source_run_id,
                        "policy_version": t.policy_version,
                        "step": t.step,
                        "token_ids_b64": b64(t.token_ids),
                        "logprobs_b64": b64(t.logprobs),
                        "reward": t.reward,
                        "entropy": t.entropy,
                    }
                )
            after = ts[-1].id


class _Importer:
    def __init__(self, session: repo.AsyncSession, name: str | None) -> None:
        self.session = session
        self.name_override = name
        self.pool: Pool | None = None
        self.runs: dict[int, int] = {}
        self.questions: dict[int, int] = {}
        self.pending_q: list[tuple[int, dict[str, Any]]] = []
        self.counts = {"questions": 0, "runs": 0, "states": 0, "trajectories": 0, "duplicates": 0}

    async def header(self, obj: dict[str, Any]) -> None:
        h = s.ExportHeader.model_validate({k: v for k, v in obj.items() if k != "type"}, strict=False)
        name = self.name_override or h.pool.name
        if await repo.get_pool(self.session, name) is not None:
            raise Conflict(f"pool {name!r} already exists; import under another name (?name=...)")
        now = utcnow()
        self.pool = Pool(
            name=name,
            description=h.pool.description,
            config=h.pool.config.model_dump(),
            created_at=now,
            updated_at=now,
        )
        self.session.add(self.pool)
        await self.session.flush()

    async def flush_questions(self) -> None:
        if not self.pending_q:
            return
        assert self.pool is not None
        rows = [row for _, row in self.pending_q]
        await repo.insert_questions(self.session, rows)
        # map old ids to new ones through the content hash (duplicates collapse onto one question)
        by_hash = {}
        for chunk_start in range(0, len(rows), 1000):
            hashes = [r["content_hash"] for r in rows[chunk_start : chunk_start + 1000]]
            by_hash.update(await repo.question_ids_by_hash(self.session, self.pool.id, hashes))
        for old, row in self.pending_q:
            self.questions[old] = by_hash[row["content_hash"]]
        self.counts["questions"] += len(rows)
        self.pending_q = []

    async def line(self, obj: dict[str, Any]) -> None:
        kind = obj.get("type")
        if kind == "header":
            await self.header(obj)
            return
        if self.pool is None:
            raise BadRequest("the first line of an import must be the export header")
        now = utcnow()
        if kind == "run":
            run = Run(
                pool_id=self.pool.id,
                name=obj["name"],
                seed=int(obj["seed"]),
                phase=obj["phase"],
                switched_at_step=obj.get("switched_at_step"),
                step=int(obj["step"]),
                policy_version=int(obj["policy_version"]),
                epoch=-1,
                cursor=0,
                overrides=s.RunOverrides.model_validate(
                    obj.get("overrides") or {}, strict=False
                ).model_dump(),
                created_at=now,
                updated_at=now,
            )
            self.session.add(run)
            await self.session.flush()
            self.runs[int(obj["id"])] = run.id
            self.counts["runs"] += 1
        elif kind == "policy_version":
            self.session.add(
                PolicyVersion(
                    run_id=self.runs[int(obj["run"])],
                    version=int(obj["version"]),
                    uri=str(obj["uri"]),
                    step=int(obj["step"]),
                    created_at=now,
                )
            )
        elif kind == "question":
            q = s.QuestionCreate.model_validate(
                {k: obj.get(k) for k in ("prompt", "ground_truth", "data_source", "external_id", "metadata")}
                | {"metadata": obj.get("metadata") or {}, "data_source": obj.get("data_source") or ""},
                strict=False,
            )
            prompt = [m.model_dump() for m in q.prompt]
            self.pending_q.append(
                (
                    int(obj["id"]),
                    {
                        "pool_id": self.pool.id,
                        "content_hash": content_hash(prompt, q.ground_truth),
                        "prompt": prompt,
                        "ground_truth": q.ground_truth,
                        "data_source": q.data_source,
                        "external_id": q.external_id,
                        "metadata": q.metadata,
                        "created_at": now,
                    },
                )
            )
            if len(self.pending_q) >= 1000:
                await self.flush_questions()
        elif kind == "state":
            await self.flush_questions()
            scope = int(obj["scope"])
            new_scope = POOLED_SCOPE if scope == POOLED_SCOPE else self.runs[scope]
            kind_ = "retire" if obj["retired"] else ("collect" if obj.get("bucket") else "ignore")
            await repo.upsert_states(
                self.session,
                kind_,
                [
                    {
                        "scope": new_scope,
                        "question_id": self.questions[int(obj["question"])],
                        "pool_id": self.pool.id,
                        "last_k": int(obj["last_k"]),
                        "bucket": obj.get("bucket"),
                        "retired": bool(obj["retired"]),
                        "last_step": int(obj["last_step"]),
                        "last_run_id": None,
                        "updated_at": now,
                    }
                ],
            )
            self.counts["states"] += 1
        elif kind == "trajectory":
            await self.flush_questions()
            ids = np.frombuffer(base64.b64decode(obj["token_ids_b64"], validate=True), dtype="<i4")
            lps = base64.b64decode(obj["logprobs_b64"], validate=True)
            if len(lps) != ids.nbytes:
                raise BadRequest("trajectory line: token ids and log-probs differ in length")
            src = obj.get("source_run")
            n = await repo.insert_trajectories(
                self.session,
                [
                    {
                        "question_id": self.questions[int(obj["question"])],
                        "pool_id": self.pool.id,
                        "source_run_id": None if src is None else self.runs.get(int(src)),
                        "policy_version": int(obj["policy_version"]),
                        "step": int(obj["step"]),
                        "token_ids": ids.tobytes(),
                        "logprobs": lps,
                        "num_tokens": int(ids.size),
                        "reward": float(obj["reward"]),
                        "entropy": obj.get("entropy"),
                        "dedup_key": trajectory_key(ids),
                        "created_at": now,
                    }
                ],
            )
            self.counts["trajectories"] += n
            self.counts["duplicates"] += 1 - n
        else:
            raise BadRequest(f"unknown record type {kind!r}")


async def split_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Lines of a streamed body, whatever its chunking."""
    rest = b""
    async for chunk in chunks:
        rest += chunk
        *lines, rest = rest.split(b"\n")
        for line in lines:
            yield line
    if rest:
        yield rest


async def import_pool(ctx: Context, chunks: AsyncIterator[bytes], name: str | None) -> s.PoolImported:
    lines = split_lines(chunks)
    async with ctx.db.write() as session:
        imp = _Importer(session, name)
        lineno = 0
        async for raw in lines:
            lineno += 1
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
                if not isinstance(obj, dict):
                    raise ValueError("not a JSON object")
                await imp.line(obj)
            except (ValueError, KeyError, TypeError, ValidationError) as e:
                raise BadRequest(f"import line {lineno}: {type(e).__name__}: {e}") from e
        await imp.flush_questions()
        if imp.pool is None:
            raise BadRequest("empty import: expected an export header line")
        pool_name = imp.pool.name
    return s.PoolImported(pool=pool_name, **imp.counts)
