"""What each step replayed, for the late-run analysis of the one-box job: which questions, from which
bucket and level, how often each had been replayed before, and how stale the replayed trajectory was.

The trainer's metrics say how much was replayed and the importance weights of the replayed tokens;
they do not say which trajectory was replayed. The job's SDK client sees both ends of every step: the
plan (each replayed question with its bucket and its stored trajectories, each with the step it was
collected at) and the commit (each replayed group names the trajectory used as its row 0). The
`RecordingClient` keeps those per step, and `StepDiagnostics.on_step` writes one line per step to
`diagnostics.jsonl` in the run folder:

    replay/questions        replayed questions this step
    replay/bucket_<k>       ... of them drawn from bucket k
    replay/level_<n>        ... of them of difficulty level n (data source ``*_d<n>``)
    replay/age_mean, replay/age_max
                            staleness of the replayed trajectories: this step minus the step the
                            trajectory was collected at (the policy is updated every step in the
                            one-box job, so this is the number of policy versions behind, at least 1)
    replay/candidates_mean  stored trajectories the trainer chose among
    replay/times_mean       how many times the replayed questions have been replayed so far, this
                            step included (1: first replay)
    replay/distinct         distinct questions replayed so far in the run
    replay/total            replays so far in the run

`replay_count_histogram` gives the distribution of replays per question at the end of a run.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exgrpo_client import Client
from exgrpo_client import schemas as s

__all__ = ["RecordingClient", "Replay", "StepDiagnostics", "replay_count_histogram"]

_LEVEL = re.compile(r"_d(\d+)$")


@dataclass(frozen=True)
class Replay:
    """One replayed question of one step."""

    step: int
    question_id: int
    bucket: int
    level: int | None
    """Difficulty level from the data source (``*_d<n>``), if it names one."""
    age: int | None
    """The step minus the collection step of the trajectory replayed (None: not among the plan's
    candidates, which does not happen with this trainer)."""
    candidates: int


def _field(group: Any, name: str) -> Any:
    return group.get(name) if isinstance(group, Mapping) else getattr(group, name, None)


class RecordingClient(Client):
    """The SDK client, keeping what each committed step replayed (`replays`, in commit order)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replays: list[Replay] = []
        self._plans: dict[str, s.BatchPlan] = {}

    def plan_batch(self, pool: str, run: str, **fields: Any) -> s.BatchPlan:
        plan = super().plan_batch(pool, run, **fields)
        self._plans[plan.id] = plan
        return plan

    def commit_batch(
        self,
        pool: str,
        batch_id: str,
        groups: Sequence[Any],
        policy_version: int | None = None,
        metrics: Mapping[str, float] | None = None,
        with_stats: bool = False,
    ) -> s.CommitResult:
        result = super().commit_batch(pool, batch_id, groups, policy_version, metrics, with_stats)
        plan = self._plans.pop(batch_id, None)
        if plan is not None:
            self.replays.extend(replays_of(plan, groups))
        return result


def replays_of(plan: s.BatchPlan, groups: Sequence[Any]) -> list[Replay]:
    """The replays of a committed plan: one per group that names its replayed trajectory."""
    items = {item.question_id: item for item in plan.replay}
    out = []
    for group in groups:
        trajectory_id = _field(group, "replay_trajectory_id")
        item = items.get(int(_field(group, "question_id")))
        if trajectory_id is None or item is None:
            continue
        chosen = next((c for c in item.candidates if c.id == trajectory_id), None)
        match = _LEVEL.search(item.data_source)
        out.append(
            Replay(
                step=plan.step,
                question_id=item.question_id,
                bucket=item.bucket,
                level=int(match.group(1)) if match else None,
                age=None if chosen is None else plan.step - chosen.step,
                candidates=len(item.candidates),
            )
        )
    return out


@dataclass
class StepDiagnostics:
    """Per-step replay diagnostics of a run, appended to `path` (one JSON line per step)."""

    client: RecordingClient
    path: Path
    _seen: int = 0
    _times: Counter[int] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.path.write_text("")

    def on_step(self, step: int) -> dict[str, float]:
        """The diagnostics of the replays committed since the last call, as step `step`'s line."""
        new = self.client.replays[self._seen :]
        self._seen = len(self.client.replays)
        line: dict[str, float] = {"step": float(step), "replay/questions": float(len(new))}
        times = []
        for r in new:
            self._times[r.question_id] += 1
            times.append(self._times[r.question_id])
            line[f"replay/bucket_{r.bucket}"] = line.get(f"replay/bucket_{r.bucket}", 0.0) + 1
            if r.level is not None:
                line[f"replay/level_{r.level}"] = line.get(f"replay/level_{r.level}", 0.0) + 1
        ages = [r.age for r in new if r.age is not None]
        if ages:
            line["replay/age_mean"] = sum(ages) / len(ages)
            line["replay/age_max"] = float(max(ages))
        if new:
            line["replay/candidates_mean"] = sum(r.candidates for r in new) / len(new)
            line["replay/times_mean"] = sum(times) / len(times)
        line["replay/distinct"] = float(len(self._times))
        line["replay/total"] = float(sum(self._times.values()))
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        return line


def replay_count_histogram(replays: Sequence[Replay]) -> dict[int, int]:
    """How many questions were replayed n times, per n (questions never replayed left out)."""
    per_question = Counter(r.question_id for r in replays)
    return dict(sorted(Counter(per_question.values()).items()))
