"""Where the service's CPU goes against the floor's, sampled: `pool_bench.py --floor` runs, and
py-spy samples the service process and the floor process side by side while they do the same
work (plan, commit, select, ingest, interleaved). Each busy sample is put in one part by the
innermost frame of its stack that a rule below names, and the table compares the parts.

Unlike `pool_profile.py` (cProfile, which inflates every Python call and so the code with more
calls most), sampling costs both processes alike. Samples of a thread that is waiting (the event
loop's poll, a pool worker's queue) are left out. A C function is counted to the Python frame
that called it (py-spy without --native): SHA-256 inside the floor's commit is counted as the
floor's own Python, the service's in `commit_digest` as hashing.

The samples are taken by the wall clock, and a thread that waits for a CPU counts as busy: on a
machine of two CPUs the service's digest thread, running beside its event loop, makes the loop's
own statements look longer than the floor's same ones (up to twice, for the same inserts). Read the
table for where each side's time goes; compare the two sides' totals with `pool_bench.py`'s CPU
counters.

Needs `py-spy` on PATH (not a dependency of the project: `pip install py-spy`), and the right to
read the processes' memory (root, or ptrace allowed). The seeded pool comes from `pool_bench.py`.

    .venv/bin/python bench/pool_sample.py --backend sqlite --size 10000 --seconds 75
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pool_bench as pb

OUT = pb.OUT / "sample"

#: (part, pattern of a frame "function (path:line)"); the innermost frame that matches one names
#: the sample's part, the first rule that matches that frame wins
RULES: list[tuple[str, str]] = [
    (
        "the database (SQLite's own work, the driver)",
        r"InlineCursor\.|InlineConnection\.|sqlite_inline\.py|pg_direct\.py|SqliteDb\.|PgDb\.|sqlite3|"
        r"PreparedStatement\.|asyncpg/|_WorkItem\.run|to_thread",
    ),
    ("hashing (request, commit digest, dedup keys)", r"request_hash|commit_digest|trajectory_key"),
    ("frames: encode and decode", r"frames\.py|Wire\.prepare|Answer\.frame|Wire\.respond"),
    (
        "body validation (pydantic)",
        r"_validated|TypeAdapter|Incoming\._checked|_with_rules_kept|request_body_to_args|ModelField",
    ),
    ("Redis", r"redis/"),
    ("SQLAlchemy (statements, results, its async layer)", r"sqlalchemy/|greenlet"),
    ("HTTP (uvicorn: read, send)", r"httptools_impl|Response\.__call__|Request\.body"),
    (
        "framework and middleware (FastAPI, Starlette, the service's ASGI layers, metrics)",
        r"fastapi/|starlette/|admission\.py|(buffer_api|exgrpo_pool)/app\.py|_serve\.py|api/deps\.py|"
        r"api/wire\.py|metrics\.py|prometheus",
    ),
    (
        "their own Python (the service's or the floor's logic)",
        r"buffer_api/|exgrpo_pool/|exgrpo_client/|_floor\.py|numpy",
    ),
]
REST = "the rest (asyncio, the standard library)"
#: innermost functions of a thread that waits
IDLE = {"_worker", "Runner.run", "_connection_worker_thread", "Thread.run"}


def _function(frame: str) -> str:
    return re.sub(r" \(.*\)$", "", frame)


def parts(path: Path) -> tuple[collections.Counter[str], int]:
    """Busy samples per part of one py-spy raw file (`frame;frame;... count` per line)."""
    rules = [(name, re.compile(rx)) for name, rx in RULES]
    out: collections.Counter[str] = collections.Counter()
    busy = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not stack or _function(frames[-1]) in IDLE:
            continue
        n = int(count)
        busy += n
        part = next(
            (name for f in reversed(frames) for name, rx in rules if rx.search(f)),
            REST,
        )
        out[part] += n
    return out, busy


def table(service: Path, floor: Path) -> str:
    s, sb = parts(service)
    f, fb = parts(floor)
    lines = [
        f"busy samples: service {sb}, floor {fb} (ratio {sb / max(fb, 1):.2f})",
        "",
        "| part | service | floor | service - floor, in the floor's total |",
        "|---|---:|---:|---:|",
    ]
    for name in sorted(set(s) | set(f), key=lambda k: -(s[k] - f[k])):
        lines.append(f"| {name} | {s[name]} | {f[name]} | {(s[name] - f[name]) / max(fb, 1):+.1%} |")
    return "\n".join(lines)


def _children(pid: int) -> dict[int, str]:
    """Descendant processes of `pid` and their command lines."""
    parent: dict[int, int] = {}
    cmd: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, todo = {}, [pid]
    while todo:
        p = todo.pop()
        for child, pp in parent.items():
            if pp == p:
                found[child] = cmd.get(child, "")
                todo.append(child)
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("sqlite", "postgres"), default="sqlite")
    ap.add_argument("--size", type=int, default=10_000)
    ap.add_argument("--seconds", type=int, default=75, help="how long py-spy samples")
    ap.add_argument("--rate", type=int, default=250, help="samples per second")
    ap.add_argument("--iterations", type=int, default=100, help="plan+commit steps per side")
    ap.add_argument("--ingest-requests", type=int, default=100)
    ap.add_argument("--service-src", type=Path, help="as pool_bench.py --service-src")
    ap.add_argument("--tag", default="tree", help="names the output files (bench/out/sample/*-TAG.txt)")
    ap.add_argument("--table", nargs=2, type=Path, metavar=("SERVICE_RAW", "FLOOR_RAW"), help="print only")
    opts = ap.parse_args(argv)
    if opts.table:
        print(table(*opts.table))
        return 0
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("py-spy is not on PATH (pip install py-spy): it samples the two processes")
    OUT.mkdir(parents=True, exist_ok=True)
    name = f"{opts.backend}-{opts.tag}"
    log = OUT / f"pool_bench-{name}.log"
    command = [
        sys.executable, str(Path(__file__).resolve().parent / "pool_bench.py"), "--floor",
        "--backends", opts.backend, "--sizes", str(opts.size), "--encodings", "binary",
        "--iterations", str(opts.iterations), "--select-iterations", str(opts.iterations),
        "--ingest-requests", str(opts.ingest_requests), "--unrelated-keys", "0",
        "--out", str(OUT / f"pool_bench-{name}.json"),
    ]  # fmt: skip
    if opts.service_src is not None:
        command += ["--service-src", str(opts.service_src)]
    with open(log, "wb") as logf:
        bench = subprocess.Popen(command, stdout=logf, stderr=subprocess.STDOUT)
    try:
        while b"measuring" not in log.read_bytes():
            if bench.poll() is not None:
                raise SystemExit(f"pool_bench.py ended before measuring; see {log}")
            time.sleep(0.5)
        time.sleep(3)  # past the first requests
        kids = _children(bench.pid)
        pids = {
            side: next((p for p, c in kids.items() if script in c), None)
            for side, script in (("service", "_serve.py"), ("floor", "_floor.py"))
        }
        if None in pids.values():
            raise SystemExit(f"did not find both processes among {kids}")
        spies = {
            side: subprocess.Popen(
                [
                    spy,
                    "record",
                    "-r",
                    str(opts.rate),
                    "-d",
                    str(opts.seconds),
                    "-p",
                    str(pid),
                    "-f",
                    "raw",
                    "-o",
                    str(OUT / f"{side}-{name}.txt"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for side, pid in pids.items()
        }
        for p in spies.values():
            p.wait()
        if bench.wait() != 0:
            raise SystemExit(f"pool_bench.py failed; see {log}")
    finally:
        if bench.poll() is None:
            bench.terminate()
            bench.wait()
    print(table(OUT / f"service-{name}.txt", OUT / f"floor-{name}.txt"))
    print()
    print("\n".join(line for line in log.read_text().splitlines() if line.startswith("|")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
