"""Prometheus metrics of the pool service (one registry per app, so tests can build many apps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.request_seconds = Histogram(
            "exgrpo_http_request_seconds",
            "HTTP request latency by route template.",
            ["method", "route", "status"],
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.trajectories_ingested = Counter(
            "exgrpo_trajectories_ingested_total",
            "Trajectories stored (after de-duplication).",
            ["pool"],
            registry=r,
        )
        self.trajectories_duplicate = Counter(
            "exgrpo_trajectories_duplicate_total",
            "Correct rollouts dropped as duplicates.",
            ["pool"],
            registry=r,
        )
        self.questions_imported = Counter(
            "exgrpo_questions_imported_total", "Questions inserted.", ["pool"], registry=r
        )
        self.replay_picks = Counter(
            "exgrpo_replay_picks_total", "Questions selected for replay.", ["pool"], registry=r
        )
        self.retired = Counter("exgrpo_questions_retired_total", "Retirements.", ["pool"], registry=r)
        self.batches_planned = Counter(
            "exgrpo_batches_planned_total", "Batches planned.", ["pool"], registry=r
        )
        self.batches_committed = Counter(
            "exgrpo_batches_committed_total", "Batches committed.", ["pool"], registry=r
        )
        self.pool_questions = Gauge("exgrpo_pool_questions", "Questions in a pool.", ["pool"], registry=r)
        self.pool_trajectories = Gauge(
            "exgrpo_pool_trajectories", "Trajectories in a pool.", ["pool"], registry=r
        )
        self.run_eligible = Gauge(
            "exgrpo_run_eligible", "Replay-eligible questions.", ["pool", "run"], registry=r
        )
        self.run_retired = Gauge("exgrpo_run_retired", "Retired questions.", ["pool", "run"], registry=r)
        self.run_solved = Gauge(
            "exgrpo_run_solved_fraction",
            "Solved fraction of the last committed batch.",
            ["pool", "run"],
            registry=r,
        )
        self.task_queue_depth = Gauge("exgrpo_task_queue_depth", "Pending generation tasks.", registry=r)
        self.lease_expiries = Counter(
            "exgrpo_task_lease_expiries_total", "Tasks taken over after their lease ran out.", registry=r
        )
        self.tasks_completed = Counter("exgrpo_tasks_completed_total", "Tasks completed.", registry=r)
        self.tasks_failed = Counter("exgrpo_tasks_failed_total", "Task failures reported.", registry=r)
        self.tasks_claimed = Counter(
            "exgrpo_tasks_claimed_total",
            "Tasks handed to workers, by run and by claim (one run's, or the pool-wide claim).",
            ["pool", "run", "claim"],
            registry=r,
        )
        self.task_version_refusals = Counter(
            "exgrpo_task_version_refusals_total",
            "Completions refused because their rollouts came from a policy version the task does not allow.",
            registry=r,
        )
        self.index_rebuilds = Counter("exgrpo_index_rebuilds_total", "Index rebuilds.", registry=r)
