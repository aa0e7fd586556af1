"""Store rows <-> wire models, rules, and packed payload arrays."""

from __future__ import annotations

import contextvars
import functools
import hashlib
import json
import operator
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
import numpy.typing as npt
import pybase64
from pydantic import ConfigDict
from pydantic_core import to_jsonable_python
from sqlalchemy import Row

from exgrpo_client import frames
from exgrpo_client import schemas as s
from exgrpo_client.schemas import packed_of, set_packed
from exgrpo_pool import jsonread, jsonwrite
from exgrpo_pool.domain import ExperienceRules, check_weights
from exgrpo_pool.errors import BadRequest
from exgrpo_pool.store.models import (
    AnyBatch,
    AnyPool,
    AnyRun,
    PageRow,
    Pool,
    PoolRow,
    Question,
    RunRow,
    Trajectory,
    pool_scope,
)


class _StoredPoolConfig(s.PoolConfig):
    """A stored pool config as `pool_config` validates it once per distinct text: one instance
    for every row of that text, so frozen (a change raises; `model_copy` makes a new one)."""

    model_config = ConfigDict(frozen=True)


class _StoredOverrides(s.RunOverrides):
    """A stored run's overrides as `run_overrides` validates them once per distinct text (frozen:
    shared, as `_StoredPoolConfig`)."""

    model_config = ConfigDict(frozen=True)


@functools.lru_cache(maxsize=1024)
def _stored_config(text: str) -> s.PoolConfig:
    return _StoredPoolConfig.model_validate(jsonread.loads(text), strict=False)


@functools.lru_cache(maxsize=4096)
def _stored_overrides(text: str) -> s.RunOverrides:
    return _StoredOverrides.model_validate(jsonread.loads(text), strict=False)


def pool_config(pool: AnyPool) -> s.PoolConfig:
    """The pool's config. A plain row's is validated from its stored text once per distinct
    text in the process (frozen, shared by the rows of that text); an ORM row's each time."""
    if isinstance(pool, PoolRow):
        if pool.parsed is None:
            pool.parsed = _stored_config(pool.config)
        return pool.parsed
    return s.PoolConfig.model_validate(pool.config, strict=False)


def run_overrides(run: AnyRun) -> s.RunOverrides:
    """The run's overrides (a plain row's validated once per distinct text, as `pool_config`)."""
    if isinstance(run, RunRow):
        if run.parsed is None:
            run.parsed = _stored_overrides(run.overrides)
        return run.parsed
    return s.RunOverrides.model_validate(run.overrides, strict=False)


def rules_for(pool: AnyPool, run: AnyRun | None = None) -> ExperienceRules:
    return rules_of(pool_config(pool), run_overrides(run) if run is not None else None)


def checked_config(config: s.PoolConfig) -> s.PoolConfig:
    """The config, once the replay sampler has computed the bucket weights it gives (BadRequest
    when they are not finite and normalisable): a config is refused where it is set (create,
    PATCH, import), not found broken by every later plan."""
    try:
        check_weights(rules_of(config))
    except ValueError as e:
        raise BadRequest(f"config: {e}") from e
    return config


def rules_of(c: s.PoolConfig, o: s.RunOverrides | None = None) -> ExperienceRules:
    o = s.RunOverrides() if o is None else o
    return ExperienceRules(
        k=c.k,
        lbound=c.lbound,
        rbound=c.rbound,
        weighting=c.weighting,
        mu=c.mu,
        sigma=c.sigma,
        unit=c.unit,
        experience_ratio=c.experience_ratio if o.experience_ratio is None else o.experience_ratio,
        batch_size=c.batch_size if o.batch_size is None else o.batch_size,
        start_threshold=c.start_threshold if o.start_threshold is None else o.start_threshold,
        active_refresh_margin=c.active_refresh_margin,
        max_replay_age=c.max_replay_age if o.max_replay_age is None else o.max_replay_age,
    )


def stored_plan(batch: AnyBatch) -> s.StoredPlan:
    return s.StoredPlan.model_validate(batch.plan)


