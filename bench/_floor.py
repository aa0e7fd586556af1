"""The floor of `pool_bench.py --floor`: the least code that does the pool service's plan, commit,
select and ingest on the benchmark's seeded pool, to measure the service against.

One uvicorn process (as ``_serve.py`` runs the service: uvloop, httptools), a raw ASGI app (no
framework, no pydantic), orjson + the service's base64 (SIMD), or the service's own binary frames
(``exgrpo_client.frames``), the database driver without an ORM (``sqlite3`` in the event loop,
``asyncpg`` on one connection), one transaction per request with the idempotency record inside it.
It does the same reads and writes as the service on a copy of the same database:

* plan: lock the run row, look up an open batch of the step, take the next B questions of the
  run's epoch order (a new epoch when it runs out), sample replays by bucket with the service's own
  sampler (``sample_replay``, ``make_rng``: the same picks from the same index), check the picks'
  states, read their stored trajectories with payloads (once, not twice), read the questions, insert
  the batch with its plan, advance the run's cursor; answer with every candidate's payload.
* commit: check the body once (K rollouts per group, payload lengths), lock the batch's run, check
  the groups against the plan, decide each group with the service's rule (``decide_group``), read
  the old states, upsert the states, insert the trajectories (SHA-256 dedup key, ON CONFLICT DO
  NOTHING), delete retired questions' trajectories, advance the run, mark the batch committed with
  its result and the digest of what it applied (SHA-256 of the groups and a frame's payloads), upsert
  the step's metrics; then move the questions in the in-process bucket index.
* select: the replay part of a plan, read-only.
* ingest: lock the run row, check the questions are in the pool, then the commit's rules and writes
  (collection in the mixed phase), without the batch.

What it leaves out (the service does it): Redis (the floor's bucket index lives in its process on
both backends), leases and fencing tokens, authentication, pydantic validation of every field of
the body, run-level overrides and other pool sharing modes, capacity limits (none are set in the
seeded pool), generation tasks (not asked for by the benchmark), metrics counters, error answers
beyond a plain 4xx, a replayed idempotent request's answer.

Usage (``pool_bench.py --floor`` starts it): ``FLOOR_DATABASE=<sqlite file or postgresql:// URL>
FLOOR_PORT=<port> python bench/_floor.py``.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import os
import sqlite3
import urllib.parse
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, get_args

import numpy as np
import orjson
import uvicorn

from exgrpo_client import frames
from exgrpo_client import schemas as s
from exgrpo_pool import app as service_app
from exgrpo_pool.app import keep_freed_memory
from exgrpo_pool.domain import (
    GroupAction,
    compose_batch,
    decide_group,
    epoch_order,
    make_rng,
    sample_replay,
    take_fresh,
    trajectory_key,
)
from exgrpo_pool.service.convert import rules_of
from exgrpo_pool.store.db import SQLITE_CACHE_MB

#: a new run's phases, and the overrides the service stores for a run created without any
_PHASES = get_args(s.Phase)
_OVERRIDES = orjson.dumps(s.RunOverrides().model_dump()).decode()
_TRAJ_COLS = "id, question_id, source_run_id, policy_version, step, reward, entropy, num_tokens, created_at"
#: the trajectory tally's periods (migrations 0014 and 0015): ten seconds of `created_at` from
#: the epoch, stored with each trajectory; those long past folded into period 0 as the service
#: folds them (on Postgres after every `_FOLD_EVERY` writes, on SQLite as a run opens a period)
_PERIOD_S = 10
_PERIOD = timedelta(seconds=_PERIOD_S)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class Db:
    """One connection; `?` placeholders (rewritten to `$n` for asyncpg)."""

    pg: bool

    async def fetch(self, sql: str, *args: Any) -> list[Any]:
        raise NotImplementedError

    async def execute(self, sql: str, *args: Any) -> None:
        raise NotImplementedError

    async def executemany(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        raise NotImplementedError

    async def begin(self) -> None:
        raise NotImplementedError

    async def end(self, ok: bool) -> None:
        raise NotImplementedError


class SqliteDb(Db):
    pg = False

    def __init__(self, path: str) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        # as the service: its page cache, SQLite's own checkpoint bound raised, the WAL copied into
        # the database file after each write by a second connection in a thread, off the request's path
        pragmas = ("journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON", "busy_timeout=30000")
        for pragma in (*pragmas, "wal_autocheckpoint=16384", f"cache_size=-{SQLITE_CACHE_MB * 1024}"):
            self.conn.execute(f"PRAGMA {pragma}")
        self.checkpointer = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.checkpointer.execute("PRAGMA busy_timeout=30000")
        self.checkpoint: asyncio.Task[None] | None = None
        self.again = False

    async def fetch(self, sql: str, *args: Any) -> list[Any]:
        return self.conn.execute(sql, args).fetchall()

    async def execute(self, sql: str, *args: Any) -> None:
        self.conn.execute(sql, args)

    async def executemany(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        self.conn.executemany(sql, rows)

    async def begin(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")

    async def end(self, ok: bool) -> None:
        self.conn.execute("COMMIT" if ok else "ROLLBACK")
        if not ok:
            return
        if self.checkpoint is not None and not self.checkpoint.done():
            self.again = True
        else:
            self.checkpoint = asyncio.get_running_loop().create_task(self._checkpoint())

    async def _checkpoint(self) -> None:
        again = True
        while again:
            self.again = False
            await asyncio.to_thread(self.checkpointer.execute, "PRAGMA wal_checkpoint(PASSIVE)")
            again = self.again


def _dollars(sql: str) -> str:
    parts = sql.split("?")
    return "".join(p + (f"${i + 1}" if i < len(parts) - 1 else "") for i, p in enumerate(parts))


#: Postgres: the tallies' cells (keys, counts), folded as the service folds them (`repo.fold_tallies`)
_TALLY_CELLS = {
    "state_tally": (("scope", "bucket", "retired"), ("n",)),
    "trajectory_tally": (("pool_id", "run_id", "period"), ("n", "tokens")),
    "question_tally": (("pool_id",), ("n",)),
}
_FOLD_EVERY, _FOLD_AFTER_S = 64, 600


class PgDb(Db):
    pg = True

    def __init__(self, conn: Any, url: str) -> None:
        self.conn = conn
        self.tx: Any = None
        # the tallies folded after every `_FOLD_EVERY` writes in a task on a connection of its own,
        # as the service folds them: their statement triggers add a row per statement and cell,
        # and a floor that never folded them read ever more rows for its stats
        self.url = url
        self.writes = 0
        self.fold_conn: Any = None
        self.folding: asyncio.Task[None] | None = None

    async def _fold(self) -> None:
        import asyncpg

        if self.fold_conn is None:
            self.fold_conn = await asyncpg.connect(self.url)
        cut = (datetime.now(UTC) - timedelta(seconds=_FOLD_AFTER_S) - _EPOCH) // _PERIOD
        async with self.fold_conn.transaction():
            await self.fold_conn.execute(
                "UPDATE trajectory_tally SET period = 0 WHERE period > 0 AND period < $1", cut
            )
            for table, (keys, counts) in _TALLY_CELLS.items():
                key_list, sums = ", ".join(keys), ", ".join(f"sum({c})" for c in counts)
                nonzero = " OR ".join(f"sum({c}) <> 0" for c in counts)
                await self.fold_conn.execute(
                    f"WITH gone AS (DELETE FROM {table} WHERE ({key_list}) IN (SELECT {key_list} "
                    f"FROM {table} GROUP BY {key_list} HAVING count(*) > 1 OR NOT ({nonzero})) RETURNING *) "
                    f"INSERT INTO {table} ({key_list}, {', '.join(counts)}) SELECT {key_list}, {sums} "
                    f"FROM gone GROUP BY {key_list} HAVING {nonzero}"
                )

    async def fetch(self, sql: str, *args: Any) -> list[Any]:
        return list(await self.conn.fetch(_dollars(sql), *args))

    async def execute(self, sql: str, *args: Any) -> None:
        await self.conn.execute(_dollars(sql), *args)

    async def executemany(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        await self.conn.executemany(_dollars(sql), rows)

    async def begin(self) -> None:
        self.tx = self.conn.transaction()
        await self.tx.start()

    async def end(self, ok: bool) -> None:
        await (self.tx.commit() if ok else self.tx.rollback())
        if ok:
            self.writes += 1
            if self.writes >= _FOLD_EVERY and (self.folding is None or self.folding.done()):
                self.writes = 0
                self.folding = asyncio.get_running_loop().create_task(self._fold())


class Refused(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status


def _in(n: int) -> str:
    return ",".join("?" * n)


class Floor:
    def __init__(self, db: Db) -> None:
        self.db = db
        self.index: dict[int, dict[int, list[int]]] = {}
        self.epochs: dict[int, np.ndarray] = {}
        # the request's idempotency record to write, and the index moves to make after its commit
        self._idem: tuple[str, str, str] | None = None
        self._pending_moves: tuple[int, list[tuple[int, int | None]]] | None = None

    async def load(self) -> None:
        pool = (await self.db.fetch("SELECT id, name, config FROM pool"))[0]
        config = pool[2] if isinstance(pool[2], dict) else orjson.loads(pool[2])
        c = s.PoolConfig(**config)
        self.pool_id, self.pool_name, self.k = int(pool[0]), str(pool[1]), c.k
        self.rules = rules_of(c)
        self.runs = {int(r[0]): str(r[1]) for r in await self.db.fetch("SELECT id, name FROM run")}
        self.run_ids = {name: rid for rid, name in self.runs.items()}
        for rid in self.runs:
            rows = await self.db.fetch(
                "SELECT bucket, question_id FROM run_question WHERE scope = ? AND retired = ? "
                "AND bucket IS NOT NULL ORDER BY question_id",
                rid,
                False,
            )
            index: dict[int, list[int]] = {}
            for b, q in rows:
                index.setdefault(int(b), []).append(int(q))
            self.index[rid] = index

    # ---------------------------------------------------------------------------------- shared
    async def _idempotent(
        self, key: str | None, route: str, body: bytes, content: bytes | None = None
    ) -> None:
        """`content`: a digest of what the request asks for, hashed instead of its body (a commit's,
        made from its batch digest, as the service does: the payload hashed once)."""
        if key is None:
            return
        hashed = body if content is None else b"content:" + content
        digest = hashlib.sha256(route.encode() + b"\n" + hashed).hexdigest()
        hkey = hashlib.sha256(f"{route}\n{key}".encode()).hexdigest()
        if await self.db.fetch("SELECT 1 FROM idempotency_key WHERE key = ? AND principal = ?", hkey, "anon"):
            raise Refused(409, "key in use")
        self._idem = (hkey, route, digest)

    async def _record(self, response: str) -> None:
        if self._idem is None:
            return
        hkey, route, digest = self._idem
        self._idem = None
        await self.db.execute(
            "INSERT INTO idempotency_key (key, principal, route, request_hash, status_code, response, "
            "created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            hkey, "anon", route, digest, 200, self._json(response), _now(self.db),
        )  # fmt: skip

    @staticmethod
    def _json(value: Any) -> str:
        return value if isinstance(value, str) else orjson.dumps(value).decode()

    def _sizes(self, run_id: int) -> dict[int, int]:
        return {b: len(m) for b, m in self.index.get(run_id, {}).items() if m}

    async def _replay(
        self, run_id: int, seed: int, key: int | str, n: int, kind: str, payload: bool = True
    ) -> tuple[list[dict[str, Any]], list[tuple[bytes, bytes] | None], int]:
        """The replay items of a plan or a selection, their candidates' payloads, the eligible count."""
        sizes = self._sizes(run_id)
        draws = sample_replay(sizes, n, self.rules, make_rng(seed, key, kind))
        index = self.index.get(run_id, {})
        picks = [(index[d.bucket][d.index], d.bucket, d.probability / sizes[d.bucket]) for d in draws]
        qids = [p[0] for p in picks]
        if not qids:
            return [], [], sum(sizes.values())
        marks = _in(len(qids))
        states = await self._states(run_id, qids)
        picks = [p for p in picks if (st := states.get(p[0])) is not None and st[0] and not st[1]]
        trajs: dict[int, list[Any]] = {}
        where = f"FROM trajectory WHERE scope = ? AND question_id IN ({marks})"
        if payload:
            for t in await self.db.fetch(
                f"SELECT {_TRAJ_COLS}, token_ids, logprobs {where} ORDER BY id", run_id, *qids
            ):
                trajs.setdefault(int(t[1]), []).append(t)
        else:  # ids only: whether a question has a candidate at all, one row each (as the service)
            for t in await self.db.fetch(f"SELECT DISTINCT question_id {where}", run_id, *qids):
                trajs[int(t[0])] = [t]
        questions = await self._questions([p[0] for p in picks])
        items, payloads = [], []
        for qid, bucket, prob in picks:
            cands = trajs.get(qid, [])
            if not cands:
                continue
            q = questions[qid]
            out = []  # ids only: no candidate goes out
            for t in cands if payload else []:
                out.append(
                    {
                        "id": t[0],
                        "question_id": t[1],
                        "source_run": self.runs.get(t[2]) if t[2] is not None else None,
                        "policy_version": t[3],
                        "step": t[4],
                        "reward": t[5],
                        "entropy": t[6],
                        "num_tokens": t[7],
                        "created_at": _iso_z(t[8]),
                        "text": None,  # a response's text goes out with a question's detail only
                    }
                )
                payloads.append((bytes(t[9]), bytes(t[10])))
            items.append(
                {**q, "num_samples": self.k - 1, "bucket": bucket, "probability": prob, "candidates": out}
            )
        return items, payloads, sum(sizes.values())

    async def _states(self, run_id: int, qids: list[int]) -> dict[int, tuple[int | None, bool]]:
        """(bucket, retired) of the questions' state rows in the run's scope."""
        rows = await self.db.fetch(
            f"SELECT question_id, bucket, retired FROM run_question WHERE scope = ? "
            f"AND question_id IN ({_in(len(qids))})",
            run_id,
            *qids,
        )
        return {int(r[0]): (r[1], bool(r[2])) for r in rows}

    async def _questions(self, qids: list[int]) -> dict[int, dict[str, Any]]:
        if not qids:
            return {}
        rows = await self.db.fetch(
            f"SELECT id, prompt, ground_truth, data_source FROM question WHERE id IN ({_in(len(qids))})",
            *qids,
        )
        return {
            int(r[0]): {
                "question_id": int(r[0]),
                "prompt": orjson.loads(r[1]) if isinstance(r[1], str | bytes) else r[1],
                "ground_truth": r[2],
                "data_source": r[3],
            }
            for r in rows
        }

    # ------------------------------------------------------------------------------------ plan
    async def plan(self, run_name: str, req: dict[str, Any], key: str | None, route: str, raw: bytes) -> Any:
        run_id = self.run_ids.get(run_name)
        if run_id is None:
            raise Refused(404, "no such run")
        lock = " FOR UPDATE" if self.db.pg else ""
        await self._idempotent(key, route, raw)
        rseed, phase, rstep, version, epoch, cursor = (
            await self.db.fetch(
                f"SELECT seed, phase, step, policy_version, epoch, cursor FROM run WHERE id = ?{lock}", run_id
            )
        )[0]
        step = rstep + 1
        if await self.db.fetch(
            "SELECT id FROM batch WHERE run_id = ? AND step = ? AND status = ?", run_id, step, "planned"
        ):
            raise Refused(409, "open batch (the floor does not answer it again)")
        rules = self.rules
        sizes = self._sizes(run_id)
        comp = compose_batch(sum(sizes.values()), rules, phase=phase)
        order = self.epochs.get(run_id)
        if order is None:
            blob = await self.db.fetch(
                'SELECT "order" FROM run_epoch WHERE run_id = ? AND epoch = ?', run_id, epoch
            )
            # a new run has no epoch yet: an empty order, so that its first plan starts one
            order = np.frombuffer(bytes(blob[0][0]) if blob else b"", dtype="<i8").astype(np.int64)
        nxt = take_fresh(order, cursor, rules.batch_size)
        if nxt is None:
            ids = await self.db.fetch("SELECT id FROM question WHERE pool_id = ? ORDER BY id", self.pool_id)
            retired = await self.db.fetch(
                "SELECT question_id FROM run_question WHERE scope = ? AND retired = ?", run_id, True
            )
            active = np.setdiff1d(
                np.array([r[0] for r in ids], np.int64), np.array([r[0] for r in retired], np.int64)
            )
            epoch += 1
            order = epoch_order(active, seed=rseed, epoch=epoch)
            await self.db.execute("DELETE FROM run_epoch WHERE run_id = ?", run_id)
            await self.db.execute(
                'INSERT INTO run_epoch (run_id, epoch, "order", created_at) VALUES (?, ?, ?, ?)',
                run_id, epoch, order.astype("<i8").tobytes(), _now(self.db),
            )  # fmt: skip
            nxt = take_fresh(order, 0, rules.batch_size)
            assert nxt is not None
        self.epochs[run_id] = order
        drawn, cursor = nxt
        fresh = [int(q) for q in drawn[: rules.batch_size - comp.num_replay]]
        replay, payloads, eligible = await self._replay(run_id, rseed, step, comp.num_replay, "replay")
        fill = rules.batch_size - len(fresh) - len(replay)
        if fill > 0:
            fresh += [int(q) for q in drawn[len(fresh) : len(fresh) + fill]]
        fq = await self._questions(fresh)
        batch_id = str(uuid.uuid4())
        now = datetime.now(UTC)
        stored = {
            "k": rules.k,
            "fresh": fresh,
            "replay": [
                {
                    "question_id": r["question_id"],
                    "bucket": r["bucket"],
                    "probability": r["probability"],
                    "candidates": [c["id"] for c in r["candidates"]],
                }
                for r in replay
            ],
            "num_eligible": eligible,
            "skipped_fresh": rules.batch_size - len(fresh),
            "epoch": epoch,
            "batch_size": rules.batch_size,
        }
        await self.db.execute(
            "INSERT INTO batch (id, run_id, step, status, phase, policy_version, plan, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            batch_id, run_id, step, "planned", phase, version, self._json(stored), _now(self.db, now),
        )  # fmt: skip
        await self.db.execute(
            "UPDATE run SET cursor = ?, epoch = ?, updated_at = ? WHERE id = ?",
            cursor,
            epoch,
            _now(self.db),
            run_id,
        )
        await self._record(orjson.dumps({"ref": {"batch": batch_id}}).decode())
        body = {
            "id": batch_id,
            "run": run_name,
            "pool": self.pool_name,
            "step": step,
            "phase": phase,
            "status": "planned",
            "policy_version": version,
            "k": rules.k,
            "fresh": [{**fq[q], "num_samples": rules.k} for q in fresh],
            "replay": replay,
            "num_eligible": eligible,
            "skipped_fresh": rules.batch_size - len(fresh),
            "epoch": epoch,
            "created_at": now.isoformat(),
        }
        return body, payloads

    async def select(self, run_name: str, req: dict[str, Any]) -> Any:
        run_id = self.run_ids.get(run_name)
        if run_id is None:
            raise Refused(404, "no such run")
        rseed = (await self.db.fetch("SELECT seed FROM run WHERE id = ?", run_id))[0][0]
        ids_only = req.get("candidates") == "none"
        replay, payloads, eligible = await self._replay(
            run_id, rseed, int(req.get("seed") or 0), int(req["n"]), "select", payload=not ids_only
        )
        return {"run": run_name, "num_eligible": eligible, "replay": replay}, payloads

    # ------------------------------------------------------------------- the mix's other requests
    async def create_run(self, req: dict[str, Any]) -> dict[str, Any]:
        """A new run of the pool (the 50-client mix's trainers each make one): its row, and an
        empty index; its first plan starts its first epoch."""
        name, seed, phase = req.get("name"), req.get("seed", 0), req.get("phase", "on_policy")
        if not isinstance(name, str) or not name or not isinstance(seed, int) or phase not in _PHASES:
            raise Refused(422, "name, seed, phase")
        if await self.db.fetch("SELECT id FROM run WHERE pool_id = ? AND name = ?", self.pool_id, name):
            raise Refused(409, "run exists")
        now = _now(self.db)
        switched = 0 if phase == "mixed" else None
        rid = int(
            (
                await self.db.fetch(
                    "INSERT INTO run (pool_id, name, seed, phase, switched_at_step, step, policy_version, "
                    "epoch, cursor, overrides, created_at, updated_at) "
                    "VALUES (?, ?, ?, ?, ?, 0, 0, -1, 0, ?, ?, ?) RETURNING id",
                    self.pool_id,
                    name,
                    seed,
                    phase,
                    switched,
                    _OVERRIDES,
                    now,
                    now,
                )
            )[0][0]
        )
        self.runs[rid], self.run_ids[name] = name, rid
        self.index[rid] = {}
        at = _iso_z(now)
        return {
            "id": rid, "name": name, "pool": self.pool_name, "seed": seed, "phase": phase,
            "switched_at_step": switched, "step": 0, "policy_version": 0, "epoch": 0, "cursor": 0,
            "overrides": orjson.loads(_OVERRIDES), "created_at": at, "updated_at": at,
        }  # fmt: skip

    async def run_stats(self, name: str) -> dict[str, Any]:
        row = await self.db.fetch(
            "SELECT id, name, phase, step, policy_version FROM run WHERE pool_id = ? AND name = ?",
            self.pool_id,
            name,
        )
        if not row:
            raise Refused(404, "no such run")
        return (await self._stats(row))[0]

    async def pool_stats(self) -> dict[str, Any]:
        """The pool's totals from the tallies, and every run's stats."""
        pid = self.pool_id
        nq, nt, nr, tokens = (
            await self.db.fetch(
                "SELECT (SELECT coalesce(sum(n), 0) FROM question_tally WHERE pool_id = ?), "
                "(SELECT coalesce(sum(n), 0) FROM trajectory_tally WHERE pool_id = ?), "
                "(SELECT count(*) FROM run WHERE pool_id = ?), "
                "(SELECT coalesce(sum(tokens), 0) FROM trajectory_tally WHERE pool_id = ?)",
                pid,
                pid,
                pid,
                pid,
            )
        )[0]
        runs = await self.db.fetch(
            "SELECT id, name, phase, step, policy_version FROM run WHERE pool_id = ? ORDER BY id", pid
        )
        return {
            "pool": self.pool_name,
            "num_questions": int(nq),
            "num_trajectories": int(nt),
            "num_tokens": int(tokens),
            "num_runs": int(nr),
            "runs": await self._stats(runs),
        }

    async def _stats(self, runs: list[Any]) -> list[dict[str, Any]]:
        """Runs' stats as the service counts them: the state tally's cells, the trajectory
        tally's totals and the last five minutes' rows, the last committed batch's replays."""
        ids = [int(r[0]) for r in runs]
        marks = _in(len(ids))
        hist: dict[int, dict[int, int]] = {i: {} for i in ids}
        retired, seen = dict.fromkeys(ids, 0), dict.fromkeys(ids, 0)
        for scope, bucket, is_retired, n in await self.db.fetch(
            f"SELECT scope, bucket, retired, sum(n) FROM state_tally WHERE scope IN ({marks}) "
            "GROUP BY scope, bucket, retired",
            *ids,
        ):
            sc, n = int(scope), int(n)
            seen[sc] += n
            if is_retired:
                retired[sc] += n
            elif bucket >= 0 and n:
                hist[sc][int(bucket)] = hist[sc].get(int(bucket), 0) + n
        since = datetime.now(UTC) - timedelta(minutes=5)
        totals: dict[int, int] = {}
        recent: dict[int, int] = {}
        # the tally's whole periods of the five minutes (migrations 0014 and 0015), and the shorter
        # side of the period they begin in counted row by row (added after `since`, else subtracted)
        first = (since - _EPOCH) // _PERIOD
        start = _EPOCH + first * _PERIOD
        if since - start <= start + _PERIOD - since:
            lo, hi, sign = start, since, -1
        else:
            first, lo, hi, sign = first + 1, since, start + _PERIOD, 1
        if self.db.pg:
            part = (
                f"SELECT 2, source_run_id, count(*) FROM trajectory WHERE source_run_id IN ({marks}) "
                "AND created_at >= ? AND created_at < ? GROUP BY source_run_id"
            )
            part_args: list[Any] = [*ids, lo, hi]
        else:  # a count per run over its part of the index: 2.3x faster than IN (...) GROUP BY
            one = (
                "SELECT 2, ?, (SELECT count(*) FROM trajectory WHERE source_run_id = ? "
                "AND created_at >= ? AND created_at < ?)"
            )
            part = " UNION ALL ".join([one] * len(ids))
            part_args = [v for i in ids for v in (i, i, _now(self.db, lo), _now(self.db, hi))]
        for kind, run_id, n in await self.db.fetch(
            f"SELECT 0, run_id, sum(n) FROM trajectory_tally WHERE pool_id = ? AND run_id IN ({marks}) "
            "GROUP BY run_id UNION ALL "
            "SELECT 1, run_id, sum(n) FROM trajectory_tally WHERE pool_id = ? "
            f"AND run_id IN ({marks}) AND period >= ? GROUP BY run_id UNION ALL {part}",
            self.pool_id, *ids, self.pool_id, *ids, first, *part_args,
        ):  # fmt: skip
            if kind == 0:
                totals[int(run_id)] = int(n)
            else:
                recent[int(run_id)] = recent.get(int(run_id), 0) + (sign * int(n) if kind == 2 else int(n))
        pg = self.db.pg
        length = "jsonb_array_length(b.plan -> 'replay')" if pg else "json_array_length(b.plan, '$.replay')"
        replayed = {
            int(r[0]): int(r[1] or 0)
            for r in await self.db.fetch(
                f"SELECT r.id, (SELECT {length} FROM batch b WHERE b.run_id = r.id "
                "AND b.status = 'committed' ORDER BY b.step DESC LIMIT 1) "
                f"FROM run r WHERE r.id IN ({marks})",
                *ids,
            )
        }
        out = []
        for rid, name, phase, step, version in runs:
            h = hist[int(rid)]
            out.append(
                {
                    "run": name,
                    "pool": self.pool_name,
                    "phase": phase,
                    "step": step,
                    "policy_version": version,
                    "buckets": [{"bucket": b, "questions": n} for b, n in sorted(h.items())],
                    "eligible": sum(h.values()),
                    "retired": retired[int(rid)],
                    "seen": seen[int(rid)],
                    "trajectories": totals.get(int(rid), 0),
                    "replayed_last_step": replayed.get(int(rid), 0),
                    "ingest_per_minute": recent.get(int(rid), 0) / 5.0,
                }
            )
        return out

    async def questions(self, after: int, limit: int) -> dict[str, Any]:
        """A page of the pool's questions in id order."""
        rows = await self.db.fetch(
            "SELECT id, prompt, ground_truth, data_source, external_id, metadata, created_at FROM question "
            "WHERE pool_id = ? AND id > ? ORDER BY id LIMIT ?",
            self.pool_id,
            after,
            limit,
        )

        def parsed(v: Any) -> Any:
            return orjson.loads(v) if isinstance(v, str | bytes) else v

        data = [
            {
                "id": r[0],
                "pool": self.pool_name,
                "prompt": parsed(r[1]),
                "ground_truth": r[2],
                "data_source": r[3],
                "external_id": r[4],
                "metadata": parsed(r[5]),
                "created_at": _iso_z(r[6]),
            }
            for r in rows
        ]
        return {"data": data, "count": len(data), "next_after": rows[-1][0] if len(rows) == limit else None}

    # ---------------------------------------------------------------------------------- commit
    async def commit(
        self, batch_id: str, body: dict[str, Any], payloads: Any, key: str | None, route: str, raw: bytes
    ) -> dict[str, Any]:
        groups = body.get("groups")
        if not isinstance(groups, list):
            raise Refused(422, "groups")
        k = self.rules.k
        slots = [r for g in groups for r in g["rollouts"]]
        if any(len(g["rollouts"]) != k for g in groups):
            raise Refused(422, "K rollouts per group")
        pay = _payloads(slots, payloads)
        # what the commit applies, kept with the batch's result (a repeated commit is checked
        # against it): the groups and policy version, and a frame's payload buffers
        digest = hashlib.sha256(
            orjson.dumps({"groups": groups, "policy_version": body.get("policy_version")})
        )
        if payloads is not None:
            digest.update(payloads.token_ids)
            digest.update(payloads.logprobs)
        rest = orjson.dumps({"metrics": body.get("metrics"), "with_stats": body.get("with_stats")})
        await self._idempotent(key, route, raw, digest.hexdigest().encode() + b" " + rest)
        found = await self.db.fetch(
            "SELECT run_id, step, status, phase, policy_version, plan FROM batch WHERE id = ?", batch_id
        )
        if not found:
            raise Refused(404, "no such batch")
        run_id, step, status, phase, version, plan = found[0]
        lock = " FOR UPDATE" if self.db.pg else ""
        rstep, rversion, rphase = (
            await self.db.fetch(f"SELECT step, policy_version, phase FROM run WHERE id = ?{lock}", run_id)
        )[0]
        if status != "planned" or step != rstep + 1:
            raise Refused(409, "batch not open")
        plan = plan if isinstance(plan, dict) else orjson.loads(plan)
        want = Counter(
            [(q, False) for q in plan["fresh"]] + [(p["question_id"], True) for p in plan["replay"]]
        )
        got = Counter((g["question_id"], any(r.get("replayed") for r in g["rollouts"])) for g in groups)
        if want != got:
            raise Refused(422, "groups do not match the plan")
        a = await self._apply(run_id, groups, pay, collect=phase == "mixed", step=step, version=version)
        now = _now(self.db)
        solved, stored, retired, moves = a["solved"], a["stored"], a["retired"], a["moves"]
        await self.db.execute(
            "UPDATE run SET step = ?, policy_version = ?, updated_at = ? WHERE id = ?",
            step, max(rversion, version), now, run_id,
        )  # fmt: skip
        metrics = {**body.get("metrics", {}), "batch/solved": solved}
        result = _result(batch_id, self.runs[run_id], step, rphase, a)
        await self.db.execute(
            "UPDATE batch SET status = ?, metrics = ?, result = ?, committed_at = ? WHERE id = ?",
            "committed", self._json(metrics), self._json({**result, "digest": digest.hexdigest()}), now,
            batch_id,
        )  # fmt: skip
        all_metrics = {
            **metrics,
            "batch/replayed_questions": float(len(plan["replay"])),
            "pool/stored_trajectories": float(stored),
            "pool/retired": float(retired),
        }
        await self.db.execute(
            "INSERT INTO run_metric (run_id, step, metrics, updated_at) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (run_id, step) DO UPDATE SET metrics = excluded.metrics, "
            "updated_at = excluded.updated_at",
            run_id, step, self._json(all_metrics), now,
        )  # fmt: skip
        await self._record(orjson.dumps(result).decode())
        self._pending_moves = (run_id, moves)
        return result

    async def _apply(
        self,
        run_id: int,
        groups: list[dict[str, Any]],
        pay: list[tuple[bytes, bytes] | None],
        *,
        collect: bool,
        step: int,
        version: int,
    ) -> dict[str, Any]:
        """Retire, bucket and store graded groups in the open transaction (commit and ingest)."""
        at = datetime.now(UTC)
        now, period = _now(self.db, at), (at - _EPOCH) // _PERIOD
        finals: dict[int, tuple[int, str, int | None]] = {}
        traj_rows: list[tuple[Any, ...]] = []
        retired = collected = ignored = 0
        i = 0
        rewards_all: list[float] = []
        for g in groups:
            rewards = [float(r["reward"]) for r in g["rollouts"]]
            rewards_all += rewards
            d = decide_group(rewards, self.rules, collect=collect)
            qid = int(g["question_id"])
            prev = finals.get(qid)
            if d.action == GroupAction.RETIRE:
                retired += 1
                finals[qid] = (d.num_correct, "retire", None)
            elif d.action == GroupAction.COLLECT:
                collected += 1
                finals[qid] = (
                    d.num_correct,
                    "retire" if prev and prev[1] == "retire" else "collect",
                    d.bucket,
                )
                for ri in d.store:
                    r = g["rollouts"][ri]
                    if r.get("replayed"):
                        continue
                    p = pay[i + ri]
                    if p is None:
                        raise Refused(422, "a stored rollout needs its payload")
                    ids, lps = p
                    traj_rows.append(
                        (qid, self.pool_id, run_id, run_id, version, step, ids, lps, len(ids) // 4,
                         float(r["reward"]), r.get("entropy"), trajectory_key(ids), now, period)
                    )  # fmt: skip
            else:
                ignored += 1
                finals.setdefault(qid, (d.num_correct, "ignore", None))
            i += len(g["rollouts"])
        qids = sorted(finals)
        old = await self._states(run_id, qids)
        rows, moves = [], []
        for qid in qids:
            last_k, kind, bucket = finals[qid]
            was_retired = old.get(qid, (None, False))[1]
            prev_bucket = None if qid not in old or was_retired else old[qid][0]
            new_retired = was_retired or kind == "retire"
            new_bucket = None if new_retired else (bucket if kind == "collect" else prev_bucket)
            rows.append((run_id, qid, self.pool_id, last_k, new_bucket, new_retired, step, run_id, now))
            if new_bucket != prev_bucket or (kind == "retire" and not was_retired):
                moves.append((qid, new_bucket))
        await self.db.executemany(
            "INSERT INTO run_question (scope, question_id, pool_id, last_k, bucket, retired, last_step, "
            "last_run_id, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (scope, question_id) "
            "DO UPDATE SET last_k = excluded.last_k, bucket = excluded.bucket, retired = excluded.retired, "
            "last_step = excluded.last_step, last_run_id = excluded.last_run_id, "
            "updated_at = excluded.updated_at",
            rows,
        )
        traj_rows.sort(key=lambda r: r[0])
        stored = await self._insert_trajectories(traj_rows)
        gone = [q for q in qids if finals[q][1] == "retire"]
        removed = 0
        if gone:
            removed = len(
                await self.db.fetch(
                    f"DELETE FROM trajectory WHERE scope = ? AND question_id IN ({_in(len(gone))}) "
                    "RETURNING id",
                    run_id,
                    *gone,
                )
            )
        correct = sum(1 for r in rewards_all if r > 0.5)
        return {
            "retired": retired,
            "collected": collected,
            "ignored": ignored,
            "stored": stored,
            "duplicates": len(traj_rows) - stored,
            "moves": moves,
            "removed": removed,
            "solved": correct / len(rewards_all) if rewards_all else 0.0,
        }

    async def ingest(self, run_name: str, body: dict[str, Any], payloads: Any) -> dict[str, Any]:
        """Graded groups from a producer: the run's lock, the questions checked, then the commit's
        rules (collection in the mixed phase)."""
        run_id = self.run_ids.get(run_name)
        groups = body.get("groups")
        if run_id is None or not isinstance(groups, list):
            raise Refused(404 if run_id is None else 422, "no such run, or no groups")
        if any(len(g["rollouts"]) != self.rules.k for g in groups):
            raise Refused(422, "K rollouts per group")
        pay = _payloads([r for g in groups for r in g["rollouts"]], payloads)
        lock = " FOR UPDATE" if self.db.pg else ""
        rstep, phase = (await self.db.fetch(f"SELECT step, phase FROM run WHERE id = ?{lock}", run_id))[0]
        qids = sorted({int(g["question_id"]) for g in groups})
        found = await self.db.fetch(
            f"SELECT id FROM question WHERE pool_id = ? AND id IN ({_in(len(qids))})", self.pool_id, *qids
        )
        if len(found) != len(qids):
            raise Refused(422, "questions not in the pool")
        step = rstep if body.get("step") is None else int(body["step"])
        version = int(body.get("policy_version") or 0)
        a = await self._apply(
            run_id,
            groups,
            pay,
            collect=phase == "mixed" or bool(body.get("prefill")),
            step=step,
            version=version,
        )
        self._pending_moves = (run_id, a["moves"])
        return _result(None, run_name, rstep, phase, a)

    def apply_moves(self) -> None:
        """After the commit: the in-process index follows the state rows."""
        pending, self._pending_moves = self._pending_moves, None
        if pending is None:
            return
        run_id, moves = pending
        index = self.index.setdefault(run_id, {})
        for qid, bucket in moves:
            for members in index.values():
                j = bisect.bisect_left(members, qid)
                if j < len(members) and members[j] == qid:
                    members.pop(j)
                    break
            if bucket is not None:
                bisect.insort(index.setdefault(bucket, []), qid)

    async def _insert_trajectories(self, rows: list[tuple[Any, ...]]) -> int:
        if not rows:
            return 0
        cols = (
            "question_id, pool_id, scope, source_run_id, policy_version, step, token_ids, logprobs, "
            "num_tokens, reward, entropy, dedup_key, created_at, period"
        )
        if self.db.pg:
            # one statement over arrays: one round trip, the ids of the rows actually inserted
            types = ["bigint", "bigint", "bigint", "bigint", "int", "int", "bytea", "bytea", "int",
                     "float8", "float8", "bytea", "timestamptz", "bigint"]  # fmt: skip
            unnest = ", ".join(f"${i + 1}::{t}[]" for i, t in enumerate(types))
            # and the trajectory tally's rows of what was stored, as the service adds them there
            # (Postgres has no INSERT trigger on trajectory; its DELETE trigger counts removals)
            got = await self.db.conn.fetchval(  # type: ignore[attr-defined]
                f"WITH stored AS (INSERT INTO trajectory ({cols}) SELECT * FROM unnest({unnest}) "
                "ON CONFLICT (question_id, scope, dedup_key) DO NOTHING "
                "RETURNING pool_id, source_run_id, num_tokens, period), "
                "tallied AS (INSERT INTO trajectory_tally (pool_id, run_id, period, n, tokens) "
                "SELECT pool_id, coalesce(source_run_id, 0), period, count(*), sum(num_tokens) "
                "FROM stored GROUP BY 1, 2, 3) SELECT count(*) FROM stored",
                *[list(c) for c in zip(*rows, strict=True)],
            )
            return int(got)
        conn = self.db.conn  # type: ignore[attr-defined]
        last = conn.execute("SELECT max(id) FROM trajectory").fetchone()[0] or 0
        # the rows the statement inserted (a conflict inserts none)
        cur = conn.executemany(
            f"INSERT INTO trajectory ({cols}) VALUES ({_in(14)}) "
            "ON CONFLICT (question_id, scope, dedup_key) DO NOTHING",
            rows,
        )
        stored = int(cur.rowcount)
        # the trajectory tally, as the service keeps it on SQLite (no row trigger since migration
        # 0013): one update per cell, counted from the rows sent when all were new (one time)
        if stored == len(rows):
            cells = [(rows[0][1], rows[0][3] or 0, rows[0][13], stored, sum(r[8] for r in rows))]
        else:
            cells = conn.execute(
                "SELECT pool_id, coalesce(source_run_id, 0), period, count(*), sum(num_tokens) "
                "FROM trajectory WHERE id > ? GROUP BY 1, 2, 3",
                (last,),
            ).fetchall()
        cut = (datetime.now(UTC) - timedelta(seconds=_FOLD_AFTER_S) - _EPOCH) // _PERIOD
        for pool, run, period, n, tokens in cells:
            if _bump_sqlite(conn, (pool, run, period), n, tokens):
                # a run's new period: its periods long past folded into period 0, and its cells
                # that sum to nothing removed
                for n0, tokens0 in conn.execute(
                    "SELECT sum(n), sum(tokens) FROM trajectory_tally WHERE pool_id = ? AND run_id = ? "
                    "AND period > 0 AND period < ? HAVING count(*) > 0",
                    (pool, run, cut),
                ).fetchall():
                    _bump_sqlite(conn, (pool, run, 0), n0, tokens0)
                conn.execute(
                    "DELETE FROM trajectory_tally WHERE (period > 0 AND period < ? AND pool_id = ? "
                    "AND run_id = ?) OR (n = 0 AND tokens = 0 AND pool_id = ? AND run_id = ?)",
                    (cut, pool, run, pool, run),
                )
        return stored


