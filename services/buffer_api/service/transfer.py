"""Export and import of a whole pool: one header record, then runs, policy versions, questions,
per-run states and trajectories. As NDJSON (the default) a record is a line and a payload base64
packed arrays; in the binary form (`exgrpo_client.exports`, asked for with `Accept:
application/x-msgpack`) a record is a length-prefixed msgpack map and trajectories come in frames
whose payloads are the stored bytes.

Import reads either form (told apart by the first byte) in one transaction: a broken record
anywhere leaves the database unchanged. Epoch orders are not exported: an imported run starts a
new epoch on its next batch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from exgrpo_client import exports, frames
from exgrpo_client import schemas as s
from exgrpo_pool.domain import trajectory_key
from exgrpo_pool.errors import BadRequest, Conflict
from exgrpo_pool.service.context import Context
from exgrpo_pool.service.convert import (
    checked_config,
    decode_payload,
    messages,
    pool_config,
    question_row,
    run_overrides,
)
from exgrpo_pool.store import repo
from exgrpo_pool.store.models import (
    PolicyVersion,
    Pool,
    Run,
    Trajectory,
    is_pool_scope,
    pool_scope,
    utcnow,
)

_PAGE = 2000
#: The pool's shared scope in an export (in the database it is `pool_scope(pool id)`).
SHARED_SCOPE = 0


def _exported_scope(scope: int) -> int:
    return SHARED_SCOPE if is_pool_scope(scope) else scope


async def export_pool(ctx: Context, pool: Pool, binary: bool = False) -> AsyncIterator[bytes]:
    """The export as NDJSON, or in its binary form (`exgrpo_client.exports`): the same records,
    trajectories in frames with their stored payload bytes as they are."""
    records = 0  # of the binary form, counted by its end record
    if binary:
        yield exports.MAGIC
    async for item in _export_items(ctx, pool):
        if isinstance(item, _Stored):
            if binary:
                for frame in _binary_trajectories(item.rows):
                    records += 1
                    yield frame
            else:
                yield _ndjson_trajectories(item.rows)
            continue
        models = item if isinstance(item, list) else [item]
        if models:
            records += len(models)
            yield b"".join(map(exports.model_record if binary else s.export_line, models))
    if binary:
        yield exports.end_record(records)


@dataclass(frozen=True, slots=True)
class _Stored:
    """A page of stored trajectories to export."""

    rows: list[Trajectory]


def _trajectory_fields(t: Trajectory) -> dict[str, Any]:
    """A stored trajectory's export record, less its type and payload."""
    return {
        "question": t.question_id,
        "scope": _exported_scope(t.scope),
        "source_run": t.source_run_id,
        "policy_version": t.policy_version,
        "step": t.step,
        "reward": t.reward,
        "entropy": t.entropy,
        "text": t.text,
    }


def _ndjson_trajectories(rows: list[Trajectory]) -> bytes:
    return b"".join(
        s.export_line(
            s.ExportTrajectory(
                **_trajectory_fields(t),
                token_ids_b64=s.encode_b64(t.token_ids),
                logprobs_b64=s.encode_b64(t.logprobs),
            )
        )
        for t in rows
    )


def _binary_trajectories(rows: list[Trajectory]) -> list[bytes]:
    """Frames of trajectories, each closed at about `exports.FRAME_BYTES` of payload and text."""
    out = []
    entries: list[dict[str, Any]] = []
    payloads: list[tuple[bytes, bytes]] = []
    size = 0
    for t in rows:
        entries.append(_trajectory_fields(t))
        payloads.append((t.token_ids, t.logprobs))
        size += len(t.token_ids) + len(t.logprobs) + len(t.text or "")
        if size >= exports.FRAME_BYTES:
            out.append(exports.trajectory_frame(entries, payloads))
            entries, payloads, size = [], [], 0
    if entries:
        out.append(exports.trajectory_frame(entries, payloads))
    return out


