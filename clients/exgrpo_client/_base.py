"""Request building, error mapping and the retry policy shared by `Client` and `AsyncClient`.

Nothing here does I/O. A typed client method builds a `Call` (method, path, body, how to parse
the answer) with one of the builders below; the client sends it with its own I/O, retrying as
`RetryPolicy` says, and hands the final response to `BaseClient._finish`.

Every write gets a fresh `Idempotency-Key` when its `Call` is built, and the key stays the same
across the retries of that call: the service answers a repeated key with the first answer, so a
write whose response was lost is retried without being applied twice.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, Generic, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from exgrpo_client import errors, exports, frames
from exgrpo_client import schemas as s
from exgrpo_client._models import Health, PoolExported, PoolImported, Readiness

__version__ = "0.1.0"

DEFAULT_URL = "http://127.0.0.1:8700"
ENV_URL = "EXGRPO_URL"
ENV_TOKEN = "EXGRPO_TOKEN"
USER_AGENT = f"exgrpo-client/{__version__}"

log = logging.getLogger("exgrpo_client")

RETRY_STATUSES = frozenset({429, 502, 503, 504})
# Failures after which the request may or may not have reached the service. Safe to retry because
# writes carry an idempotency key; other transport errors (bad URL scheme, ...) are not transient.
RETRY_EXCEPTIONS: tuple[type[Exception], ...] = (
    httpx.TimeoutException,
    httpx.NetworkError,
    httpx.RemoteProtocolError,
)
# A pool import streams a body the service does not key, so it is retried only when the
# connection was never made.
UPLOAD_RETRY_EXCEPTIONS: tuple[type[Exception], ...] = (httpx.ConnectError, httpx.ConnectTimeout)
UPLOAD_RETRY_STATUSES = frozenset({429, 503})

UPLOAD_CHUNK_BYTES = 1 << 20

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

Progress = Callable[[int, int | None], None]
"""`progress(done, total)`: items or bytes done so far, and the total when it is known."""

PathOrFile = str | os.PathLike[str] | IO[bytes]
QuestionLike = s.QuestionCreate | Mapping[str, Any]
GroupLike = s.GroupResult | Mapping[str, Any]
RolloutLike = s.RolloutResult | Mapping[str, Any]


# ------------------------------------------------------------------------------- retry policy
@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how long to wait before sending a call again.

    Retried: connection errors and timeouts, and the statuses 429, 502, 503 and 504. Never
    retried: any other 4xx (the request itself is wrong) and other 5xx (the service failed on
    this request and said so)."""

    retries: int = 3
    """Retries after the first attempt (0 disables retrying)."""
    backoff: float = 0.5
    """Seconds before the first retry; doubles with every further one."""
    max_delay: float = 30.0
    """Longest wait between two attempts, `Retry-After` included."""
    budget_s: float | None = None
    """A total time budget in seconds: retry (with the capped back-off) for as long as the time
    since the first attempt stays within it, however many retries that takes, instead of
    `retries` times. Rides through a service restart of minutes. None: count `retries`."""

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if self.backoff < 0:
            raise ValueError(f"backoff must be >= 0 seconds, got {self.backoff}")
        if self.budget_s is not None and not self.budget_s >= 0:
            raise ValueError(f"budget_s must be >= 0 seconds or None, got {self.budget_s}")

    def retry_status(self, status: int) -> bool:
        return status in RETRY_STATUSES

    def delay(self, attempt: int, response: httpx.Response | None = None) -> float:
        """Seconds to wait after failed attempt number `attempt` (0 for the first)."""
        retry_after = None if response is None else response.headers.get("retry-after")
        if retry_after is not None:
            try:
                return min(max(float(retry_after), 0.0), self.max_delay)
            except ValueError:
                pass  # an HTTP date: fall back to our own back-off
        base = min(self.max_delay, self.backoff * 2.0 ** min(attempt, 64))
        # jitter, so clients that failed together do not come back together
        return base * random.uniform(0.5, 1.0)

    def next_delay(
        self, attempt: int, elapsed: float, response: httpx.Response | None = None
    ) -> float | None:
        """Seconds to wait before the next attempt after failed attempt `attempt` (0 for the
        first), `elapsed` seconds after the first began; None when no retry is left (the retries
        are used up, or the budget is spent: the last wait ends at the budget's end)."""
        if self.budget_s is None:
            return self.delay(attempt, response) if attempt < self.retries else None
        left = self.budget_s - elapsed
        return None if left <= 0 else min(self.delay(attempt, response), left)


