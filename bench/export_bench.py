"""Pool export and import, NDJSON against the binary form, on the seeded SQLite pools.

For each size it copies the cached seeded database (``bench/out/cache/sqlite-<N>.db``, written by
``pool_bench.py``; see ``_seed.py`` for the shape: ~5 trajectories of ~1k tokens per eligible
question, 10% of N eligible), starts the real service on the copy (``_serve.py``, as
``pool_bench.py`` does), and times with the SDK, once per form:

* export: ``GET /v1/pools/bench/export`` streamed to a file (``Client.export_pool``);
* import: that file streamed to ``POST /v1/pools/import?name=...`` (``Client.import_pool``), one
  transaction; the imported pool is deleted afterwards.

    .venv/bin/python bench/export_bench.py [--sizes 10000 100000] [--repeat 1]

It prints seconds, MB and MB/s per operation (the median of --repeat runs) and writes
``bench/out/export_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _seed
from pool_bench import CACHE, OUT, log, start_server

from exgrpo_client import Client

FORMS = ("ndjson", "binary")


def measure(url: str, size: int, repeat: int, work: Path) -> list[dict[str, Any]]:
    rows = []
    with Client(url, timeout=None, retries=0) as client:
        for form in FORMS:
            path = work / f"export-{size}.{'ndjson' if form == 'ndjson' else 'exgrpo'}"
            times: dict[str, list[float]] = {"export": [], "import": []}
            for i in range(repeat):
                t0 = time.perf_counter()
                exported = client.export_pool(_seed.POOL_NAME, path, binary=form == "binary")
                times["export"].append(time.perf_counter() - t0)
                name = f"copy-{form}-{i}"
                t0 = time.perf_counter()
                imported = client.import_pool(path, name)
                times["import"].append(time.perf_counter() - t0)
                assert imported.trajectories == exported.header.num_trajectories, imported
                client.delete_pool(name, force=True)
            mb = path.stat().st_size / 1e6
            for op, ts in times.items():
                sec = statistics.median(ts)
                rows.append(
                    {
                        "questions": size,
                        "trajectories": exported.header.num_trajectories,
                        "form": form,
                        "op": op,
                        "seconds": round(sec, 2),
                        "mb": round(mb, 1),
                        "mb_per_s": round(mb / sec, 1),
                    }
                )
                log(f"  {size} {form} {op}: {sec:.2f} s, {mb:.1f} MB, {mb / sec:.1f} MB/s")
            path.unlink()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--repeat", type=int, default=1)
    opts = parser.parse_args()
    work = OUT / "work"
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for size in opts.sizes:
        seed_file = CACHE / f"sqlite-{size}.db"
        shape = _seed.Shape(questions=size)
        if not _seed.sqlite_cache_ok(shape, seed_file):
            log(f"seeding sqlite {size} (not cached)")
            _seed.seed_sqlite(shape, seed_file, log)
        work_file = work / f"export-sqlite-{size}.db"
        _seed.copy_sqlite(seed_file, work_file)
        env = {"EXGRPO_DATABASE_URL": f"sqlite+aiosqlite:///{work_file}"}
        server = start_server(env, OUT / "logs" / f"export-{size}.log", None)
        try:
            rows += measure(server.url, size, opts.repeat, work)
        finally:
            server.stop()
            for p in (work_file, Path(f"{work_file}-wal"), Path(f"{work_file}-shm")):
                p.unlink(missing_ok=True)
    (OUT / "export_bench.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{'questions':>9} {'trajectories':>12} {'form':>6} {'op':>6} {'seconds':>8} {'MB':>8} {'MB/s':>7}")
    for r in rows:
        print(
            f"{r['questions']:>9} {r['trajectories']:>12} {r['form']:>6} {r['op']:>6} "
            f"{r['seconds']:>8.2f} {r['mb']:>8.1f} {r['mb_per_s']:>7.1f}"
        )


if __name__ == "__main__":
    main()