async def _export_items(ctx: Context, pool: Pool) -> AsyncIterator[s.ExportRecord | list[Any] | _Stored]:
    """What an export holds, in its order: records one by one or by the page, and pages of
    stored trajectories."""
    async with ctx.db.read() as session:
        nq, nt, nr = await repo.pool_counts(session, pool.id)
        yield s.ExportHeader(
            pool=s.PoolCreate(name=pool.name, config=pool_config(pool), description=pool.description),
            num_questions=nq,
            num_trajectories=nt,
            num_runs=nr,
        )
        for r in await repo.list_runs(session, pool.id):
            yield s.ExportRun(
                id=r.id,
                name=r.name,
                seed=r.seed,
                phase=r.phase,
                switched_at_step=r.switched_at_step,
                step=r.step,
                policy_version=r.policy_version,
                overrides=run_overrides(r),
            )
            yield [
                s.ExportPolicyVersion(run=r.id, version=pv.version, uri=pv.uri, step=pv.step)
                for pv in await repo.policy_versions(session, r.id)
            ]
        after = 0
        while qs := await repo.list_questions(session, pool.id, after, _PAGE):
            yield [
                s.ExportQuestion(
                    id=q.id,
                    prompt=messages(q.prompt),
                    ground_truth=q.ground_truth,
                    data_source=q.data_source,
                    external_id=q.external_id,
                    metadata=q.meta,
                )
                for q in qs
            ]
            after = qs[-1].id
        key = (pool_scope(pool.id) - 1, 0)
        while states := await repo.pool_states(session, pool.id, key, _PAGE):
            yield [
                s.ExportState(
                    scope=_exported_scope(st.scope),
                    question=st.question_id,
                    last_k=st.last_k,
                    bucket=st.bucket,
                    retired=st.retired,
                    last_step=st.last_step,
                )
                for st in states
            ]
            key = (states[-1].scope, states[-1].question_id)
        after = 0
        while ts := await repo.pool_trajectories(session, pool.id, after, _PAGE // 4):
            yield _Stored(ts)
            after = ts[-1].id


class _Importer:
    def __init__(self, session: repo.AsyncSession, name: str | None) -> None:
        self.session = session
        self.name_override = name
        self.created: Pool | None = None
        self.runs: dict[int, int] = {}
        self.questions: dict[int, int] = {}
        self.pending_q: list[tuple[int, dict[str, Any]]] = []
        self.pending_t: list[dict[str, Any]] = []
        # states by (scope, question): two exported questions of one content are one question here
        self.pending_s: dict[tuple[int, int], dict[str, Any]] = {}
        self._config: s.PoolConfig | None = None
        # what must be unique in an export (the database's own constraints would answer a 500)
        self.run_names: set[str] = set()
        self.versions: set[tuple[int, int]] = set()
        self.question_ids: set[int] = set()
        self.counts = {"questions": 0, "runs": 0, "states": 0, "trajectories": 0, "duplicates": 0}

    @property
    def pool(self) -> Pool:
        if self.created is None:
            raise BadRequest("the first line or record of an import must be the export header")
        return self.created

    @property
    def config(self) -> s.PoolConfig:
        if self._config is None:
            self._config = pool_config(self.pool)
        return self._config

    async def record(self, rec: s.ExportRecord) -> None:
        if isinstance(rec, s.ExportHeader):
            await self.header(rec)
        elif isinstance(rec, s.ExportRun):
            await self.run(rec)
        elif isinstance(rec, s.ExportPolicyVersion):
            self.policy_version(rec)
        elif isinstance(rec, s.ExportQuestion):
            await self.question(rec)
        elif isinstance(rec, s.ExportState):
            await self.state(rec)
        else:
            await self.trajectory(rec)

    async def header(self, h: s.ExportHeader) -> None:
        if self.created is not None:
            raise BadRequest("an import has one export header, on its first line")
        name = self.name_override or h.pool.name
        if await repo.get_pool(self.session, name) is not None:
            raise Conflict(f"pool {name!r} already exists; import under another name (?name=...)")
        now = utcnow()
        self.created = Pool(
            name=name,
            description=h.pool.description,
            config=checked_config(h.pool.config).model_dump(),
            created_at=now,
            updated_at=now,
        )
        self.session.add(self.created)
        await self.session.flush()

    async def run(self, r: s.ExportRun) -> None:
        if r.id in self.runs:
            raise BadRequest(f"run id {r.id} comes twice")
        if r.name in self.run_names:
            raise BadRequest(f"run {r.name!r} comes twice: run names are unique in a pool")
        self.run_names.add(r.name)
        now = utcnow()
        run = Run(
            pool_id=self.pool.id,
            name=r.name,
            seed=r.seed,
            phase=r.phase,
            switched_at_step=r.switched_at_step,
            step=r.step,
            policy_version=r.policy_version,
            epoch=-1,
            cursor=0,
            overrides=r.overrides.model_dump(),
            created_at=now,
            updated_at=now,
        )
        self.session.add(run)
        await self.session.flush()
        self.runs[r.id] = run.id
        self.counts["runs"] += 1

    def _run_id(self, exported: int) -> int:
        if exported not in self.runs:
            raise BadRequest(f"run id {exported} has no earlier run record")
        return self.runs[exported]

    def _scope(self, exported: int) -> int:
        return pool_scope(self.pool.id) if exported == SHARED_SCOPE else self._run_id(exported)

    def _trajectory_scope(self, t: s.ExportTrajectory, source_run: int | None) -> int:
        sharing = self.config.sharing
        if t.scope is not None:
            if t.scope != SHARED_SCOPE and sharing != "per_run":
                raise BadRequest(
                    f"trajectory: scope {t.scope} in a {sharing} pool; its trajectories are the "
                    "pool's (scope 0)"
                )
            return self._scope(t.scope)
        # an export of before trajectory scopes: a per_run pool's trajectories go to their run
        if sharing == "per_run" and source_run is not None:
            return source_run
        return pool_scope(self.pool.id)

    def _question_id(self, exported: int) -> int:
        if exported not in self.questions:
            raise BadRequest(f"question id {exported} has no earlier question record")
        return self.questions[exported]

    def policy_version(self, pv: s.ExportPolicyVersion) -> None:
        key = (self._run_id(pv.run), pv.version)
        if key in self.versions:
            raise BadRequest(f"policy version {pv.version} of run id {pv.run} comes twice")
        self.versions.add(key)
        self.session.add(
            PolicyVersion(
                run_id=self._run_id(pv.run), version=pv.version, uri=pv.uri, step=pv.step, created_at=utcnow()
            )
        )

    async def question(self, q: s.ExportQuestion) -> None:
        if q.id in self.question_ids:
            raise BadRequest(f"question id {q.id} comes twice")
        self.question_ids.add(q.id)
        self.pending_q.append((q.id, question_row(self.pool.id, q, utcnow())))
        if len(self.pending_q) >= 1000:
            await self.flush_questions()

    async def flush_questions(self) -> None:
        if not self.pending_q:
            return
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

    def _check_state(self, st: s.ExportState) -> None:
        """What the service itself keeps true of a question's state (plans rely on it)."""
        config = self.config
        k = config.k
        if st.last_k > k:
            raise BadRequest(f"state: last_k {st.last_k} is more than the pool's K = {k}")
        if st.bucket is not None and not 1 <= st.bucket <= k - 1:
            raise BadRequest(f"state: bucket {st.bucket} is not a bucket of this pool (1 to {k - 1})")
        if st.retired and st.bucket is not None:
            raise BadRequest("state: a retired question is in no bucket (bucket must be null)")
        pooled = config.sharing == "pooled"
        if pooled != (st.scope == 0):  # 0: the pool's shared scope in an export
            need = "0 (the shared scope)" if pooled else "an exported run's id"
            raise BadRequest(f"state: scope {st.scope} in a {config.sharing} pool; it must be {need}")

    async def state(self, st: s.ExportState) -> None:
        self._check_state(st)
        await self.flush_questions()
        key = (self._scope(st.scope), self._question_id(st.question))
        row = {
            "scope": key[0],
            "question_id": key[1],
            "pool_id": self.pool.id,
            "last_k": st.last_k,
            "bucket": st.bucket,
            "retired": st.retired,
            "last_step": st.last_step,
            "last_run_id": None,
            "updated_at": utcnow(),
        }
        if key in self.pending_s:  # one statement upserts a row once: the earlier one goes first
            await self.flush_states()
        self.pending_s[key] = row
        self.counts["states"] += 1
        if len(self.pending_s) >= 1000:
            await self.flush_states()

    async def flush_states(self) -> None:
        """The pending states in one statement (a retired question stays retired, as in a commit)."""
        if self.pending_s:
            await repo.upsert_decided_states(self.session, list(self.pending_s.values()))
            self.pending_s = {}

    async def trajectory(self, t: s.ExportTrajectory) -> None:
        """A trajectory of an NDJSON import (payloads as base64), inserted with the next ones."""
        await self.flush_questions()
        payload = s.Payload(token_ids_b64=t.token_ids_b64, logprobs_b64=t.logprobs_b64)
        decoded = decode_payload(payload, "trajectory")  # the rules of a trajectory sent to the API
        if decoded is None:  # pragma: no cover - both arrays are given
            raise BadRequest("trajectory: no payload")
        ids, lps = decoded
        self.pending_t.append(self._trajectory_row(t, ids.tobytes(), lps.tobytes()))
        if len(self.pending_t) >= _PAGE // 4:
            await self.flush_trajectories()

    async def trajectory_frame(self, frame: exports.TrajectoryFrame) -> None:
        """A frame of trajectories of a binary import: its payloads, checked with the frame, are
        stored as they came."""
        await self.flush_questions()
        chunks = frame.payloads.chunks()
        for i, (t, packed) in enumerate(zip(frame.trajectories, chunks, strict=True)):
            assert packed is not None  # a frame of an export has a payload in every slot
            try:
                self.pending_t.append(self._trajectory_row(t, *packed))
            except BadRequest as e:
                raise BadRequest(f"trajectories[{i}]: {e.detail}") from e
        await self.flush_trajectories()

    def _trajectory_row(self, t: s.ExportTrajectory, ids: bytes, lps: bytes) -> dict[str, Any]:
        source_run = None if t.source_run is None else self.runs.get(t.source_run)
        return {
            "question_id": self._question_id(t.question),
            "pool_id": self.pool.id,
            "scope": self._trajectory_scope(t, source_run),
            "source_run_id": source_run,
            "policy_version": t.policy_version,
            "step": t.step,
            "token_ids": ids,
            "logprobs": lps,
            "num_tokens": len(ids) // s.ID_DTYPE.itemsize,
            "reward": t.reward,
            "entropy": t.entropy,
            "dedup_key": trajectory_key(ids),
            "text": t.text,
            "created_at": utcnow(),
        }

    async def flush_trajectories(self) -> None:
        if not self.pending_t:
            return
        n = await repo.insert_trajectories(self.session, self.pending_t)
        self.counts["trajectories"] += n
        self.counts["duplicates"] += len(self.pending_t) - n
        self.pending_t = []

    async def finish(self) -> s.PoolImported:
        if self.created is None:
            raise BadRequest("empty import: expected an export header record")
        await self.flush_questions()
        await self.flush_states()
        await self.flush_trajectories()
        return s.PoolImported(pool=self.pool.name, **self.counts)


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


async def import_pool(
    ctx: Context, chunks: AsyncIterator[bytes], name: str | None, content_type: str | None = None
) -> s.PoolImported:
    """Create a pool from an export, NDJSON or binary (by its first byte; `Content-Type:
    application/x-msgpack` says it is binary)."""
    stream = aiter(chunks)
    head = b""
    async for chunk in stream:
        head += chunk
        if head:
            break
    binary = exports.is_binary(head)
    if frames.wants_frame(content_type) and not binary:
        raise BadRequest(
            f"the body is sent as {exports.MEDIA_TYPE} but is no binary pool export: it does not "
            f"begin with {exports.MAGIC!r}"
        )
    rest = _prepend(head, stream)
    async with ctx.db.write() as session:
        imp = _Importer(session, name)
        await (_read_binary(imp, rest) if binary else _read_ndjson(imp, rest))
        return await imp.finish()


async def _prepend(head: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if head:
        yield head
    async for chunk in rest:
        yield chunk


async def _read_ndjson(imp: _Importer, chunks: AsyncIterator[bytes]) -> None:
    lineno = 0
    async for raw in split_lines(chunks):
        lineno += 1
        if not raw.strip():
            continue
        try:
            await imp.record(s.parse_export_record(raw))
        except ValidationError as e:
            raise BadRequest(f"import line {lineno}: {s.validation_summary(e)}") from e
        except BadRequest as e:
            raise BadRequest(f"import line {lineno}: {e.detail}") from e
        except ValueError as e:  # a payload that is not base64 packed arrays
            raise BadRequest(f"import line {lineno}: {e}") from e


async def _read_binary(imp: _Importer, chunks: AsyncIterator[bytes]) -> None:
    reader = exports.Reader()
    ended = False
    try:
        async for chunk in chunks:
            for raw in reader.feed(chunk):
                n = reader.records
                try:
                    if ended:
                        raise BadRequest("a record after the end record")
                    item = exports.parse(raw)
                    if isinstance(item, exports.End):
                        exports.check_end(item, n)
                        ended = True
                    elif isinstance(item, exports.TrajectoryFrame):
                        await imp.trajectory_frame(item)
                    else:
                        await imp.record(item)
                except ValidationError as e:
                    raise BadRequest(f"import record {n}: {s.validation_summary(e)}") from e
                except BadRequest as e:
                    raise BadRequest(f"import record {n}: {e.detail}") from e
                except ValueError as e:  # ExportFormatError: not a record
                    raise BadRequest(f"import record {n}: {e}") from e
        reader.close()
    except exports.ExportFormatError as e:  # the stream itself: its magic, a length, its end
        raise BadRequest(f"import: {e}") from e
    if not ended:
        raise BadRequest(f"import: {exports.cut_off(reader.records)}")
