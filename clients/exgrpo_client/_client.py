"""`Client` (blocking) and `AsyncClient` (asyncio) for the experience pool service.

Both are built on `_base`: each typed method builds a `Call` there and sends it here. The two
classes differ only in I/O (`httpx.Client` vs `httpx.AsyncClient`, `time.sleep` vs
`asyncio.sleep`, file access in a worker thread for the async streaming methods).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

import httpx

from exgrpo_client import _base as b
from exgrpo_client import schemas as s
from exgrpo_client._base import (
    BaseClient,
    Call,
    ExportWriter,
    GroupLike,
    PathOrFile,
    Progress,
    QuestionLike,
    RolloutLike,
    UploadSource,
)
from exgrpo_client._models import Health, PoolExported, PoolImported, Readiness

T = TypeVar("T")


class Client(BaseClient):
    """Blocking client of the pool service.

        with Client("http://127.0.0.1:8700", token="...") as pool:
            pool.create_pool("math", {"k": 8, "batch_size": 128})

    `base_url` defaults to $EXGRPO_URL, then http://127.0.0.1:8700; `token` to $EXGRPO_TOKEN.
    Requests that fail on the way (connection errors, timeouts, 429, 502, 503, 504) are sent
    again up to `retries` times, waiting `backoff` seconds, then twice as long each time. Writes
    are retried too: each carries an idempotency key, so the service applies it once.
    `retry_budget_s` retries instead for as long as that many seconds allow since a call's first
    attempt (the back-off capped at 30 s), to ride through a restart of the service.
    `transport` replaces the network (`httpx.MockTransport`, `httpx.WSGITransport`, ...).
    `binary` (the default) sends commits and ingests as binary frames and takes plans and
    selections as frames (token ids and log-probs as raw buffers, no base64); `binary=False`
    speaks JSON throughout."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        token: str | None = None,
        timeout: float | None = 30.0,
        retries: int = 3,
        backoff: float = 0.5,
        retry_budget_s: float | None = None,
        transport: httpx.BaseTransport | None = None,
        binary: bool = True,
    ) -> None:
        super().__init__(
            base_url,
            token=token,
            timeout=timeout,
            retries=retries,
            backoff=backoff,
            retry_budget_s=retry_budget_s,
            binary=binary,
        )
        self._http = httpx.Client(transport=transport, **self._http_options())

    # ---------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ----------------------------------------------------------------------------------- I/O
    def _send(self, call: Call[Any], *, stream: bool = False) -> httpx.Response:
        request = self._build(self._http, call)
        attempt = 0
        started = time.monotonic()
        while True:
            try:
                response = self._http.send(request, stream=stream)
            except httpx.TransportError as e:
                delay = self._retry_delay(call, attempt, started, exc=e)
                if delay is None:
                    raise b.transport_error(e, request, attempt + 1) from e
            else:
                delay = self._retry_delay(call, attempt, started, response=response)
                if delay is None:
                    return response
                response.close()
            time.sleep(delay)
            attempt += 1

    def _request(self, call: Call[T]) -> T:
        return self._finish(call, self._send(call))

    # ----------------------------------------------------------------------------------- ops
    def health(self) -> Health:
        """`GET /healthz`: the process answers."""
        return self._request(b.health())

    def ready(self) -> Readiness:
        """`GET /readyz`: database and index answer (`.ok`); a 503 is returned, not raised."""
        return self._request(b.ready())

    def rebuild_index(self, pool: str | None = None) -> dict[str, Any]:
        """Rebuild the sampling index from the database, of one pool or of all (admin)."""
        return self._request(b.rebuild_index(pool))

    # --------------------------------------------------------------------------------- pools
    def create_pool(
        self, name: str, config: s.PoolConfig | Mapping[str, Any] | None = None, description: str = ""
    ) -> s.PoolPublic:
        """Create a pool; `config` holds the ExGRPO rules (`PoolConfig` fields, defaults otherwise)."""
        return self._request(b.create_pool(name, config, description))

    def list_pools(self) -> s.PoolsPublic:
        return self._request(b.list_pools())

    def get_pool(self, name: str) -> s.PoolPublic:
        return self._request(b.get_pool(name))

    def update_pool(
        self,
        name: str,
        *,
        description: str | None = None,
        config: s.PoolConfig | Mapping[str, Any] | None = None,
    ) -> s.PoolPublic:
        """Change the description or rules. A mapping `config` changes only the keys it names
        (merged by the service); a `PoolConfig` replaces the rules. `k` and `sharing` cannot change."""
        return self._request(b.update_pool(name, description, config))

    def delete_pool(self, name: str, *, force: bool = False) -> None:
        """Delete a pool and everything in it (admin). `Conflict` while a writer holds a lease of
        one of its runs, unless `force`."""
        self._request(b.delete_pool(name, force))

    def pool_stats(self, pool: str) -> s.PoolStats:
        return self._request(b.pool_stats(pool))

    # ----------------------------------------------------------------------------- questions
    def import_questions(
        self,
        pool: str,
        questions: Iterable[QuestionLike],
        chunk_size: int = 2000,
        progress: Progress | None = None,
    ) -> s.QuestionsImported:
        """Add questions (models or dicts) in requests of `chunk_size`; returns the summed counts.

        Questions already in the pool (same prompt and ground truth) count as duplicates, so an
        interrupted import can simply be run again. `progress(done, total)` follows each chunk."""
        total = b.known_length(questions)
        result: s.QuestionsImported | None = None
        done = 0
        for chunk in b.question_chunks(questions, chunk_size):
            result = b.add_imported(result, self._request(b.import_questions(pool, chunk)))
            done += len(chunk)
            if progress is not None:
                progress(done, total)
        if result is None:
            raise ValueError("no questions to import")
        return result

    def list_questions(self, pool: str, *, after: int = 0, limit: int = 100) -> s.QuestionsPublic:
        """One page of questions with ids above `after`; `next_after` continues."""
        return self._request(b.list_questions(pool, after, limit))

    def iter_questions(self, pool: str, *, page_size: int = 500) -> Iterator[s.QuestionPublic]:
        """Every question of a pool, fetched page by page."""
        after = 0
        while True:
            page = self.list_questions(pool, after=after, limit=page_size)
            yield from page.data
            if page.next_after is None:
                return
            after = page.next_after

    def question(self, pool: str, question_id: int, payload: bool = False) -> s.QuestionDetail:
        """A question with its stored trajectories (with token ids and log-probs if `payload`)."""
        return self._request(b.question(pool, question_id, payload))

    # ---------------------------------------------------------------------------------- runs
    def create_run(
        self,
        pool: str,
        name: str,
        seed: int = 0,
        overrides: s.RunOverrides | Mapping[str, Any] | None = None,
        phase: s.Phase = "on_policy",
    ) -> s.RunPublic:
        return self._request(b.create_run(pool, name, seed, overrides, phase))

    def get_run(self, pool: str, run: str) -> s.RunPublic:
        return self._request(b.get_run(pool, run))

    def list_runs(self, pool: str) -> s.RunsPublic:
        return self._request(b.list_runs(pool))

    def update_run(
        self,
        pool: str,
        run: str,
        *,
        phase: s.Phase | None = None,
        overrides: s.RunOverrides | Mapping[str, Any] | None = None,
    ) -> s.RunPublic:
        return self._request(b.update_run(pool, run, phase, overrides))

    def delete_run(self, pool: str, run: str, *, force: bool = False) -> None:
        """Delete a run with its states, own trajectories, batches and metrics (admin). `Conflict`
        while a writer holds its lease, unless `force`."""
        self._request(b.delete_run(pool, run, force))

    def run_stats(self, pool: str, run: str) -> s.RunStats:
        return self._request(b.run_stats(pool, run))

    def add_policy_version(
        self, pool: str, run: str, version: int, uri: str, step: int = 0
    ) -> s.PolicyVersionPublic:
        return self._request(b.add_policy_version(pool, run, version, uri, step))

    def list_policy_versions(self, pool: str, run: str) -> s.PolicyVersionsPublic:
        return self._request(b.list_policy_versions(pool, run))

    def post_run_metrics(
        self, pool: str, run: str, step: int, metrics: Mapping[str, float]
    ) -> s.RunMetricsStep:
        """Merge numbers into a step of the run's curves (held-out accuracy, pool statistics)."""
        return self._request(b.post_run_metrics(pool, run, step, metrics))

    def run_metrics(
        self, pool: str, run: str, *, after_step: int = -1, limit: int = 1000
    ) -> s.RunMetricsPublic:
        return self._request(b.run_metrics(pool, run, after_step, limit))

    # ------------------------------------------------------------------------------- batches
    def plan_batch(self, pool: str, run: str, **fields: Any) -> s.BatchPlan:
        """Plan the run's next batch; `fields` are those of `BatchCreate` (batch_size,
        experience_ratio, candidates, create_tasks, replan). Planning again without `replan`
        returns the open plan."""
        return self._request(b.plan_batch(pool, run, fields))

    def get_batch(self, pool: str, batch_id: str) -> s.BatchPlan:
        return self._request(b.get_batch(pool, batch_id))

    def batch_status(self, pool: str, batch_id: str) -> s.BatchStatusPublic:
        return self._request(b.batch_status(pool, batch_id))

    def commit_batch(
        self,
        pool: str,
        batch_id: str,
        groups: Sequence[GroupLike],
        policy_version: int | None = None,
        metrics: Mapping[str, float] | None = None,
        with_stats: bool = False,
    ) -> s.CommitResult:
        """Commit the graded groups of a planned batch (one per planned question, K rollouts each).
        `with_stats=True` puts the run's stats after the commit in the result's `stats` (saves a
        `run_stats` call)."""
        return self._request(b.commit_batch(pool, batch_id, groups, policy_version, metrics, with_stats))

    def batch_results(self, pool: str, batch_id: str, wait: float = 0) -> s.BatchResults:
        """Groups completed by remote workers; waits up to `wait` seconds for all of them."""
        return self._request(b.batch_results(pool, batch_id, wait))

    def ingest(
        self,
        pool: str,
        run: str,
        groups: Sequence[GroupLike],
        policy_version: int = 0,
        step: int | None = None,
    ) -> s.CommitResult:
        """Add graded groups that were not planned by the service (off-line data)."""
        return self._request(b.ingest(pool, run, groups, policy_version, step))

    def select(
        self, pool: str, run: str, n: int, seed: int | None = None, candidates: s.CandidateMode = "all"
    ) -> s.SelectResult:
        """Draw `n` replay questions without planning a batch (nothing changes)."""
        return self._request(b.select(pool, run, n, seed, candidates))

    # ---------------------------------------------------------------------------- run leases
    def acquire_run_lease(
        self,
        pool: str,
        run: str,
        holder: str,
        *,
        ttl_s: float = 60.0,
        takeover: bool = False,
        generation: int | None = None,
    ) -> s.RunLease:
        """Take (or renew, for the same holder) the run's writer lease. `Conflict` while another
        holder's lease lives, unless `takeover`, which fences that holder out; with `generation`,
        only a renewal of that generation (`Conflict` naming who took the run since). Pass the
        answer to `use_run_lease` so this client's writes of the run carry it."""
        return self._request(b.acquire_run_lease(pool, run, holder, ttl_s, takeover, generation))

    def release_run_lease(self, pool: str, run: str, holder: str) -> None:
        """Give the run's lease up (`Conflict` if `holder` does not hold it); this client stops
        sending it."""
        self._request(b.release_run_lease(pool, run, holder))
        self._forget_lease(pool, run, holder)

    # --------------------------------------------------------------------------------- tasks
    def claim_tasks(
        self, pool: str, run: str, worker: str, max_tasks: int = 1, lease_seconds: float = 120
    ) -> s.TasksPublic:
        return self._request(b.claim_tasks(pool, run, worker, max_tasks, lease_seconds))

    def claim_pool_tasks(
        self,
        pool: str,
        worker: str,
        max_tasks: int = 1,
        lease_seconds: float = 120,
        runs: Sequence[str] | None = None,
    ) -> s.TasksPublic:
        """Tasks of any run of the pool (of `runs` if given), for a worker fleet shared by runs.
        One answer holds tasks of one run, one policy version and one sampling setting."""
        return self._request(b.claim_pool_tasks(pool, worker, max_tasks, lease_seconds, runs))

    def renew_task(
        self, pool: str, task_id: int, lease_token: str, lease_seconds: float = 120
    ) -> s.TaskPublic:
        return self._request(b.renew_task(pool, task_id, lease_token, lease_seconds))

    def complete_task(
        self,
        pool: str,
        task_id: int,
        lease_token: str,
        rollouts: Sequence[RolloutLike],
        policy_version: int | None = None,
    ) -> s.TaskPublic:
        """Hand in a task's rollouts; `policy_version`: the version they were generated with
        (`Conflict` if the task does not allow it)."""
        return self._request(b.complete_task(pool, task_id, lease_token, rollouts, policy_version))

    def fail_task(
        self, pool: str, task_id: int, lease_token: str, error: str, retry: bool = True
    ) -> s.TaskPublic:
        return self._request(b.fail_task(pool, task_id, lease_token, error, retry))

    # ------------------------------------------------------------------------ export / import
    def export_pool(
        self, pool: str, dest: PathOrFile, progress: Progress | None = None, *, binary: bool | None = None
    ) -> PoolExported:
        """Stream a pool's export to a path or an open binary file.

        `binary` (default: the client's `binary`) asks for the binary form (`exgrpo_client.exports`:
        payloads as raw buffers, no base64); False for NDJSON, which any JSON tool reads.
        `import_pool` takes either. A path is written as `<path>.partial` and renamed once the
        stream is complete. `progress(bytes, None)` follows the download. Only the request is
        retried: a stream that breaks half-way raises `TransportError`."""
        response = self._send(b.export_pool(pool, self.binary if binary is None else binary), stream=True)
        try:
            if not response.is_success:
                response.read()
                raise b.api_error(response)
            writer = ExportWriter(dest)
            try:
                for chunk in response.iter_bytes():
                    writer.feed(chunk)
                    writer.file.write(chunk)
                    if progress is not None:
                        progress(writer.num_bytes, None)
            except httpx.TransportError as e:
                writer.abort()
                raise b.transport_error(e, response.request, 1) from e
            except BaseException:
                writer.abort()
                raise
            return writer.finish()
        finally:
            response.close()

    def import_pool(
        self, src: PathOrFile, name: str | None = None, progress: Progress | None = None
    ) -> PoolImported:
        """Create a pool from an export (path or binary file), streamed; `name` renames it.

        Either form of an export (NDJSON or binary, told apart by its first byte). The service
        imports in one transaction. The upload is sent again only when it surely did not arrive
        (connection refused, 429, 503) and the source can be read again."""
        source = UploadSource(src)
        try:
            call = b.import_pool(name, source)
            attempt = 0
            while True:
                request = self._build(self._http, call, content=_chunks(source, progress))
                try:
                    response = self._http.send(request)
                except httpx.TransportError as e:
                    if not self._retry_upload(source, attempt, e):
                        raise b.transport_error(e, request, attempt + 1) from e
                    delay = self.retry_policy.delay(attempt)
                else:
                    if not self._retry_upload(source, attempt, None, response.status_code):
                        return self._finish(call, response)
                    delay = self.retry_policy.delay(attempt, response)
                source.rewind()
                time.sleep(delay)
                attempt += 1
        finally:
            source.close()


