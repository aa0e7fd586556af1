"""A SQLite JSON column read by a driver statement (`repo._result_processor`) gives what
SQLAlchemy's own result processor gives on the service's engine, value for value: the objects of
JSON texts (NaN, big integers and a text only `json.loads` takes included), SQL NULL, and a number
as SQLite's JSON functions answer it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from sqlalchemy import JSON

from exgrpo_pool.store import repo
from exgrpo_pool.store.db import Database

VALUES: list[Any] = [
    None,
    '{"a": [1, 2.5, "x"], "b": null}',
    '[{"role": "user", "content": "What is 2+2?"}]',
    '"just a string"',
    "123456789012345678901234567890",
    '{"n": NaN, "i": Infinity}',
    '"\\ud800"',  # a lone surrogate: only json.loads reads it
    b'{"bytes": true}',
    7,
    2.5,
]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


async def test_a_json_column_reads_as_sqlalchemy_reads_it(tmp_path: Path) -> None:
    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}", sqlite_inline=True)
    try:
        for engine in (db.engine, db.hot_engine):
            assert engine is not None
            async with engine.connect() as conn:
                column = repo._question_t.c.prompt
                assert isinstance(column.type, JSON)
                ours = repo._result_processor(conn, column)
                theirs = column.type.dialect_impl(conn.dialect).result_processor(conn.dialect, None)
                assert ours is not None and theirs is not None
                for value in VALUES:
                    assert _same(ours(value), theirs(value)), value
    finally:
        await db.close()
