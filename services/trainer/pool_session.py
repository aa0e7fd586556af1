"""The trainer's session with its run on the pool service: attach, plan, commit, publish, metrics.

Rank 0 holds the HTTP client; every method is called on every rank and returns the same value on
all of them (rank 0 asks, the answer is broadcast; an error of rank 0 is raised on every rank).
Retries follow the SDK client's retry policy: writes carry idempotency keys, so a retried plan or
commit is applied once; a commit refused because its batch is already committed is reconciled by
reading the batch's status (the pool's result wins, nothing is guessed). The session owns the run
while it is attached: it holds the run's writer lease (`ownership.RunLeaseKeeper`), which every
write carries.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from exgrpo_client import Client
from exgrpo_client import schemas as s
from exgrpo_client.errors import Conflict, NotFound
from exgrpo_trainer import dist
from exgrpo_trainer.config import RunSection
from exgrpo_trainer.ownership import RunLeaseKeeper, RunOwnershipError, new_holder_id
from exgrpo_trainer.telemetry import RunMetricsSender

log = logging.getLogger("exgrpo.trainer")


@dataclass(frozen=True)
class RunState:
    step: int
    """Steps the pool has committed for the run."""
    policy_version: int
    """The run's latest published policy version."""
    created_at: datetime
    """When the service created the run (with the names, it tells runs of the same name apart)."""


@dataclass(frozen=True)
class _Failed:
    """Rank 0's error, sent to the other ranks in place of an answer."""

    message: str
    ownership: bool