def _chunks(source: UploadSource, progress: Progress | None) -> Iterator[bytes]:
    done = 0
    while chunk := source.read():
        yield chunk
        done += len(chunk)
        if progress is not None:
            progress(done, source.total)


async def _achunks(source: UploadSource, progress: Progress | None) -> AsyncIterator[bytes]:
    done = 0
    while chunk := await asyncio.to_thread(source.read):
        yield chunk
        done += len(chunk)
        if progress is not None:
            progress(done, source.total)


class AsyncClient(BaseClient):
    """The asyncio twin of `Client`: same constructor and methods, awaited.

    async with AsyncClient() as pool:
        plan = await pool.plan_batch("math", "run-1")
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        token: str | None = None,
        timeout: float | None = 30.0,
        retries: int = 3,
        backoff: float = 0.5,
        retry_budget_s: float | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        binary: bool = True,
    ) -> None:
        super().__init__(
            base_url,
            token=token,
            timeout=timeout,
            retries=retries,
            backoff=backoff,
            retry_budget_s=retry_budget_s,
            binary=binary,
        )
        self._http = httpx.AsyncClient(transport=transport, **self._http_options())

    # ---------------------------------------------------------------------------- lifecycle
    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # ----------------------------------------------------------------------------------- I/O
    async def _send(self, call: Call[Any], *, stream: bool = False) -> httpx.Response:
        request = self._build(self._http, call)
        attempt = 0
        started = time.monotonic()
        while True:
            try:
                response = await self._http.send(request, stream=stream)
            except httpx.TransportError as e:
                delay = self._retry_delay(call, attempt, started, exc=e)
                if delay is None:
                    raise b.transport_error(e, request, attempt + 1) from e
            else:
                delay = self._retry_delay(call, attempt, started, response=response)
                if delay is None:
                    return response
                await response.aclose()
            await asyncio.sleep(delay)
            attempt += 1

    async def _request(self, call: Call[T]) -> T:
        return self._finish(call, await self._send(call))

    # ----------------------------------------------------------------------------------- ops
    async def health(self) -> Health:
        return await self._request(b.health())

    async def ready(self) -> Readiness:
        return await self._request(b.ready())

    async def rebuild_index(self, pool: str | None = None) -> dict[str, Any]:
        return await self._request(b.rebuild_index(pool))

    # --------------------------------------------------------------------------------- pools
    async def create_pool(
        self, name: str, config: s.PoolConfig | Mapping[str, Any] | None = None, description: str = ""
    ) -> s.PoolPublic:
        return await self._request(b.create_pool(name, config, description))

    async def list_pools(self) -> s.PoolsPublic:
        return await self._request(b.list_pools())

    async def get_pool(self, name: str) -> s.PoolPublic:
        return await self._request(b.get_pool(name))

    async def update_pool(
        self,
        name: str,
        *,
        description: str | None = None,
        config: s.PoolConfig | Mapping[str, Any] | None = None,
    ) -> s.PoolPublic:
        return await self._request(b.update_pool(name, description, config))

    async def delete_pool(self, name: str, *, force: bool = False) -> None:
        """Delete a pool and everything in it (admin). `Conflict` while a writer holds a lease of
        one of its runs, unless `force`."""
        await self._request(b.delete_pool(name, force))

    async def pool_stats(self, pool: str) -> s.PoolStats:
        return await self._request(b.pool_stats(pool))

    # ----------------------------------------------------------------------------- questions
    async def import_questions(
        self,
        pool: str,
        questions: Iterable[QuestionLike],
        chunk_size: int = 2000,
        progress: Progress | None = None,
    ) -> s.QuestionsImported:
        total = b.known_length(questions)
        result: s.QuestionsImported | None = None
        done = 0
        for chunk in b.question_chunks(questions, chunk_size):
            result = b.add_imported(result, await self._request(b.import_questions(pool, chunk)))
            done += len(chunk)
            if progress is not None:
                progress(done, total)
        if result is None:
            raise ValueError("no questions to import")
        return result

    async def list_questions(self, pool: str, *, after: int = 0, limit: int = 100) -> s.QuestionsPublic:
        return await self._request(b.list_questions(pool, after, limit))

    async def iter_questions(self, pool: str, *, page_size: int = 500) -> AsyncIterator[s.QuestionPublic]:
        after = 0
        while True:
            page = await self.list_questions(pool, after=after, limit=page_size)
            for q in page.data:
                yield q
            if page.next_after is None:
                return
            after = page.next_after

    async def question(self, pool: str, question_id: int, payload: bool = False) -> s.QuestionDetail:
        return await self._request(b.question(pool, question_id, payload))

    # ---------------------------------------------------------------------------------- runs
    async def create_run(
        self,
        pool: str,
        name: str,
        seed: int = 0,
        overrides: s.RunOverrides | Mapping[str, Any] | None = None,
        phase: s.Phase = "on_policy",
    ) -> s.RunPublic:
        return await self._request(b.create_run(pool, name, seed, overrides, phase))

    async def get_run(self, pool: str, run: str) -> s.RunPublic:
        return await self._request(b.get_run(pool, run))

    async def list_runs(self, pool: str) -> s.RunsPublic:
        return await self._request(b.list_runs(pool))

    async def update_run(
        self,
        pool: str,
        run: str,
        *,
        phase: s.Phase | None = None,
        overrides: s.RunOverrides | Mapping[str, Any] | None = None,
    ) -> s.RunPublic:
        return await self._request(b.update_run(pool, run, phase, overrides))

    async def delete_run(self, pool: str, run: str, *, force: bool = False) -> None:
        """Delete a run with its states, own trajectories, batches and metrics (admin). `Conflict`
        while a writer holds its lease, unless `force`."""
        await self._request(b.delete_run(pool, run, force))

    async def run_stats(self, pool: str, run: str) -> s.RunStats:
        return await self._request(b.run_stats(pool, run))

    async def add_policy_version(
        self, pool: str, run: str, version: int, uri: str, step: int = 0
    ) -> s.PolicyVersionPublic:
        return await self._request(b.add_policy_version(pool, run, version, uri, step))

    async def list_policy_versions(self, pool: str, run: str) -> s.PolicyVersionsPublic:
        return await self._request(b.list_policy_versions(pool, run))

    async def post_run_metrics(
        self, pool: str, run: str, step: int, metrics: Mapping[str, float]
    ) -> s.RunMetricsStep:
        """Merge numbers into a step of the run's curves (held-out accuracy, pool statistics)."""
        return await self._request(b.post_run_metrics(pool, run, step, metrics))

    async def run_metrics(
        self, pool: str, run: str, *, after_step: int = -1, limit: int = 1000
    ) -> s.RunMetricsPublic:
        return await self._request(b.run_metrics(pool, run, after_step, limit))

    # ------------------------------------------------------------------------------- batches
    async def plan_batch(self, pool: str, run: str, **fields: Any) -> s.BatchPlan:
        return await self._request(b.plan_batch(pool, run, fields))

    async def get_batch(self, pool: str, batch_id: str) -> s.BatchPlan:
        return await self._request(b.get_batch(pool, batch_id))

    async def batch_status(self, pool: str, batch_id: str) -> s.BatchStatusPublic:
        return await self._request(b.batch_status(pool, batch_id))

    async def commit_batch(
        self,
        pool: str,
        batch_id: str,
        groups: Sequence[GroupLike],
        policy_version: int | None = None,
        metrics: Mapping[str, float] | None = None,
        with_stats: bool = False,
    ) -> s.CommitResult:
        return await self._request(
            b.commit_batch(pool, batch_id, groups, policy_version, metrics, with_stats)
        )

    async def batch_results(self, pool: str, batch_id: str, wait: float = 0) -> s.BatchResults:
        return await self._request(b.batch_results(pool, batch_id, wait))

    async def ingest(
        self,
        pool: str,
        run: str,
        groups: Sequence[GroupLike],
        policy_version: int = 0,
        step: int | None = None,
    ) -> s.CommitResult:
        return await self._request(b.ingest(pool, run, groups, policy_version, step))

    async def select(
        self, pool: str, run: str, n: int, seed: int | None = None, candidates: s.CandidateMode = "all"
    ) -> s.SelectResult:
        return await self._request(b.select(pool, run, n, seed, candidates))

    # ---------------------------------------------------------------------------- run leases
    async def acquire_run_lease(
        self,
        pool: str,
        run: str,
        holder: str,
        *,
        ttl_s: float = 60.0,
        takeover: bool = False,
        generation: int | None = None,
    ) -> s.RunLease:
        """Take (or renew, for the same holder) the run's writer lease. `Conflict` while another
        holder's lease lives, unless `takeover`, which fences that holder out; with `generation`,
        only a renewal of that generation (`Conflict` naming who took the run since). Pass the
        answer to `use_run_lease` so this client's writes of the run carry it."""
        return await self._request(b.acquire_run_lease(pool, run, holder, ttl_s, takeover, generation))

    async def release_run_lease(self, pool: str, run: str, holder: str) -> None:
        """Give the run's lease up (`Conflict` if `holder` does not hold it); this client stops
        sending it."""
        await self._request(b.release_run_lease(pool, run, holder))
        self._forget_lease(pool, run, holder)

    # --------------------------------------------------------------------------------- tasks
    async def claim_tasks(
        self, pool: str, run: str, worker: str, max_tasks: int = 1, lease_seconds: float = 120
    ) -> s.TasksPublic:
        return await self._request(b.claim_tasks(pool, run, worker, max_tasks, lease_seconds))

    async def claim_pool_tasks(
        self,
        pool: str,
        worker: str,
        max_tasks: int = 1,
        lease_seconds: float = 120,
        runs: Sequence[str] | None = None,
    ) -> s.TasksPublic:
        """Tasks of any run of the pool (of `runs` if given), for a worker fleet shared by runs.
        One answer holds tasks of one run, one policy version and one sampling setting."""
        return await self._request(b.claim_pool_tasks(pool, worker, max_tasks, lease_seconds, runs))

    async def renew_task(
        self, pool: str, task_id: int, lease_token: str, lease_seconds: float = 120
    ) -> s.TaskPublic:
        return await self._request(b.renew_task(pool, task_id, lease_token, lease_seconds))

    async def complete_task(
        self,
        pool: str,
        task_id: int,
        lease_token: str,
        rollouts: Sequence[RolloutLike],
        policy_version: int | None = None,
    ) -> s.TaskPublic:
        """Hand in a task's rollouts; `policy_version`: the version they were generated with
        (`Conflict` if the task does not allow it)."""
        return await self._request(b.complete_task(pool, task_id, lease_token, rollouts, policy_version))

    async def fail_task(
        self, pool: str, task_id: int, lease_token: str, error: str, retry: bool = True
    ) -> s.TaskPublic:
        return await self._request(b.fail_task(pool, task_id, lease_token, error, retry))

    # ------------------------------------------------------------------------ export / import
    async def export_pool(
        self, pool: str, dest: PathOrFile, progress: Progress | None = None, *, binary: bool | None = None
    ) -> PoolExported:
        response = await self._send(
            b.export_pool(pool, self.binary if binary is None else binary), stream=True
        )
        try:
            if not response.is_success:
                await response.aread()
                raise b.api_error(response)
            writer = await asyncio.to_thread(ExportWriter, dest)
            try:
                async for chunk in response.aiter_bytes():
                    writer.feed(chunk)
                    await asyncio.to_thread(writer.file.write, chunk)
                    if progress is not None:
                        progress(writer.num_bytes, None)
            except httpx.TransportError as e:
                await asyncio.to_thread(writer.abort)
                raise b.transport_error(e, response.request, 1) from e
            except BaseException:
                await asyncio.to_thread(writer.abort)
                raise
            return await asyncio.to_thread(writer.finish)
        finally:
            await response.aclose()

    async def import_pool(
        self, src: PathOrFile, name: str | None = None, progress: Progress | None = None
    ) -> PoolImported:
        source = await asyncio.to_thread(UploadSource, src)
        try:
            call = await asyncio.to_thread(b.import_pool, name, source)
            attempt = 0
            while True:
                request = self._build(self._http, call, content=_achunks(source, progress))
                try:
                    response = await self._http.send(request)
                except httpx.TransportError as e:
                    if not self._retry_upload(source, attempt, e):
                        raise b.transport_error(e, request, attempt + 1) from e
                    delay = self.retry_policy.delay(attempt)
                else:
                    if not self._retry_upload(source, attempt, None, response.status_code):
                        return self._finish(call, response)
                    delay = self.retry_policy.delay(attempt, response)
                source.rewind()
                await asyncio.sleep(delay)
                attempt += 1
        finally:
            source.close()