def _bump_sqlite(conn: Any, cell: tuple[Any, ...], n: int, tokens: int) -> bool:
    """SQLite: add to a trajectory tally cell (pool, run, period); whether it was a new one."""
    if conn.execute(
        "UPDATE OR IGNORE trajectory_tally SET n = n + ?, tokens = tokens + ? "
        "WHERE pool_id = ? AND run_id = ? AND period = ?",
        (n, tokens, *cell),
    ).rowcount:
        return False
    conn.execute(
        "INSERT INTO trajectory_tally (pool_id, run_id, period, n, tokens) VALUES (?, ?, ?, ?, ?)",
        (*cell, n, tokens),
    )
    return True


def _result(batch_id: str | None, run: str, step: int, phase: str, a: dict[str, Any]) -> dict[str, Any]:
    return {
        "batch_id": batch_id,
        "run": run,
        "step": step,
        "phase": phase,
        "switched": False,
        "solved_fraction": a["solved"],
        "retired": a["retired"],
        "collected_groups": a["collected"],
        "ignored_groups": a["ignored"],
        "stored_trajectories": a["stored"],
        "duplicate_trajectories": a["duplicates"],
        "bucket_moves": len(a["moves"]),
        "removed_trajectories": a["removed"],
    }


def _payloads(slots: list[dict[str, Any]], payloads: Any) -> list[tuple[bytes, bytes] | None]:
    """Every rollout's (ids, log-probs) bytes, checked once: whole int32 / float32 arrays of the same
    length. A frame's come from its buffers (checked as arrays), JSON's from base64."""
    out: list[tuple[bytes, bytes] | None] = []
    if payloads is not None:
        lengths = payloads.lengths
        if (lengths[lengths >= 0] == 0).any() or int(lengths[lengths > 0].sum()) != payloads.token_ids.size:
            raise Refused(422, "frame lengths")
        if payloads.logprobs.size != payloads.token_ids.size or not np.isfinite(payloads.logprobs).all():
            raise Refused(422, "frame log-probs")
        ids, lps = payloads.token_ids.tobytes(), payloads.logprobs.tobytes()
        at = 0
        for n in lengths.tolist():
            if n < 0:
                out.append(None)
                continue
            out.append((ids[4 * at : 4 * (at + n)], lps[4 * at : 4 * (at + n)]))
            at += n
        return out
    for r in slots:
        a, b = r.get("token_ids_b64"), r.get("logprobs_b64")
        if a is None or b is None:
            out.append(None)
            continue
        try:
            ids, lps = s.decode_b64(a), s.decode_b64(b)
        except (ValueError, TypeError) as e:
            raise Refused(422, "base64") from e
        if not ids or len(ids) % 4 or len(ids) != len(lps):
            raise Refused(422, "payload lengths")
        out.append((ids, lps))
    if any(p is not None for p in out):
        lp = np.frombuffer(b"".join(p[1] for p in out if p is not None), dtype="<f4")
        if not np.isfinite(lp).all():
            raise Refused(422, "log-probs")
    return out