# ------------------------------------------------------------------------------------ calls
@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One request to send (with its retries) and how to read the answer."""

    method: str
    path: str
    parse: Callable[[bytes], T]
    body: bytes | None = None
    params: Mapping[str, str | int | float | bool] | None = None
    idempotency_key: str | None = None
    extra_timeout: float = 0.0
    """Seconds on top of the client's timeout (long polls, deletions)."""
    ok_statuses: frozenset[int] = frozenset()
    """Error statuses that are an answer, not a failure (503 of /readyz)."""
    retry: bool = True
    run: tuple[str, str] | None = None
    """(pool, run) of a write on a run: it carries the run's lease header if the client uses one."""
    batch: tuple[str, str] | None = None
    """(pool, batch id) of a commit: it carries the lease header of the batch's run."""
    model: BaseModel | None = None
    """A body that may go as a binary frame (a commit, an ingest); sent as JSON when the client
    sends JSON. Instead of `body`."""
    frame_parse: Callable[[bytes], T] | None = None
    """How to read the answer when it comes as a binary frame (plans, selections)."""
    headers: Mapping[str, str] | None = None
    """Headers of this call over the ones the client sets (a pool export's `Accept`, a pool
    import's `Content-Type`)."""


def seg(value: str | int) -> str:
    """One path segment, quoted."""
    return quote(str(value), safe="")


def _model(cls: type[M]) -> Callable[[bytes], M]:
    return cls.model_validate_json


def _dict(raw: bytes) -> dict[str, Any]:
    out = json.loads(raw)
    if not isinstance(out, dict):
        raise errors.ExgrpoError(f"expected a JSON object from the service, got {type(out).__name__}")
    return out


def _body(model: BaseModel) -> bytes:
    # unset fields stay out, so the service applies its own defaults (and PATCH changes only what
    # was given)
    return model.model_dump_json(exclude_unset=True).encode()


def get(
    path: str, parse: Callable[[bytes], T], params: Mapping[str, Any] | None = None, **kw: Any
) -> Call[T]:
    return Call("GET", path, parse, params=params, **kw)


def write(method: str, path: str, body: BaseModel | None, parse: Callable[[bytes], T], **kw: Any) -> Call[T]:
    return Call(
        method,
        path,
        parse,
        body=None if body is None else _body(body),
        idempotency_key=str(uuid.uuid4()),
        **kw,
    )


def _given(**fields: Any) -> dict[str, Any]:
    """The keyword arguments that were given (not None), for `model_validate`."""
    return {k: v for k, v in fields.items() if v is not None}


# ----------------------------------------------------------------------------- endpoints: ops
def health() -> Call[Health]:
    return get("/healthz", _model(Health))


def ready() -> Call[Readiness]:
    # not retried: a 503 here is the answer (something is not ready), not a transient failure
    return get("/readyz", _model(Readiness), ok_statuses=frozenset({503}), retry=False)


def rebuild_index(pool: str | None) -> Call[dict[str, Any]]:
    path = "/v1/admin/index/rebuild" if pool is None else f"/v1/pools/{seg(pool)}/index/rebuild"
    return write("POST", path, None, _dict)


# --------------------------------------------------------------------------- endpoints: pools
def create_pool(
    name: str, config: s.PoolConfig | Mapping[str, Any] | None, description: str
) -> Call[s.PoolPublic]:
    body = s.PoolCreate.model_validate({"name": name, "description": description, **_given(config=config)})
    return write("POST", "/v1/pools", body, _model(s.PoolPublic))


def list_pools() -> Call[s.PoolsPublic]:
    return get("/v1/pools", _model(s.PoolsPublic))


def get_pool(name: str) -> Call[s.PoolPublic]:
    return get(f"/v1/pools/{seg(name)}", _model(s.PoolPublic))