#: The key of a committed batch's `result` JSON that holds, beside its answer, the digest of what
#: was committed (`commit_digest`). Batches committed before it hold `COMMIT_DIGEST_V1`
#: (`commit_digest_v1`), `LEGACY_DIGEST` (a digest of the commit's JSON text, base64 payloads
#: included), or no digest at all.
COMMIT_DIGEST = "commit_sha256_v2"
COMMIT_DIGEST_V1 = "commit_sha256"
LEGACY_DIGEST = "groups_sha256"
_DIGEST_KEYS = (COMMIT_DIGEST, COMMIT_DIGEST_V1, LEGACY_DIGEST)
#: every rollout's payload fields, left out of `commit_digest_v1`'s JSON part (their bytes follow it)
_PAYLOAD_FIELDS = {"token_ids", "token_ids_b64", "logprobs", "logprobs_b64"}
_WITHOUT_PAYLOADS = {"groups": {"__all__": {"rollouts": {"__all__": _PAYLOAD_FIELDS}}}}
#: what `commit_digest` hashes first: its layout's name
_DIGEST_V2 = b"exgrpo commit digest v2\n"


def commit_digest(req: s.BatchCommit) -> str:
    """What a commit applies, whatever its encoding: SHA-256 of `commit_digest_parts` joined. A
    frame, base64 and JSON lists of the same commit give the same digest, so a commit sent again in
    another encoding is the same commit."""
    return digest_of(commit_digest_parts(req))


