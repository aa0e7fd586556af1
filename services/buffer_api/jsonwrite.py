"""JSON written from plain values (dicts, lists, strings, numbers) with orjson, as pydantic-core
writes it.

The answers the service builds as plain values instead of models (a page of questions, a plan or a
selection in JSON: `service.convert.Answer`) were written by `pydantic_core.to_json`, which infers
each value's type as it goes: ~26 us for a page of 50 questions and ~1.2 ms for a selection of 64
questions with ~4 MB of base64 payloads, against ~5 us and ~0.14 ms with orjson. orjson writes the
same bytes for every plain JSON value (`tests/unit/test_json_write.py`); what it would write
otherwise or not at all (integers past 64 bits, datetimes, bytes, subclasses of str or int,
non-string keys) it refuses, and those go to pydantic-core. Non-finite floats are `null` either
way, as the answers' models write them (pydantic-core alone writes `NaN` for a plain value). JSON
text kept as a database gave it (`orjson.Fragment`: a page's prompts and metadata on Postgres) is
written as it is; it goes only where every other value is plain (pydantic-core cannot write one)."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic_core import to_json

# types orjson would write in its own way go to `default`, which has none: orjson raises
_ONLY_PLAIN = (
    orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_SUBCLASS | orjson.OPT_PASSTHROUGH_DATACLASS
)


def dumps(value: Any) -> bytes:
    """`value` as JSON text (UTF-8, no spaces), as `pydantic_core.to_json(value,
    inf_nan_mode="null")` writes it."""
    try:
        return orjson.dumps(value, option=_ONLY_PLAIN)
    except TypeError:
        return to_json(value, inf_nan_mode="null")