def update_pool(
    name: str, description: str | None, config: s.PoolConfig | Mapping[str, Any] | None
) -> Call[s.PoolPublic]:
    body = s.PoolUpdate.model_validate(_given(description=description, config=config_patch(config)))
    return write("PATCH", f"/v1/pools/{seg(name)}", body, _model(s.PoolPublic))


def config_patch(changes: s.PoolConfig | Mapping[str, Any] | None) -> s.PoolConfigPatch | None:
    """A mapping changes only the keys it names (the service merges them into the pool's config);
    a `PoolConfig` gives every key, so it replaces the whole config."""
    if changes is None:
        return None
    if isinstance(changes, s.PoolConfig):
        return s.PoolConfigPatch.model_validate(changes.model_dump())
    return s.PoolConfigPatch.model_validate(dict(changes))


#: seconds a pool's or a run's deletion may take beyond the client's timeout: one transaction over
#: everything in it (a pool of 1M questions: ~27 s on Postgres, ~57 s on SQLite; a retry after a
#: client-side timeout would find it gone and answer 404)
DELETE_EXTRA_TIMEOUT_S = 600.0


def delete_pool(name: str, force: bool) -> Call[None]:
    params = {"force": "true"} if force else None
    return write(
        "DELETE",
        f"/v1/pools/{seg(name)}",
        None,
        _nothing,
        params=params,
        extra_timeout=DELETE_EXTRA_TIMEOUT_S,
    )


def pool_stats(pool: str) -> Call[s.PoolStats]:
    return get(f"/v1/pools/{seg(pool)}/stats", _model(s.PoolStats))


def import_questions(pool: str, questions: list[s.QuestionCreate]) -> Call[s.QuestionsImported]:
    body = s.QuestionsImport(questions=questions)
    return write("POST", f"/v1/pools/{seg(pool)}/questions", body, _model(s.QuestionsImported))


def list_questions(pool: str, after: int, limit: int) -> Call[s.QuestionsPublic]:
    return get(
        f"/v1/pools/{seg(pool)}/questions", _model(s.QuestionsPublic), {"after": after, "limit": limit}
    )


def question(pool: str, question_id: int, payload: bool) -> Call[s.QuestionDetail]:
    params = {"payload": "true"} if payload else None
    return get(f"/v1/pools/{seg(pool)}/questions/{seg(question_id)}", _model(s.QuestionDetail), params)


NDJSON = "application/x-ndjson"


def export_pool(pool: str, binary: bool) -> Call[bytes]:
    """A pool's export, in its binary form (`exgrpo_client.exports`) or as NDJSON."""
    accept = f"{exports.MEDIA_TYPE}, {NDJSON}" if binary else NDJSON
    return get(f"/v1/pools/{seg(pool)}/export", bytes, headers={"accept": accept})


def import_pool(name: str | None, source: UploadSource) -> Call[PoolImported]:
    """A pool import of `source`, sent as what its first bytes say it is."""
    params = None if name is None else {"name": name}
    binary = exports.is_binary(source.peek(len(exports.MAGIC)))
    content_type = exports.MEDIA_TYPE if binary else NDJSON
    return Call(
        "POST",
        "/v1/pools/import",
        _model(PoolImported),
        params=params,
        headers={"content-type": content_type},
    )


# ---------------------------------------------------------------------------- endpoints: runs
def _runs(pool: str) -> str:
    return f"/v1/pools/{seg(pool)}/runs"


def create_run(
    pool: str, name: str, seed: int, overrides: s.RunOverrides | Mapping[str, Any] | None, phase: s.Phase
) -> Call[s.RunPublic]:
    body = s.RunCreate.model_validate(
        {"name": name, "seed": seed, "phase": phase, **_given(overrides=overrides)}
    )
    return write("POST", _runs(pool), body, _model(s.RunPublic))


def list_runs(pool: str) -> Call[s.RunsPublic]:
    return get(_runs(pool), _model(s.RunsPublic))


def get_run(pool: str, run: str) -> Call[s.RunPublic]:
    return get(f"{_runs(pool)}/{seg(run)}", _model(s.RunPublic))