def _now(db: Db, at: datetime | None = None) -> Any:
    at = at or datetime.now(UTC)
    return at if db.pg else at.strftime("%Y-%m-%d %H:%M:%S.%f")


def _iso_z(v: Any) -> str:
    """A stored timestamp as the service writes it in an answer (UTC, `Z`): the floor's answers
    are then the service's byte for byte."""
    at = v if isinstance(v, datetime) else datetime.fromisoformat(v)
    return at.replace(tzinfo=None).isoformat() + "Z"


def _answer(
    body: dict[str, Any], payloads: list[tuple[bytes, bytes] | None], frame: bool
) -> tuple[bytes, bytes]:
    """A body with payloads as the client asked: a frame, or JSON with base64 fields."""
    if frame:
        return frames.encode(body, payloads), frames.MEDIA_TYPE.encode()
    it = iter(payloads)
    for slot in frames.slots(body):
        p = next(it)
        if p is not None:
            slot["token_ids_b64"] = s.encode_b64(p[0])
            slot["logprobs_b64"] = s.encode_b64(p[1])
    return orjson.dumps(body), b"application/json"


def app_for(floor: Floor) -> Callable[..., Awaitable[None]]:
    lock = asyncio.Lock()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await floor.load()
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        chunks = []
        while True:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        raw = b"".join(chunks)
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        path: str = scope["path"]
        status, out, media = 200, b"ok", b"text/plain"
        try:
            async with lock:
                if scope["method"] == "GET":
                    status, out, media = await _read(floor, path, scope.get("query_string", b""))
                else:
                    status, out, media = await _route(floor, path, raw, headers)
        except Refused as e:
            status, out, media = e.status, orjson.dumps({"detail": str(e)}), b"application/json"
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", media)]})
        await send({"type": "http.response.body", "body": out})

    return app


