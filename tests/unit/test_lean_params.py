"""`LeanRoute` reads a lean route's path, query and header parameters with what FastAPI's
`request_params_to_args` works out from their fields computed once (`lean._read_params`): for
every parameter of every lean route, over present, missing, repeated, empty and malformed values,
the values and the errors are FastAPI's own, in the same order."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Annotated, Any

import pytest
from fastapi import Header, Query
from fastapi.dependencies.utils import get_dependant, request_params_to_args
from pydantic import AliasChoices, Json
from starlette.datastructures import Headers, QueryParams

from exgrpo_pool.api import lean
from exgrpo_pool.app import create_app
from exgrpo_pool.config import Settings

#: values a parameter may be sent: names good and bad, numbers in and out of range, junk
VALUES = ["p1", "r1", "0", "1", "50", "-1", "1001", "2" * 20, "1.5", "abc", "bad name", "", "x" * 70, "true"]


def _steps(step: Any) -> list[Any]:
    return [step, *(s for sub in step.subs for s in _steps(sub))]


def _readers(tmp_path: Path) -> list[tuple[str, int, list[Any], tuple[Any, ...] | None]]:
    settings = Settings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}", allow_anonymous=True)
    app = create_app(settings)
    found = []
    for route in app.router.routes:
        if getattr(route, "path", None) in set(lean.lean_routes(app.router.routes)):
            for step in _steps(lean.compile_route(route)):
                for source, fields, read in step.readers:
                    found.append((route.path, source, list(fields), read))
    return found


def _received(source: int, pairs: list[tuple[str, str]]) -> Any:
    if source == lean._PATH:
        return dict(pairs)
    if source == lean._QUERY:
        return QueryParams(pairs)
    return Headers(raw=[(k.encode("latin-1"), v.encode()) for k, v in pairs])


def _comparable(errors: list[Any]) -> list[Any]:
    return [{k: repr(v) for k, v in e.items()} for e in errors]


def _compare(source: int, fields: Any, read: tuple[Any, ...], cases: list[list[tuple[str, str]]]) -> int:
    """Each case read both ways: the same values and errors. The number of cases compared."""
    for pairs in cases:
        received = _received(source, pairs)
        want_values, want_errors = request_params_to_args(fields, received)
        got_values, got_errors = lean._read_params(read, received)
        assert got_values == want_values, pairs
        assert _comparable(got_errors) == _comparable(want_errors), pairs
    return len(cases)


def test_every_lean_parameter_takes_the_compiled_reader(tmp_path: Path) -> None:
    readers = _readers(tmp_path)
    kinds = {(path, source) for path, source, _, _ in readers}
    # the page's query, every route's path, the write routes' headers (a lease, an idempotency key)
    assert ("/v1/pools/{pool}/questions", lean._QUERY) in kinds
    assert any(source == lean._HEADER for _, source, _, _ in readers)
    assert len({path for path, _, _, _ in readers}) == 6
    assert all(read is not None for _, _, _, read in readers)


@pytest.mark.parametrize("repeat", [1, 2])
def test_the_compiled_reader_reads_as_fastapi_reads(tmp_path: Path, repeat: int) -> None:
    compared = 0
    for _path, source, fields, read in _readers(tmp_path):
        assert read is not None
        keys = [key for p in read for key in p.keys]
        # every key missing, or sent once (or twice, the query and headers) with each value
        cases: list[list[tuple[str, str]]] = [[]]
        for key in keys:
            for values in itertools.product(VALUES, repeat=repeat if source != lean._PATH else 1):
                cases.append([(key, v) for v in values])
        # all keys at once, each with a value of the list in turn
        for i in range(len(VALUES)):
            cases.append([(key, VALUES[(i + j) % len(VALUES)]) for j, key in enumerate(keys)])
        compared += _compare(source, fields, read, cases)
    assert compared >= 400 * repeat


def test_a_fastapi_without_the_readers_functions_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _path, _source, fields, _read = _readers(tmp_path)[0]
    monkeypatch.delattr(lean.fastapi_utils, "_get_param_aliases")
    assert lean._param_reader(fields) is None


async def _kinds_of_parameter(
    ids: Annotated[list[int] | None, Query()] = None,
    tags: Annotated[list[str], Query(alias="tag")] = ["a"],  # noqa: B006  # FastAPI copies a default
    either: Annotated[int | None, Query(validation_alias=AliasChoices("either", "or_else"))] = None,
    blob: Annotated[Json[list[int]] | None, Query()] = None,
    needed: Annotated[int, Query(ge=1)] = ...,  # type: ignore[assignment]  # required
    x_many: Annotated[list[str] | None, Header()] = None,
    x_one: Annotated[str | None, Header(alias="x-one")] = None,
) -> None:
    return None


@pytest.mark.parametrize("source", [lean._QUERY, lean._HEADER])
def test_lists_aliases_and_json_parameters_read_as_fastapi_reads(source: int) -> None:
    """Kinds of parameter no lean route has yet (lists, aliases, alias choices, JSON, required)."""
    d = get_dependant(path="/x", call=_kinds_of_parameter)
    fields = d.query_params if source == lean._QUERY else d.header_params
    read = lean._param_reader(fields)
    assert read is not None
    keys = sorted({key for p in read for key in p.keys} | {"x_many", "x-many", "other"})
    values = ["1", "2", "-3", "abc", "", "[1, 2]", "[", "null"]
    cases: list[list[tuple[str, str]]] = [[]]
    for key in keys:
        cases += [[(key, v)] for v in values]
        cases += [[(key, v), (key, w)] for v, w in itertools.product(values, repeat=2)]
    for a, b in itertools.combinations(keys, 2):
        cases += [[(a, "1"), (b, "2")], [(b, "[3]"), (a, "")]]
    assert _compare(source, fields, read, cases) == len(cases)