def update_run(
    pool: str, run: str, phase: s.Phase | None, overrides: s.RunOverrides | Mapping[str, Any] | None
) -> Call[s.RunPublic]:
    body = s.RunUpdate.model_validate(_given(phase=phase, overrides=overrides))
    return write("PATCH", f"{_runs(pool)}/{seg(run)}", body, _model(s.RunPublic), run=(pool, run))


def delete_run(pool: str, run: str, force: bool) -> Call[None]:
    params = {"force": "true"} if force else None
    return write(
        "DELETE",
        f"{_runs(pool)}/{seg(run)}",
        None,
        _nothing,
        params=params,
        extra_timeout=DELETE_EXTRA_TIMEOUT_S,
    )


def run_stats(pool: str, run: str) -> Call[s.RunStats]:
    return get(f"{_runs(pool)}/{seg(run)}/stats", _model(s.RunStats))


def add_policy_version(pool: str, run: str, version: int, uri: str, step: int) -> Call[s.PolicyVersionPublic]:
    body = s.PolicyVersionCreate(version=version, uri=uri, step=step)
    return write(
        "POST",
        f"{_runs(pool)}/{seg(run)}/policy-versions",
        body,
        _model(s.PolicyVersionPublic),
        run=(pool, run),
    )


def list_policy_versions(pool: str, run: str) -> Call[s.PolicyVersionsPublic]:
    return get(f"{_runs(pool)}/{seg(run)}/policy-versions", _model(s.PolicyVersionsPublic))


def post_run_metrics(pool: str, run: str, step: int, metrics: Mapping[str, float]) -> Call[s.RunMetricsStep]:
    body = s.RunMetricsCreate(step=step, metrics=dict(metrics))
    return write("POST", f"{_runs(pool)}/{seg(run)}/metrics", body, _model(s.RunMetricsStep), run=(pool, run))


def run_metrics(pool: str, run: str, after_step: int, limit: int) -> Call[s.RunMetricsPublic]:
    params = {"after_step": after_step, "limit": limit}
    return get(f"{_runs(pool)}/{seg(run)}/metrics", _model(s.RunMetricsPublic), params=params)


def _frame(cls: type[M]) -> Callable[[bytes], M]:
    return lambda raw: frames.decode_model(raw, cls)


def plan_batch(pool: str, run: str, fields: Mapping[str, Any]) -> Call[s.BatchPlan]:
    body = s.BatchCreate.model_validate(_given(**fields))
    path = f"{_runs(pool)}/{seg(run)}/batches"
    return write("POST", path, body, _model(s.BatchPlan), run=(pool, run), frame_parse=_frame(s.BatchPlan))


def ingest(
    pool: str, run: str, groups: Sequence[GroupLike], policy_version: int, step: int | None
) -> Call[s.CommitResult]:
    body = s.IngestRequest.model_validate(
        {"groups": list(groups), "policy_version": policy_version, **_given(step=step)}
    )
    return replace(
        write("POST", f"{_runs(pool)}/{seg(run)}/ingest", None, _model(s.CommitResult), run=(pool, run)),
        model=body,
    )


def select(
    pool: str, run: str, n: int, seed: int | None, candidates: s.CandidateMode
) -> Call[s.SelectResult]:
    body = s.SelectRequest.model_validate({"n": n, "candidates": candidates, **_given(seed=seed)})
    # a read that happens to be a POST: no idempotency key needed, retried like a GET
    return Call(
        "POST",
        f"{_runs(pool)}/{seg(run)}/select",
        _model(s.SelectResult),
        body=_body(body),
        frame_parse=_frame(s.SelectResult),
    )


def acquire_run_lease(
    pool: str, run: str, holder: str, ttl_s: float, takeover: bool, generation: int | None = None
) -> Call[s.RunLease]:
    body = s.RunLeaseRequest(holder=holder, ttl_s=float(ttl_s), takeover=takeover, generation=generation)
    return write("PUT", f"{_runs(pool)}/{seg(run)}/lease", body, _model(s.RunLease))


def release_run_lease(pool: str, run: str, holder: str) -> Call[None]:
    return write("DELETE", f"{_runs(pool)}/{seg(run)}/lease", None, _nothing, params={"holder": holder})