async def _read(floor: Floor, path: str, query: bytes) -> tuple[int, bytes, bytes]:
    """The 50-client mix's reads: /v1/pools/<pool>/stats, .../questions, .../runs/<run>/stats."""
    if path == "/readyz":
        return 200, b"ok", b"text/plain"
    parts = path.strip("/").split("/")
    if len(parts) == 4 and parts[3] == "stats":
        body = await floor.pool_stats()
    elif len(parts) == 6 and parts[3] == "runs" and parts[5] == "stats":
        body = await floor.run_stats(parts[4])
    elif len(parts) == 4 and parts[3] == "questions":
        args = dict(urllib.parse.parse_qsl(query.decode()))
        try:
            after, limit = int(args.get("after", 0)), int(args.get("limit", 100))
        except ValueError as e:
            raise Refused(422, "after, limit") from e
        if not 1 <= limit <= 1000:
            raise Refused(422, "limit")
        body = await floor.questions(after, limit)
    else:
        raise Refused(404, f"no route GET {path}")
    return 200, orjson.dumps(body), b"application/json"


async def _route(floor: Floor, path: str, raw: bytes, headers: dict[str, str]) -> tuple[int, bytes, bytes]:
    parts = path.strip("/").split("/")
    if len(parts) == 4 and parts[3] == "runs":
        req = orjson.loads(raw) if raw else {}
        ok = False
        await floor.db.begin()
        try:
            run = await floor.create_run(req)
            ok = True
        finally:
            await floor.db.end(ok)
        return 201, orjson.dumps(run), b"application/json"
    # /v1/pools/<pool>/runs/<run>/batches | /select ; /v1/pools/<pool>/batches/<id>/commit
    frame_out = frames.wants_frame(headers.get("accept"))
    key = headers.get("idempotency-key")
    route = f"POST {path}"
    if len(parts) == 6 and parts[3] == "runs" and parts[5] in ("batches", "select"):
        req = orjson.loads(raw) if raw else {}
        ok = False
        await floor.db.begin()
        try:
            if parts[5] == "batches":
                body, payloads = await floor.plan(parts[4], req, key, route, raw)
            else:
                body, payloads = await floor.select(parts[4], req)
            ok = True
        finally:
            await floor.db.end(ok)
        out, media = _answer(body, payloads, frame_out)
        return 200, out, media
    ingest = len(parts) == 6 and parts[3] == "runs" and parts[5] == "ingest"
    if ingest or (len(parts) == 6 and parts[3] == "batches" and parts[5] == "commit"):
        if frames.wants_frame(headers.get("content-type")):
            body, payloads = frames.decode(raw)
        else:
            body, payloads = orjson.loads(raw), None
        ok = False
        await floor.db.begin()
        try:
            if ingest:
                result = await floor.ingest(parts[4], body, payloads)
            else:
                result = await floor.commit(parts[4], body, payloads, key, route, raw)
            ok = True
        finally:
            await floor.db.end(ok)
        floor.apply_moves()
        return 200, orjson.dumps(result), b"application/json"
    raise Refused(404, f"no route {path}")