class PoolSession:
    def __init__(
        self,
        run: RunSection,
        rules: s.RunOverrides,
        *,
        client: Client | None = None,
        send_metrics: bool = True,
    ) -> None:
        """`rules` are the run's batch-level rules (from the trainer's experience section); a
        `client` passed in stays open for its owner, else rank 0 opens one on `run.pool_url` that
        retries each call for up to `run.retry_budget_s` (a pool restart of minutes is ridden
        through)."""
        self.run = run
        self.rules = rules
        self.send_metrics = send_metrics
        self._owns_client = client is None
        self.client = (
            client
            if client is not None
            else (
                Client(run.pool_url, token=run.token, retry_budget_s=run.retry_budget_s)
                if dist.is_main()
                else None
            )
        )
        self._sender: RunMetricsSender | None = None
        self._held: tuple[int, dict[str, float]] | None = None
        """The last step's late metrics, handed to the sender once the next plan is in: posted at
        the end of their step, they would queue at the service ahead of that plan."""
        self.holder = new_holder_id()
        """Who this trainer is to the service: the holder id of its run's writer lease."""
        self.keeper: RunLeaseKeeper | None = None
        """Rank 0, once attached: the run's writer lease."""

    def _main(self) -> Client:
        assert self.client is not None, "only rank 0 talks to the pool"
        return self.client

    def _on_main(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """`fn`'s answer on rank 0, on every rank; rank 0's error is raised on every rank (as a
        `RunOwnershipError` when it is one), so no rank waits for an answer that never comes."""
        if not dist.active():
            return fn(*args, **kwargs)
        answer: Any = None
        error: BaseException | None = None
        if dist.is_main():
            try:
                answer = fn(*args, **kwargs)
            except Exception as e:
                error, answer = e, _Failed(str(e), isinstance(e, RunOwnershipError))
        answer = dist.broadcast(answer)
        if error is not None:
            raise error
        if isinstance(answer, _Failed):
            if answer.ownership:
                raise RunOwnershipError(answer.message)
            raise RuntimeError(f"rank 0 failed: {answer.message}")
        return answer

    def _write(self, fn: Any) -> Any:
        """A write of the run under its lease (rank 0): refused at once when the lease is lost;
        a write refused with 409 because the lease had expired and was taken again is repeated
        once; `RunOwnershipError` when another trainer took the run over."""
        keeper = self.keeper
        if keeper is not None:
            keeper.raise_if_lost()
        try:
            return fn()
        except Conflict as refused:
            if keeper is None or not keeper.check(refused):
                raise
        return fn()

    # ------------------------------------------------------------------------------ the run
    def attach(self) -> RunState:
        """The run's state on the pool, creating the run with this trainer's rules if missing, and
        its writer lease (`RunOwnershipError` when another trainer owns the run)."""
        state: RunState = self._on_main(self._attach)
        return state

    def _attach(self) -> RunState:
        client, cfg = self._main(), self.run
        try:
            run = client.get_run(cfg.pool, cfg.name)
        except NotFound:
            try:
                run = client.create_run(cfg.pool, cfg.name, seed=cfg.seed, overrides=self.rules)
                log.info("created run %s in pool %s", cfg.name, cfg.pool)
            except Conflict:  # another trainer created it first: the lease decides who writes
                run = client.get_run(cfg.pool, cfg.name)
        else:
            if run.overrides != self.rules or run.seed != cfg.seed:
                log.warning(
                    "run %s already exists with seed %d and %s; the service keeps those, not this "
                    "config's run.seed / experience settings (%s)",
                    cfg.name,
                    run.seed,
                    run.overrides,
                    self.rules,
                )
        if self.keeper is not None and self.keeper.lease is not None:
            # attached before (e.g. `attach()`, then `train()`): the same lease, renewed
            self.keeper.raise_if_lost()
            self.keeper.renew()
            self.keeper.raise_if_lost()
        else:
            self.keeper = RunLeaseKeeper(
                client,
                cfg.pool,
                cfg.name,
                holder=self.holder,
                ttl_s=cfg.lease_ttl_s,
                takeover=cfg.takeover,
                wait_s=cfg.lease_wait_s,
            )
            self.keeper.acquire()
        run = client.get_run(cfg.pool, cfg.name)  # as its owner left it
        return RunState(step=run.step, policy_version=run.policy_version, created_at=run.created_at)

    def plan(
        self,
        *,
        create_tasks: bool,
        policy_version: int | None = None,
        min_policy_version: int | None = None,
        sampling: s.SamplingParams | None = None,
    ) -> s.BatchPlan:
        """The next batch (every replayed question with all its candidates, for rescoring); then the
        previous step's late metrics go out in the background. With `create_tasks`, its generation
        tasks are generated with `policy_version` (exactly, or any published version from
        `min_policy_version` on) and `sampling`. An open batch (planned before a restart) comes back
        as it was planned."""
        plan: s.BatchPlan = self._on_main(
            self._write,
            lambda: self._main().plan_batch(
                self.run.pool,
                self.run.name,
                candidates="all",
                create_tasks=create_tasks,
                policy_version=policy_version,
                min_policy_version=min_policy_version,
                sampling=sampling,
            ),
        )
        self._release_late_metrics()
        return plan

    def commit(
        self, plan: s.BatchPlan, groups: list[s.GroupResult], policy_version: int, metrics: dict[str, float]
    ) -> s.CommitResult:
        """Commit the step's groups (collection rules apply on the service, in one transaction); the
        answer carries the run's stats after the commit."""
        sent = {k: v for k, v in metrics.items() if math.isfinite(v)} if self.send_metrics else {}

        def send() -> s.CommitResult:
            client = self._main()
            try:
                return client.commit_batch(
                    self.run.pool,
                    plan.id,
                    groups,
                    policy_version=policy_version,
                    metrics=sent,
                    with_stats=True,
                )
            except Conflict:
                status = client.batch_status(self.run.pool, plan.id)
                if status.status != "committed" or status.result is None:
                    raise  # refused for another reason (the run's lease, a re-planned batch)
                # committed already (an earlier attempt whose answer was lost): the pool's result
                log.warning(
                    "batch %s (step %d) was already committed: using the pool's result of that commit",
                    plan.id,
                    status.step,
                )
                return status.result

        result: s.CommitResult = self._on_main(self._write, send)
        return result

    def publish(self, version: int, uri: str, step: int) -> str:
        """Register a policy version (weights already written where `uri` points); the uri the run
        has for it: `uri`, or the one an earlier trainer of the run registered for that version
        (a version keeps its first uri)."""

        def send() -> str:
            client = self._main()
            try:
                return client.add_policy_version(
                    self.run.pool, self.run.name, version=version, uri=uri, step=step
                ).uri
            except Conflict as refused:
                if "already has policy version" not in str(refused):
                    raise  # the run's lease
                known = client.list_policy_versions(self.run.pool, self.run.name).data
                return next(v.uri for v in known if v.version == version)

        registered: str = self._on_main(self._write, send)
        return registered

    # -------------------------------------------------------------------- remote generation
    def batch_results(self, batch_id: str, wait: float) -> s.BatchResults:
        """Rank 0 only: the completed generation tasks of a batch (long poll up to `wait` s)."""
        return self._main().batch_results(self.run.pool, batch_id, wait=wait)

    def failed_tasks(self, batch_id: str) -> int:
        """Rank 0 only: the batch's generation tasks that failed for good."""
        return self._main().batch_status(self.run.pool, batch_id).tasks_failed

    # ------------------------------------------------------------------------------ metrics
    def experience_metrics(self, plan: s.BatchPlan, result: s.CommitResult) -> dict[str, float]:
        """Rank 0: the step's `experience/*` metrics from the run's stats after its commit (from the
        commit's answer, or asked for when it has none); other ranks get {}."""
        if not dist.is_main():
            return {}
        st = result.stats or self._main().run_stats(self.run.pool, self.run.name)
        out = {
            "experience/eligible": float(st.eligible),
            "experience/retired": float(st.retired),
            "experience/seen": float(st.seen),
            "experience/trajectories": float(st.trajectories),
            "experience/replay_share": len(plan.replay) / max(1, len(plan.replay) + len(plan.fresh)),
        }
        for b in st.buckets:
            out[f"experience/bucket_{b.bucket}"] = float(b.questions)
        return out

    def hold_late_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Metrics known only after the commit (pool stats, timings), posted to the run in the
        background after the next plan (rank 0; a no-op when metrics are not sent)."""
        if dist.is_main() and self.send_metrics:
            self._held = (step, metrics)

    def _release_late_metrics(self) -> None:
        if self._held is not None:
            if self._sender is None:
                self._sender = RunMetricsSender(self._main(), self.run.pool, self.run.name)
            self._sender.send(*self._held)  # posted in the background, in step order
            self._held = None

    def flush(self) -> None:
        """Post what is held and queued, and stop the sender thread (a later step starts a new one).
        Nothing more is posted once the run's lease is lost."""
        if self.keeper is not None and self.keeper.lost is not None:
            self._held = None
        self._release_late_metrics()
        if self._sender is not None:
            sender, self._sender = self._sender, None
            sender.close()

    def close(self) -> None:
        """Post what is left, give the run's lease back, close an own client."""
        self.flush()  # before the client it posts with
        if self.keeper is not None:
            keeper, self.keeper = self.keeper, None
            keeper.close()
        if self.client is not None and self._owns_client:
            self.client.close()