def _nothing(raw: bytes) -> None:
    del raw  # a 204 has no body


def claim_tasks(
    pool: str, run: str, worker: str, max_tasks: int, lease_seconds: float
) -> Call[s.TasksPublic]:
    body = s.TaskClaim(worker=worker, max_tasks=max_tasks, lease_seconds=float(lease_seconds))
    return write("POST", f"{_runs(pool)}/{seg(run)}/tasks/claim", body, _model(s.TasksPublic))


def claim_pool_tasks(
    pool: str, worker: str, max_tasks: int, lease_seconds: float, runs: Sequence[str] | None
) -> Call[s.TasksPublic]:
    body = s.PoolTaskClaim.model_validate(
        {
            "worker": worker,
            "max_tasks": max_tasks,
            "lease_seconds": float(lease_seconds),
            **_given(runs=None if runs is None else list(runs)),
        }
    )
    return write("POST", f"/v1/pools/{seg(pool)}/tasks/claim", body, _model(s.TasksPublic))


# ------------------------------------------------------------------------- endpoints: batches
def _batch(pool: str, batch_id: str) -> str:
    return f"/v1/pools/{seg(pool)}/batches/{seg(batch_id)}"


def get_batch(pool: str, batch_id: str) -> Call[s.BatchPlan]:
    return get(_batch(pool, batch_id), _model(s.BatchPlan), frame_parse=_frame(s.BatchPlan))


def batch_status(pool: str, batch_id: str) -> Call[s.BatchStatusPublic]:
    return get(f"{_batch(pool, batch_id)}/status", _model(s.BatchStatusPublic))


def commit_batch(
    pool: str,
    batch_id: str,
    groups: Sequence[GroupLike],
    policy_version: int | None,
    metrics: Mapping[str, float] | None,
    with_stats: bool,
) -> Call[s.CommitResult]:
    body = s.BatchCommit.model_validate(
        {
            "groups": list(groups),
            **_given(policy_version=policy_version, metrics=None if metrics is None else dict(metrics)),
            **({"with_stats": True} if with_stats else {}),
        }
    )
    call = write(
        "POST", f"{_batch(pool, batch_id)}/commit", None, _model(s.CommitResult), batch=(pool, batch_id)
    )
    return replace(call, model=body)


def batch_results(pool: str, batch_id: str, wait: float) -> Call[s.BatchResults]:
    params = {"wait": wait} if wait else None
    return get(f"{_batch(pool, batch_id)}/results", _model(s.BatchResults), params, extra_timeout=float(wait))


# --------------------------------------------------------------------------- endpoints: tasks
def _task(pool: str, task_id: int) -> str:
    return f"/v1/pools/{seg(pool)}/tasks/{seg(task_id)}"


def renew_task(pool: str, task_id: int, lease_token: str, lease_seconds: float) -> Call[s.TaskPublic]:
    body = s.TaskRenew(lease_token=lease_token, lease_seconds=float(lease_seconds))
    return write("POST", f"{_task(pool, task_id)}/renew", body, _model(s.TaskPublic))


def complete_task(
    pool: str, task_id: int, lease_token: str, rollouts: Sequence[RolloutLike], policy_version: int | None
) -> Call[s.TaskPublic]:
    body = s.TaskComplete.model_validate(
        {"lease_token": lease_token, "rollouts": list(rollouts), **_given(policy_version=policy_version)}
    )
    return write("POST", f"{_task(pool, task_id)}/complete", body, _model(s.TaskPublic))


def fail_task(pool: str, task_id: int, lease_token: str, error: str, retry: bool) -> Call[s.TaskPublic]:
    body = s.TaskFail(lease_token=lease_token, error=error, retry=retry)
    return write("POST", f"{_task(pool, task_id)}/fail", body, _model(s.TaskPublic))


