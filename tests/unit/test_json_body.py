"""A JSON body of a commit or an ingest is parsed by pydantic-core's parser where it gives what
`json.loads` (FastAPI's parser) gives, value for value and type for type; every body it refuses
or reads otherwise is left to `json.loads`, so its answer (and its error) is what it was."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from exgrpo_pool.api.wire import UNPARSED, json_body

BODIES = [
    b'{"groups": [{"question_id": 3, "rollouts": [{"reward": 1.0, "token_ids": [1, 2]}]}]}',
    b'{"a": 1, "a": 2}',  # duplicate keys: the last one
    b"[NaN, Infinity, -Infinity]",  # accepted by json.loads, refused later by the models
    b"[123456789012345678901234567890, -0, 0]",
    b"[1e400, -1e400, 5e-324, 1.7976931348623157e308, 0.1, -0.0, 1E2, 1.0, 10000000000000000000000.5]",
    b'["\\ud83d\\ude00", "\\u0000", "\\/", "\xc3\xa9"]',
    b'  {"x": [1, 2.5, true, false, null]}  ',
    b'["\\ud800"]',  # a lone surrogate: json.loads takes it
    b'\xef\xbb\xbf{"a": 1}',  # a UTF-8 byte order mark: json.loads skips it
    '{"a": "é"}'.encode("utf-16"),  # json.loads reads UTF-16 and UTF-32 too
    b"[" * 300 + b"]" * 300,  # deeper than pydantic-core's parser goes
    b'{"a": 1,}',
    b"[1 2]",
    b"01",
    b'"\x01"',
    b'{"a": 1}x',
    b'["\xff"]',
    b"",
]


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


@pytest.mark.parametrize("raw", BODIES)
def test_a_body_is_parsed_as_json_loads_parses_it_or_left_to_it(raw: bytes) -> None:
    parsed = json_body(raw)
    try:
        expected = json.loads(raw)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError: FastAPI's own answer stays
        assert parsed is UNPARSED
        return
    assert parsed is UNPARSED or _same(parsed, expected), (parsed, expected)


def test_the_bodies_of_the_hot_routes_are_parsed() -> None:
    body = {"groups": [{"question_id": q, "rollouts": [{"reward": 0.0}] * 8} for q in range(64)]}
    raw = json.dumps(body).encode()
    parsed = json_body(raw)
    assert parsed is not UNPARSED and _same(parsed, body)