async def _connect(url: str) -> Db:
    if url.startswith("postgresql://"):
        import asyncpg

        conn = await asyncpg.connect(url)
        return PgDb(conn, url)
    return SqliteDb(url)


def main() -> None:
    url = os.environ["FLOOR_DATABASE"]
    port = int(os.environ["FLOOR_PORT"])
    # the allocator and collector settings of a serving process (`exgrpo serve`): process-wide
    # settings, not part of the work compared
    keep_freed_memory()
    # (an older service tree first on the path, `--service-src`, may not have it)
    getattr(service_app, "collect_young_less_often", lambda: None)()

    class Lazy:
        """Connects in uvicorn's event loop (asyncpg binds a connection to its loop)."""

        def __init__(self) -> None:
            self.inner: Callable[..., Awaitable[None]] | None = None

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if self.inner is None:
                self.inner = app_for(Floor(await _connect(url)))
            await self.inner(scope, receive, send)

    app: Any = Lazy()
    if os.environ.get("EXGRPO_BENCH_TIMING") == "1":
        # the service's probe, on this side too (`_serve.probe_floor`)
        import _serve

        # its statements: the database layer's calls, SQLite's BEGIN, and the trajectory insert
        # (`sqlite3` and asyncpg called directly, for the row count and the tally's cells)
        calls = [(c, m) for c in (SqliteDb, PgDb) for m in ("fetch", "execute", "executemany")]
        app = _serve.probe_floor(app, [*calls, (SqliteDb, "begin"), (Floor, "_insert_trajectories")])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