# ------------------------------------------------------------------------------ error mapping
def api_error(response: httpx.Response) -> errors.APIError:
    """The exception for an error response (problem+json, or whatever a proxy sent)."""
    status = response.status_code
    title = response.reason_phrase or "HTTP error"
    detail = ""
    problem: dict[str, Any] = {}
    try:
        parsed = response.json()
        if isinstance(parsed, dict):
            problem = parsed
    except ValueError:
        pass
    if problem:
        title = str(problem.get("title") or title)
        raw = problem.get("detail")
        detail = raw if isinstance(raw, str) else ("" if raw is None else json.dumps(raw))
    if not detail:
        text = response.text.strip()
        detail = text[:500] if text else f"HTTP {status} {title}"
    request_id = problem.get("request_id") or response.headers.get("x-request-id")
    errs = problem.get("errors")
    cls = errors.error_class(status)
    return cls(
        status,
        title,
        detail,
        request_id=None if request_id is None else str(request_id),
        errors=errs if isinstance(errs, list) else None,
        method=response.request.method,
        url=str(response.request.url),
    )


def transport_error(exc: Exception, request: httpx.Request, attempts: int) -> errors.TransportError:
    tries = "once" if attempts == 1 else f"{attempts} times"
    url = str(request.url)
    message = (
        f"{request.method} {url} failed ({tries}): {type(exc).__name__}: {exc or 'no details'}; "
        "is the pool service running and the URL right? (EXGRPO_URL, exgrpo serve)"
    )
    return errors.TransportError(message, method=request.method, url=url)


