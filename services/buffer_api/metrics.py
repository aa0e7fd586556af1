"""Prometheus metrics of the pool service (one registry per app, so tests can build many apps).

With several service processes (`exgrpo serve --workers N`) each process writes its values to
files in PROMETHEUS_MULTIPROC_DIR (prometheus_client's multiprocess mode, chosen when the variable
is set before prometheus_client is imported), and `/metrics`, whichever process answers it, reads
those of every process: counters and histograms are summed. The gauges made by `snapshot` are
snapshots of the database (set from counts read after a write, at start-up, or by `/metrics`
itself just before it answers), so the value of the process that set it last is the current one:
`mostrecent`. Not `max` (counts also go down: retirements, deletions), not `liveall` (one series
per process, most of them stale), not a `live` mode (a stopped process's last snapshot stays true
until a newer one). The one gauge of a process's own state, the requests waiting for their turn,
is summed over the live processes (`livesum`).
"""

from __future__ import annotations

from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector

SNAPSHOT: Literal["mostrecent"] = "mostrecent"
"""Multiprocess mode of the database's snapshots (the module's docstring says why); ignored in one
process."""


def snapshot(name: str, doc: str, labels: tuple[str, ...], registry: CollectorRegistry) -> Gauge:
    """A gauge of a count read from the database (multiprocess mode `SNAPSHOT`)."""
    return Gauge(name, doc, labels, registry=registry, multiprocess_mode=SNAPSHOT)


def multiprocess() -> bool:
    """prometheus_client writes values to files shared by the processes (decided at its import)."""
    return values.ValueClass is not values.MutexValue


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
        self.requests_waiting = Gauge(
            "exgrpo_http_requests_waiting",
            "Requests waiting for their turn (max_active_requests are worked on at once).",
            registry=r,
            multiprocess_mode="livesum",
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
        self.pool_questions = snapshot("exgrpo_pool_questions", "Questions in a pool.", ("pool",), r)
        self.pool_trajectories = snapshot("exgrpo_pool_trajectories", "Trajectories in a pool.", ("pool",), r)
        self.run_eligible = snapshot("exgrpo_run_eligible", "Replay-eligible questions.", ("pool", "run"), r)
        self.run_retired = snapshot("exgrpo_run_retired", "Retired questions.", ("pool", "run"), r)
        #: (eligible, retired) gauges of a (pool, run), as `labels()` gives them once (`run_gauges`)
        self._run_gauges: dict[tuple[str, str], tuple[Gauge, Gauge]] = {}
        self.run_solved = snapshot(
            "exgrpo_run_solved_fraction", "Solved fraction of the last committed batch.", ("pool", "run"), r
        )
        self.task_queue_depth = snapshot("exgrpo_task_queue_depth", "Pending generation tasks.", (), r)
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
        self.grouped_writes = Histogram(
            "exgrpo_db_grouped_writes",
            "Writes committed in one transaction together (a run's ingests that waited for its "
            "previous one; Postgres).",
            registry=r,
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256),
        )

    def run_gauges(self, pool: str, run: str) -> tuple[Gauge, Gauge]:
        """The run's eligible and retired gauges, each stats read sets (`labels()` takes a lock
        and builds its key on every call: ~2 us a gauge of a ~0.1 ms read)."""
        found = self._run_gauges.get((pool, run))
        if found is None:
            found = self._run_gauges[(pool, run)] = (
                self.run_eligible.labels(pool, run),
                self.run_retired.labels(pool, run),
            )
        return found

    def exposition(self) -> bytes:
        """The text `/metrics` answers: this app's registry, or in multiprocess mode the values
        every process of the service wrote."""
        if not multiprocess():
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return generate_latest(registry)