def commit_digest_parts(req: s.BatchCommit) -> list[bytes]:
    """What `commit_digest` hashes, in order: `_DIGEST_V2`, then as JSON (orjson,
    `jsonwrite.dumps`) `[policy_version, [[question_id, replay_trajectory_id, [[reward, entropy,
    replayed, finish_reason, text], ...]], ...], [tokens, ...]]` (every rollout's payload's token
    count in order, -1 where it has none; metrics and with_stats left out), then every payload's
    packed token ids (little-endian int32) one after the other, then every payload's packed
    log-probs (float32).

    The route makes the parts on the loop and hashes them in a thread (`digest_of`) beside the
    commit's statements. Work done with the GIL in that thread is work the loop waits for (in the
    statement it was in when the thread took the GIL, with the wake-ups on top): `commit_digest_v1`,
    made whole in the thread, cost ~8.5 ms of a 1,024-rollout commit, ~5.5 of them with the GIL
    (the model's JSON with its payload fields excluded, the bytes joined rollout by rollout), and
    the commit's first statement waited 5.2-6.7 ms for it; these parts take ~1.5 ms
    (comprehensions), and the thread only joins and hashes them (`bench/write_steps.py --clock
    wall`, in process)."""
    groups = req.groups
    rollouts = [r for g in groups for r in g.rollouts]
    packed = [packed_of(r) for r in rollouts]
    if None in packed and any(
        _payload_fields(r) != _NO_PAYLOAD for p, r in zip(packed, rollouts, strict=True) if p is None
    ):  # a payload not decoded yet (lists or base64 the route did not decode: a replay's check)
        predecode(groups)
        packed = [packed_of(r) for r in rollouts]
    meta = [
        req.policy_version,
        [[g.question_id, g.replay_trajectory_id, [_digested_fields(r) for r in g.rollouts]] for g in groups],
        [-1 if p is None else len(p[0]) // 4 for p in packed],
    ]
    parts = [_DIGEST_V2, jsonwrite.dumps(meta)]
    parts += [p[0] for p in packed if p is not None]
    parts += [p[1] for p in packed if p is not None]
    return parts


def digest_of(parts: list[bytes]) -> str:
    """SHA-256 of `parts` joined, as hex: one buffer, one update, so that hashlib lets go of the
    GIL while it hashes and takes it back once (each time a thread takes it back while the loop
    holds it, the loop gives it up and waits)."""
    return hashlib.sha256(b"".join(parts)).hexdigest()


#: a rollout's fields in `commit_digest` (validated: a reward or an entropy sent as 1 is 1.0 here,
#: as sent as 1.0), and its payload fields, all None where it sent no payload or sent it in a frame
_digested_fields = operator.attrgetter("reward", "entropy", "replayed", "finish_reason", "text")
_payload_fields = operator.attrgetter("token_ids", "token_ids_b64", "logprobs", "logprobs_b64")
_NO_PAYLOAD = (None, None, None, None)


def commit_digest_v1(req: s.BatchCommit) -> str:
    """`COMMIT_DIGEST_V1`, the digest batches were committed with before `commit_digest` (kept to
    recognise their commits sent again): its groups without their payload fields and its policy
    version as the model's JSON, then every rollout's payload as packed bytes behind their
    lengths."""
    predecode(req.groups)  # the payloads not decoded yet, kept on their rollouts as the route keeps them
    meta = req.model_dump_json(include={"groups", "policy_version"}, exclude=_WITHOUT_PAYLOADS)
    parts: list[bytes] = [meta.encode()]
    for g in req.groups:
        for r in g.rollouts:
            packed = packed_of(r)
            if packed is None:
                parts.append(b"\x00")
                continue
            lengths = len(packed[0]).to_bytes(8, "little") + len(packed[1]).to_bytes(8, "little")
            parts.append(b"\x01" + lengths)
            parts += packed
    return hashlib.sha256(b"".join(parts)).hexdigest()


async def commit_request(req: s.BatchCommit, digest: Awaitable[str]) -> str:
    """A commit request's content digest (`Idempotency.run`'s `content`): its commit digest and
    the rest of its body (metrics, with_stats) as JSON. Two commits with the same content digest
    ask for the same thing, whatever their encodings."""
    return f"{await digest} {_rest(req)}"


async def commit_request_v1(req: s.BatchCommit) -> str:
    """`commit_request` as it was made with `commit_digest_v1`: what the records of idempotency
    keys written before `commit_digest` keep (a retry of such a commit is still that commit)."""
    return f"{commit_digest_v1(req)} {_rest(req)}"


def _rest(req: s.BatchCommit) -> str:
    return req.model_dump_json(exclude={"groups", "policy_version"})


def _legacy_digest(req: s.BatchCommit) -> str:
    """`LEGACY_DIGEST`: the JSON text of the groups and policy version, then the payloads a frame
    carried beside them."""
    h = hashlib.sha256(req.model_dump_json(include={"groups", "policy_version"}).encode())
    for g in req.groups:
        for r in g.rollouts:
            packed = packed_of(r)
            if packed is not None and r.token_ids is None and r.token_ids_b64 is None:
                h.update(packed[0])
                h.update(packed[1])
    return h.hexdigest()


def committed_result(batch: AnyBatch) -> s.CommitResult:
    """The answer of a committed batch's commit."""
    assert batch.result is not None
    answer = {k: v for k, v in batch.result.items() if k not in _DIGEST_KEYS}
    return s.CommitResult.model_validate(answer, strict=False)


def same_commit(batch: AnyBatch, req: s.BatchCommit, digest: str | None = None) -> bool:
    """Whether `req` commits what the committed `batch` was committed with (`digest`: its
    `commit_digest`, where it is known already)."""
    assert batch.result is not None
    if COMMIT_DIGEST in batch.result:
        return bool(batch.result[COMMIT_DIGEST] == (digest or commit_digest(req)))
    if COMMIT_DIGEST_V1 in batch.result:
        return bool(batch.result[COMMIT_DIGEST_V1] == commit_digest_v1(req))
    if LEGACY_DIGEST in batch.result:
        return bool(batch.result[LEGACY_DIGEST] == _legacy_digest(req))
    return True


@dataclass(frozen=True, slots=True)
class RunScopes:
    """Where a run's state lives: `state` holds its buckets and retirement (`run_question`),
    `trajectories` its stored trajectories and their de-duplication. A scope is a run id, or the
    pool's shared scope (`pool_scope`, < 0); nothing is ever shared across pools."""

    state: int
    trajectories: int

    @property
    def drops_retired(self) -> bool:
        """Whether a retirement removes the question's trajectories: when the scope that retires
        it owns them (the spec never replays a retired question). With shared trajectories and
        per-run retirement, other runs still replay them."""
        return self.state == self.trajectories


def scopes_of(pool: AnyPool, run: AnyRun) -> RunScopes:
    sharing = pool_config(pool).sharing
    shared = pool_scope(pool.id)
    if sharing == "pooled":
        return RunScopes(state=shared, trajectories=shared)
    if sharing == "shared_trajectories":
        return RunScopes(state=run.id, trajectories=shared)
    return RunScopes(state=run.id, trajectories=run.id)


def scope_of(pool: AnyPool, run: AnyRun) -> int:
    """The run's state scope (buckets and retirement)."""
    return scopes_of(pool, run).state


def content_hash(prompt: list[dict[str, Any]], ground_truth: str) -> bytes:
    canon = json.dumps({"p": prompt, "g": ground_truth}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(canon.encode()).digest()[:16]


def question_row(pool_id: int, q: s.QuestionCreate, now: datetime) -> dict[str, Any]:
    """The `question` table row of a new question (its content hash included)."""
    prompt = [m.model_dump() for m in q.prompt]
    return {
        "pool_id": pool_id,
        "content_hash": content_hash(prompt, q.ground_truth),
        "prompt": prompt,
        "ground_truth": q.ground_truth,
        "data_source": q.data_source,
        "external_id": q.external_id,
        "metadata": q.metadata,
        "created_at": now,
    }


def pool_public(pool: Pool, counts: tuple[int, int, int]) -> s.PoolPublic:
    return s.PoolPublic(
        id=pool.id,
        name=pool.name,
        description=pool.description,
        config=pool_config(pool),
        num_questions=counts[0],
        num_trajectories=counts[1],
        num_runs=counts[2],
        created_at=pool.created_at,
        updated_at=pool.updated_at,
    )


def run_public(run: AnyRun, pool_name: str) -> s.RunPublic:
    return s.RunPublic(
        id=run.id,
        name=run.name,
        pool=pool_name,
        seed=run.seed,
        phase=run.phase,
        switched_at_step=run.switched_at_step,
        step=run.step,
        policy_version=run.policy_version,
        epoch=max(run.epoch, 0),
        cursor=run.cursor,
        overrides=run_overrides(run),
        created_at=run.created_at,
        updated_at=run.updated_at,
    )


def messages(prompt: list[dict[str, Any]]) -> list[s.ChatMessage]:
    return [s.ChatMessage.model_validate(m, strict=False) for m in prompt]


def question_public(q: Question, pool_name: str) -> s.QuestionPublic:
    return s.QuestionPublic(
        id=q.id,
        pool=pool_name,
        prompt=messages(q.prompt),
        ground_truth=q.ground_truth,
        data_source=q.data_source,
        external_id=q.external_id,
        metadata=q.meta,
        created_at=q.created_at,
    )


def question_bodies(rows: Iterable[PageRow], pool_name: str) -> list[dict[str, Any]]:
    """What `question_public` answers for each question of a page, as JSON values (the prompt as
    stored: validated on import; on Postgres the prompt and the metadata as their stored JSON text,
    `repo.question_page`), in one pass over its rows."""
    return [
        {
            "id": qid,
            "pool": pool_name,
            "prompt": prompt,
            "ground_truth": truth,
            "data_source": source,
            "external_id": ext,
            "metadata": meta,
            "created_at": _json_stamp(at, at.tzinfo),
        }
        for qid, prompt, truth, source, ext, meta, at in rows
    ]


#: While set (an answer that goes out as a binary frame), `trajectory_public` keeps the stored
#: payload bytes as they are instead of writing them as base64 text.
raw_payloads: contextvars.ContextVar[bool] = contextvars.ContextVar("exgrpo_raw_payloads", default=False)


def trajectory_public(
    t: Trajectory | Row[Any], run_names: dict[int, str], *, payload: bool, text: bool = False
) -> s.TrajectoryPublic:
    if payload and raw_payloads.get():
        out = trajectory_public(t, run_names, payload=False, text=text)
        set_packed(out, (t.token_ids, t.logprobs))
        return out
    return s.TrajectoryPublic(
        id=t.id,
        question_id=t.question_id,
        source_run=run_names.get(t.source_run_id) if t.source_run_id is not None else None,
        policy_version=t.policy_version,
        step=t.step,
        reward=t.reward,
        entropy=t.entropy,
        num_tokens=t.num_tokens,
        created_at=t.created_at,
        token_ids_b64=s.encode_b64(t.token_ids) if payload else None,
        logprobs_b64=s.encode_b64(t.logprobs) if payload else None,
        text=t.text if text else None,
    )


@functools.lru_cache(maxsize=4096)
def _json_stamp(at: datetime, tz: Any) -> Any:
    """A timestamp as JSON text, once per distinct value (the trajectories of one commit share
    theirs); `tz` (the value's own zone) is part of the key: equal instants in two zones are
    equal datetimes, written differently."""
    return to_jsonable_python(at.replace(tzinfo=tz))


def trajectory_body(t: Row[Any], run_names: dict[int, str]) -> dict[str, Any]:
    """A stored trajectory of an `Answer` (what `trajectory_public` answers, as JSON values; its
    payload goes beside it)."""
    return {
        "id": t.id,
        "question_id": t.question_id,
        "source_run": run_names.get(t.source_run_id) if t.source_run_id is not None else None,
        "policy_version": t.policy_version,
        "step": t.step,
        "reward": t.reward,
        "entropy": t.entropy,
        "num_tokens": t.num_tokens,
        "created_at": _json_stamp(t.created_at, t.created_at.tzinfo),
        "text": None,
    }


@dataclass(frozen=True, slots=True)
class Answer:
    """A batch plan or a selection built as plain JSON values straight from the service's rows,
    not as validated models (thousands of nested models per plan cost more than the rest of
    it): `body` is the answer without payload fields, `payloads` the stored (ids, log-probs)
    bytes of its candidates in order, which go out unchanged in a frame and as base64 in JSON.
    `model` names the answer's schema (`BatchPlan` or `SelectResult`)."""

    model: type[s.BatchPlan] | type[s.SelectResult]
    body: dict[str, Any]
    payloads: list[tuple[bytes, bytes]]

    def json(self) -> bytes:
        payloads = iter(self.payloads)

        def with_b64(c: dict[str, Any]) -> dict[str, Any]:
            ids, lps = next(payloads)
            return {**c, "token_ids_b64": s.encode_b64(ids), "logprobs_b64": s.encode_b64(lps)}

        replay = [
            {**item, "candidates": [with_b64(c) for c in item["candidates"]]} for item in self.body["replay"]
        ]
        return jsonwrite.dumps({**self.body, "replay": replay})

    def frame(self) -> bytes:
        return frames.encode(self.body, self.payloads)


def predecode(groups: list[s.GroupResult]) -> None:
    """Decode and check every JSON payload of a commit or an ingest before the request takes a
    lock or opens a transaction: the packed bytes wait on their rollouts, where `decode_payload`
    finds them (a frame's rollouts hold theirs already).

    Payloads sent as base64 (the SDK's JSON form) are decoded one by one and checked for the whole
    request at once, over all their tokens, as a frame's are (`_base64_payloads`): checked rollout
    by rollout, a commit's 1,024 cost ~6.9 ms, ~15 numpy calls each. Where a body holds lists, or
    any payload breaks a rule, every rollout is checked alone, so that the error names the first
    that breaks one, word for word as before."""
    if _base64_payloads(groups):
        return
    for gi, g in enumerate(groups):
        for ri, r in enumerate(g.rollouts):
            if packed_of(r) is not None:
                continue  # a frame's, or decoded already
            if (
                r.token_ids is None
                and r.token_ids_b64 is None
                and r.logprobs is None
                and r.logprobs_b64 is None
            ):
                continue  # no payload sent
            payload = decode_payload(r, f"groups[{gi}].rollouts[{ri}] (question {g.question_id})")
            if payload is not None:
                set_packed(r, (payload[0].tobytes(), payload[1].tobytes()))


def _base64_payloads(groups: list[s.GroupResult]) -> bool:
    """Give every rollout that carries a payload as base64 its packed bytes, if each of them holds
    every rule of `decode_payload` (then True). False, and nothing given, where a rollout carries
    a list, or a payload breaks a rule: `predecode` then checks rollout by rollout."""
    decoded: list[tuple[s.RolloutResult, bytes, bytes]] = []
    for g in groups:
        for r in g.rollouts:
            ids_b64, lps_b64 = r.token_ids_b64, r.logprobs_b64
            if ids_b64 is None or lps_b64 is None:
                if r.token_ids is None and r.logprobs is None and (ids_b64 is None) == (lps_b64 is None):
                    continue  # no payload (or a frame's, handed over already)
                return False
            if packed_of(r) is not None:
                continue
            try:
                ids, lps = (
                    pybase64.b64decode(ids_b64, validate=True),
                    pybase64.b64decode(lps_b64, validate=True),
                )
            except ValueError:
                return False
            if len(ids) != len(lps) or len(ids) % 4:
                return False
            decoded.append((r, ids, lps))
    if not decoded:
        return True
    # the payload rules of a frame, over all the tokens at once (no token, too many, ids below 0,
    # log-probs not finite or above 1e-3): `decode_payload`'s rules for payloads of whole tokens
    payloads = frames.Payloads(
        np.array([len(d[1]) // 4 for d in decoded], dtype=np.int32),
        np.frombuffer(b"".join([d[1] for d in decoded]), dtype=s.ID_DTYPE),
        np.frombuffer(b"".join([d[2] for d in decoded]), dtype=s.LOGPROB_DTYPE),
    )
    try:
        payloads.check()
    except frames.FrameError:
        return False
    for r, ids, lps in decoded:
        set_packed(r, (ids, lps))
    return True


def decode_payload(r: s.Payload, where: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(int32 ids, float32 log-probs) of a rollout, validated; None if it carries no payload."""
    packed = packed_of(r) if isinstance(r, s.RolloutResult) else None
    if packed is not None:
        # from a binary frame (checked with the whole request) or decoded by `predecode`
        return np.frombuffer(packed[0], dtype=s.ID_DTYPE), np.frombuffer(packed[1], dtype=s.LOGPROB_DTYPE)
    lps: npt.NDArray[np.floating[Any]]
    try:
        if r.token_ids is not None:
            ids = np.asarray(r.token_ids, dtype=np.int64)
        elif r.token_ids_b64 is not None:
            ids = s.decode_ids(r.token_ids_b64).astype(np.int64)
        else:
            return None
        if r.logprobs is not None:
            # float64 first: a JSON number beyond float32 range is refused below, not cast to -inf
            lps = np.asarray(r.logprobs, dtype=np.float64)
        elif r.logprobs_b64 is not None:
            lps = s.decode_logprobs(r.logprobs_b64)
        else:
            return None
    except OverflowError as e:  # a JSON token id beyond int64
        raise BadRequest(f"{where}: token ids must be in [0, 2^31)") from e
    except ValueError as e:
        raise BadRequest(
            f"{where}: payload is not valid packed data ({e}); send base64 of little-endian "
            "int32 ids and float32 log-probs"
        ) from e
    if ids.size == 0:
        raise BadRequest(f"{where}: a trajectory needs at least one token")
    if ids.size > s.MAX_TOKENS_PER_TRAJECTORY:
        raise BadRequest(f"{where}: {ids.size} tokens, more than the limit {s.MAX_TOKENS_PER_TRAJECTORY}")
    if ids.size != lps.size:
        raise BadRequest(
            f"{where}: {ids.size} token ids but {lps.size} log-probs; send one log-prob per token"
        )
    if (ids < 0).any() or (ids >= 2**31).any():
        raise BadRequest(f"{where}: token ids must be in [0, 2^31)")
    if not np.isfinite(lps).all() or (lps < np.finfo(np.float32).min).any():
        raise BadRequest(
            f"{where}: log-probs must be finite float32 numbers (found NaN, infinity or less than -3.4e38)"
        )
    if (lps > 1e-3).any():
        raise BadRequest(f"{where}: log-probs must be <= 0 (they are log-probabilities)")
    return ids.astype(s.ID_DTYPE), lps.astype(s.LOGPROB_DTYPE)