# ----------------------------------------------------------------------------- the base client
class BaseClient:
    """Configuration and request building shared by `Client` and `AsyncClient`."""

    def __init__(
        self,
        base_url: str | None,
        *,
        token: str | None,
        timeout: float | None,
        retries: int,
        backoff: float,
        retry_budget_s: float | None = None,
        binary: bool = True,
    ) -> None:
        url = base_url or os.environ.get(ENV_URL) or DEFAULT_URL
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {url!r}")
        self.base_url = url.rstrip("/")
        self.token = token if token is not None else (os.environ.get(ENV_TOKEN) or None)
        self.timeout = timeout
        self.retry_policy = RetryPolicy(retries=retries, backoff=backoff, budget_s=retry_budget_s)
        #: commits and ingests go as binary frames, plans and selections come as frames (False:
        #: JSON throughout, as curl and other languages speak it)
        self.binary = binary
        # run leases in use, by (pool, run) (pool None: the lease did not say), and the run of
        # each batch this client planned, so a commit carries its run's lease
        self._leases: dict[tuple[str | None, str], s.RunLease] = {}
        self._batch_runs: dict[str, tuple[str, str]] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={self.base_url!r}, token={'***' if self.token else None})"

    def _http_options(self) -> dict[str, Any]:
        headers = {"user-agent": USER_AGENT, "accept": "application/json"}
        if self.token:
            headers["authorization"] = f"Bearer {self.token}"
        return {"base_url": self.base_url, "headers": headers, "timeout": self.timeout}

    # ------------------------------------------------------------------------------ run leases
    def use_run_lease(self, lease: s.RunLease | None) -> None:
        """Send `lease`'s `X-Run-Lease` header with every later write of its run (plan, commit,
        ingest, policy versions, run metrics, run update). A newer lease of the same run replaces
        it; None forgets every lease of this client."""
        if lease is None:
            self._leases.clear()
            return
        self._leases[(lease.pool, lease.run)] = lease

    def _forget_lease(self, pool: str, run: str, holder: str) -> None:
        for key in ((pool, run), (None, run)):
            held = self._leases.get(key)
            if held is not None and held.holder == holder:
                del self._leases[key]

    def _lease_for(self, call: Call[Any]) -> s.RunLease | None:
        target = call.run
        if target is None and call.batch is not None:
            pool, batch_id = call.batch
            target = self._batch_runs.get(batch_id)
            if target is None:  # a batch this client did not plan: the pool's only lease, if one
                in_pool = [lease for (p, _), lease in self._leases.items() if p in (pool, None)]
                return in_pool[0] if len(in_pool) == 1 else None
        if target is None:
            return None
        return self._leases.get(target) or self._leases.get((None, target[1]))

    def _noted(self, result: T) -> T:
        if isinstance(result, s.BatchPlan):
            if len(self._batch_runs) >= 1024:  # only recent batches are committed
                self._batch_runs.pop(next(iter(self._batch_runs)))
            self._batch_runs[result.id] = (result.pool, result.run)
        return result

    def _timeout_for(self, call: Call[Any]) -> httpx.Timeout | None:
        if self.timeout is None:
            return None
        return httpx.Timeout(self.timeout + call.extra_timeout)

    def _build(
        self, http: httpx.Client | httpx.AsyncClient, call: Call[Any], content: Any = None
    ) -> httpx.Request:
        """The request for a call (once: its retries resend the same request, ids and all)."""
        headers = {"x-request-id": uuid.uuid4().hex[:16]}
        if call.model is not None and content is None:
            if self.binary:
                content = frames.encode_model(call.model)
                headers["content-type"] = frames.MEDIA_TYPE
            else:
                content = _body(call.model)
                headers["content-type"] = "application/json"
        elif call.body is not None:
            headers["content-type"] = "application/json"
        elif content is not None:
            headers["content-type"] = "application/x-ndjson"
        if self.binary and call.frame_parse is not None:
            headers["accept"] = f"{frames.MEDIA_TYPE}, application/json"
        if call.headers is not None:
            headers.update(call.headers)
        if call.idempotency_key is not None:
            headers["idempotency-key"] = call.idempotency_key
        lease = self._lease_for(call)
        if lease is not None:
            headers[s.LEASE_HEADER] = lease.header
        return http.build_request(
            call.method,
            call.path,
            params=call.params,
            content=call.body if content is None else content,
            headers=headers,
            timeout=self._timeout_for(call),
        )

    def _retry_delay(
        self,
        call: Call[Any],
        attempt: int,
        started: float,
        *,
        response: httpx.Response | None = None,
        exc: Exception | None = None,
    ) -> float | None:
        """Seconds to wait before sending `call` again after failed attempt `attempt` (the first
        began at `started`, `time.monotonic()`); None: the failure is final (not a transient one)
        or the retries or the time budget are spent."""
        if not call.retry:
            return None
        if exc is not None:
            if not isinstance(exc, RETRY_EXCEPTIONS):
                return None
        elif response is None or not self.retry_policy.retry_status(response.status_code):
            return None
        delay = self.retry_policy.next_delay(attempt, time.monotonic() - started, response)
        if delay is not None:  # one line per retry: an outage rode through is visible in the log
            # (INFO: a long-running trainer or worker logs it; a one-shot CLI command prints one error)
            why = type(exc).__name__ if exc is not None else f"HTTP {response.status_code if response else 0}"
            log.info(
                "retrying %s %s in %.1f s (attempt %d: %s)", call.method, call.path, delay, attempt + 1, why
            )
        return delay

    def _retry_upload(
        self, source: UploadSource, attempt: int, exc: Exception | None, status: int = 0
    ) -> bool:
        """Whether to send a pool import again: only if it surely did not reach the service."""
        if not source.rewindable or attempt >= self.retry_policy.retries:
            return False
        return (
            isinstance(exc, UPLOAD_RETRY_EXCEPTIONS) if exc is not None else status in UPLOAD_RETRY_STATUSES
        )

    def _finish(self, call: Call[T], response: httpx.Response) -> T:
        if response.is_success or response.status_code in call.ok_statuses:
            framed = frames.wants_frame(response.headers.get("content-type"))
            parse = call.frame_parse if framed and call.frame_parse is not None else call.parse
            return self._noted(parse(response.content))
        raise api_error(response)


# ----------------------------------------------------------------------------------- helpers
def question_chunks(questions: Iterable[QuestionLike], chunk_size: int) -> Iterator[list[s.QuestionCreate]]:
    """Validated questions in lists of at most `chunk_size` (dicts are checked against the schema)."""
    if not 1 <= chunk_size <= 50_000:
        raise ValueError(f"chunk_size must be between 1 and 50000, got {chunk_size}")
    chunk: list[s.QuestionCreate] = []
    for q in questions:
        chunk.append(q if isinstance(q, s.QuestionCreate) else s.QuestionCreate.model_validate(dict(q)))
        if len(chunk) == chunk_size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def add_imported(total: s.QuestionsImported | None, part: s.QuestionsImported) -> s.QuestionsImported:
    if total is None:
        return part
    return s.QuestionsImported(
        received=total.received + part.received,
        inserted=total.inserted + part.inserted,
        duplicates=total.duplicates + part.duplicates,
        num_questions=part.num_questions,
    )


