"""What validating a commit body costs: `BatchCommit.model_validate(body)` of the pool benchmark's
commit (128 groups x 8 rollouts, every rollout with ~1k tokens, 512-1536), as the service's request
handling runs it, in the encodings a commit arrives in:

* ``json+b64``: the JSON wire (payloads as base64 strings, what the SDK sends);
* ``frame``: a binary frame's body (no payload fields: the payloads travel as raw buffers);
* ``json lists``: payloads as JSON lists of numbers (what curl users send);
* ``json lists, 3.0 ids``: the same with one token id per rollout written as an integral float.

`--against FILE` also validates with another copy of `exgrpo_client/schemas.py` (for example
the one of an earlier commit: `git show REV:clients/exgrpo_client/schemas.py > bench/out/schemas_rev.py`),
the two taking turns on every repeat, so both see the same machine load.

    .venv/bin/python bench/validate_bench.py [--repeat 30] [--against FILE]

It prints the median CPU milliseconds per body (and microseconds per rollout), with, for scale,
the floor: pydantic-core alone validating the same groups, no Python validator and no rule.
"""

from __future__ import annotations

import argparse
import base64
import copy
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from pydantic import TypeAdapter

from exgrpo_client import schemas

GROUPS, K = 128, 8


def _schemas_at(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("schemas_against", Path(path))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the models' annotations through it
    spec.loader.exec_module(module)
    return module


def commit_bodies(rng: np.random.Generator) -> dict[str, dict[str, Any]]:
    """One commit in each encoding of the table."""
    b64_groups, frame_groups, list_groups = [], [], []
    for q in range(GROUPS):
        b64_rows, frame_rows, list_rows = [], [], []
        for i in range(K):
            n = int(rng.integers(512, 1537))
            ids = rng.integers(0, 151_000, n).astype("<i4")
            lps = (-rng.exponential(0.6, n)).astype("<f4")
            row = {"reward": float(i % 2), "entropy": 0.5, "replayed": False, "finish_reason": "stop"}
            frame_rows.append(row)
            b64_rows.append(
                {
                    **row,
                    "token_ids_b64": base64.b64encode(ids.tobytes()).decode(),
                    "logprobs_b64": base64.b64encode(lps.tobytes()).decode(),
                }
            )
            list_rows.append({**row, "token_ids": ids.tolist(), "logprobs": lps.astype(float).tolist()})
        for groups, rows in ((b64_groups, b64_rows), (frame_groups, frame_rows), (list_groups, list_rows)):
            groups.append({"question_id": q + 1, "rollouts": rows})
    floats = copy.deepcopy(list_groups)
    for g in floats:
        for r in g["rollouts"]:
            r["token_ids"][-1] = float(r["token_ids"][-1])
    metrics = {"train/loss": 0.1}
    return {
        "json+b64": {"groups": b64_groups, "metrics": metrics},
        "frame": {"groups": frame_groups, "metrics": metrics},
        "json lists": {"groups": list_groups, "metrics": metrics},
        "json lists, 3.0 ids": {"groups": floats, "metrics": metrics},
    }


def _medians_ms(fns: list[Callable[[], Any]], repeat: int) -> list[float]:
    """The median CPU time of each function (this thread's: a shared machine's other work, which
    takes the CPU away from it, is not counted), the functions taking turns."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, out in zip(fns, times, strict=True):
            t0 = time.thread_time()
            fn()
            out.append((time.thread_time() - t0) * 1000)
    return [statistics.median(t) for t in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--against", help="a copy of exgrpo_client/schemas.py to compare with")
    args = ap.parse_args()
    versions: list[tuple[str, ModuleType]] = [("this", schemas)]
    if args.against:
        versions.append((Path(args.against).name, _schemas_at(args.against)))
    # the floor: pydantic-core alone, the groups as a list of this version's GroupResult (whose
    # core schema has no Python validator), without the commit's rules
    floor = TypeAdapter(list[schemas.GroupResult])
    bodies = commit_bodies(np.random.default_rng(0))
    n = GROUPS * K
    print(f"BatchCommit.model_validate, {GROUPS} groups x {K} rollouts: median CPU ms (us per rollout)")
    print("| body | " + " | ".join(name for name, _ in versions) + " | compiled floor |")
    print("|---|" + "---:|" * (len(versions) + 1))
    for body_name, body in bodies.items():
        for _, s in versions:
            assert len(s.BatchCommit.model_validate(body).groups) == GROUPS  # a valid body
        fns = [lambda s=s, body=body: s.BatchCommit.model_validate(body) for _, s in versions]
        fns.append(lambda body=body: floor.validate_python(body["groups"]))
        if "3.0" in body_name:
            fns.pop()  # the floor refuses the floats
        cells = [f"{ms:.2f} ({ms * 1000 / n:.2f})" for ms in _medians_ms(fns, args.repeat)]
        cells += ["-"] * (len(versions) + 1 - len(cells))
        print(f"| {body_name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
