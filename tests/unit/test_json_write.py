"""The JSON the service writes from plain values (a page of questions, a plan or a selection in
JSON) by `jsonwrite.dumps`: byte for byte what pydantic-core writes for the same values with
non-finite floats as `null` (as the answers' models write them), for every value, including those
the faster writer leaves to pydantic-core (integers past 64 bits, datetimes, bytes, subclasses,
non-string keys), and the same error where pydantic-core refuses a value (a lone surrogate)."""

from __future__ import annotations

import datetime as dt
import enum
import math
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic_core import PydanticSerializationError, to_json

from exgrpo_pool import jsonwrite


def _reference(value: Any) -> bytes:
    return to_json(value, inf_nan_mode="null")


class Colour(enum.Enum):
    RED = "red"


class Name(str):
    pass


class Count(int):
    pass


VALUES: list[Any] = [
    {"data": [], "count": 0, "next_after": None},
    {"a": [1, 2.5, "x", True, False, None], "b": {"c": []}},
    [0.0, -0.0, 1e16, 1e-7, 1e21, 1e22, 5e-324, 1.7976931348623157e308, 0.1, 1 / 3, 1.5e300],
    [math.nan, math.inf, -math.inf],
    [2**63 - 1, -(2**63), 2**64 - 1],  # the edges of what the faster writer takes
    [2**64, -(2**63) - 1, 2**70, {"big": 123456789012345678901234567890}],
    ["é😀", "\u2028\u2029", "\x00\x1f\x7f", '\\"/', "</script>", ""],
    {"when": dt.datetime(2026, 12, 6, 16, 0, tzinfo=dt.UTC), "day": dt.date(2026, 12, 6)},
    {"naive": dt.datetime(2026, 12, 6, 16, 0, 0, 123456)},
    {"raw": b"bytes", "id": uuid.UUID(int=7), "colour": Colour.RED},
    {"sub": Name("x"), "n": Count(3)},
    {1: "int key", 2.5: "float key"},
    ("a", ("b", 1)),
]


@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
def test_the_same_bytes_as_pydantic_core(value: Any) -> None:
    assert jsonwrite.dumps(value) == _reference(value)


def test_a_lone_surrogate_is_refused_as_pydantic_core_refuses_it() -> None:
    for value in ("\ud800", {"k": ["ok", "\udfff"]}):
        with pytest.raises(PydanticSerializationError):
            _reference(value)
        with pytest.raises(PydanticSerializationError):
            jsonwrite.dumps(value)


_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(alphabet=st.characters(exclude_categories=("Cs",)))
)
_json_like = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=40,
)


@settings(max_examples=400, deadline=None)
@given(_json_like)
def test_any_json_value(value: Any) -> None:
    assert jsonwrite.dumps(value) == _reference(value)