def known_length(items: Iterable[Any]) -> int | None:
    return len(items) if isinstance(items, Sized) else None


class ExportWriter:
    """Writes an export stream to a path (via `<path>.partial`, renamed when complete) or to an
    open binary file, and reads the header record as it passes (NDJSON or binary)."""

    def __init__(self, dest: PathOrFile) -> None:
        self.num_bytes = 0
        self.header: s.ExportHeader | None = None
        self._head = b""
        if isinstance(dest, str | os.PathLike):
            self.path: Path | None = Path(dest)
            self._tmp: Path | None = self.path.with_name(self.path.name + ".partial")
            self.file: IO[bytes] = open(self._tmp, "wb")  # noqa: SIM115 - closed in finish/abort
        else:
            self.path = self._tmp = None
            self.file = dest

    def feed(self, chunk: bytes) -> None:
        """Bookkeeping for a chunk the caller is about to write to `self.file`."""
        self.num_bytes += len(chunk)
        if self.header is None:
            self._head += chunk
            if exports.is_binary(self._head):
                self.header = binary_export_header(self._head)
            else:
                line, newline, _ = self._head.partition(b"\n")
                if newline:
                    self.header = parse_export_header(line)
            if self.header is not None:
                self._head = b""

    def finish(self) -> PoolExported:
        if self.header is None:
            self.abort()
            raise errors.ExgrpoError("the export stream ended before its header line")
        if self._tmp is not None and self.path is not None:
            self.file.close()
            os.replace(self._tmp, self.path)
        else:
            self.file.flush()
        return PoolExported(
            header=self.header, num_bytes=self.num_bytes, path=None if self.path is None else str(self.path)
        )

    def abort(self) -> None:
        if self._tmp is not None:
            self.file.close()
            self._tmp.unlink(missing_ok=True)


def binary_export_header(head: bytes) -> s.ExportHeader | None:
    """The header of a binary export from its first bytes; None until they hold all of it."""
    try:
        return exports.header(head)
    except ValidationError as e:
        raise errors.ExgrpoError(f"not a pool export: {s.validation_summary(e)}") from e
    except exports.ExportFormatError as e:
        raise errors.ExgrpoError(f"not a pool export: {e}") from e


def parse_export_header(line: bytes) -> s.ExportHeader:
    try:
        record = s.parse_export_record(line)
    except ValidationError as e:
        raise errors.ExgrpoError(f"not a pool export: {s.validation_summary(e)}") from e
    if not isinstance(record, s.ExportHeader):
        raise errors.ExgrpoError(f"not a pool export: the first line is a {record.type!r} record")
    return record


class UploadSource:
    """A pool export to upload, from a path or an open binary file."""

    def __init__(self, src: PathOrFile) -> None:
        if isinstance(src, str | os.PathLike):
            self.file: IO[bytes] = open(src, "rb")  # noqa: SIM115 - closed by close()
            self._owned = True
        else:
            self.file = src
            self._owned = False
        self._start: int | None = None
        self._peeked = b""
        self.total: int | None = None
        if self.file.seekable():
            self._start = self.file.tell()
            self.total = self.file.seek(0, os.SEEK_END) - self._start
            self.file.seek(self._start)

    @property
    def rewindable(self) -> bool:
        return self._start is not None

    def rewind(self) -> None:
        assert self._start is not None
        self.file.seek(self._start)

    def peek(self, n: int) -> bytes:
        """The first `n` bytes (fewer if it is shorter), still to be read."""
        if self._peeked or not self.rewindable:
            self._peeked += self.file.read(max(0, n - len(self._peeked)))
            return self._peeked[:n]
        head = self.file.read(n)
        self.rewind()
        return head

    def read(self) -> bytes:
        if self._peeked:
            head, self._peeked = self._peeked, b""
            return head + self.file.read(max(0, UPLOAD_CHUNK_BYTES - len(head)))
        return self.file.read(UPLOAD_CHUNK_BYTES)

    def close(self) -> None:
        if self._owned:
            self.file.close()
