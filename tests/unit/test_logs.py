"""exgrpo_client.logs, the one log format of the stack: the json and plain renderings carry the same
fields, the format comes from the flag, then EXGRPO_LOG_FORMAT, then the command's default, and the
process's other loggers (uvicorn, warnings) and printed display lines go through it."""

from __future__ import annotations

import io
import json
import logging
import sys
import warnings
from collections.abc import Iterator

import pytest

from exgrpo_client import logs


@pytest.fixture
def restore_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """configure_logging changes process state: put the root logger, warnings capture, the
    progress-bar variables and the module's record of the format back afterwards."""
    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"):
        monkeypatch.setenv(name, "1")  # monkeypatch restores what was there
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    configured = logs.configured_format()
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)
    monkeypatch.setattr(logs, "_configured", configured)


def _record(**fields: object) -> logging.LogRecord:
    return logging.makeLogRecord(
        {"name": "exgrpo.test", "levelno": logging.INFO, "levelname": "INFO", "msg": "task %s", "args": (7,)}
        | ({"fields": fields} if fields else {})
    )


def test_json_and_plain_carry_the_same_fields() -> None:
    record = _record(task=7, note="two words", ids=[1, 2], level="x")
    doc = json.loads(logs.JsonFormatter().format(record))
    assert doc == {
        "ts": doc["ts"],
        "level": "info",
        "logger": "exgrpo.test",
        "event": "task 7",
        "task": 7,
        "note": "two words",
        "ids": [1, 2],
        "field_level": "x",  # a field may not replace a fixed key
    }
    assert doc["ts"].endswith("+00:00") and "T" in doc["ts"]
    line = logs.PlainFormatter().format(record)
    assert line == f'{doc["ts"]} INFO exgrpo.test: task 7 task=7 note="two words" ids=[1,2] field_level=x'


def test_static_fields_and_errors() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = logging.makeLogRecord({"msg": "failed", "exc_info": sys.exc_info()})
    doc = json.loads(logs.make_formatter("json", {"rank": 1}).format(record))
    assert doc["rank"] == 1 and "RuntimeError: boom" in doc["error"] and "\n" not in json.dumps(doc)
    plain = logs.make_formatter("plain", {"rank": 1}).format(record)
    assert plain.splitlines()[0].endswith("failed rank=1") and "RuntimeError: boom" in plain


def test_the_flag_wins_then_the_environment_then_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(logs.LOG_FORMAT_ENV, raising=False)
    assert logs.resolve_format(None, "plain") == "plain"
    monkeypatch.setenv(logs.LOG_FORMAT_ENV, "JSON")
    assert logs.resolve_format(None, "plain") == "json"
    assert logs.resolve_format("plain", "json") == "plain"
    with pytest.raises(ValueError, match="EXGRPO_LOG_FORMAT must be json or plain, got 'xml'"):
        monkeypatch.setenv(logs.LOG_FORMAT_ENV, "xml")
        logs.resolve_format(None, "plain")
    with pytest.raises(ValueError, match="--log-format"):
        logs.resolve_format("yaml", "plain")


@pytest.mark.usefixtures("restore_logging")
def test_every_logger_of_the_process_goes_through_the_format(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TQDM_DISABLE")
    uvicorn = logging.getLogger("uvicorn.error")
    monkeypatch.setattr(uvicorn, "handlers", [logging.StreamHandler(io.StringIO())])
    monkeypatch.setattr(uvicorn, "propagate", False)  # as uvicorn's own configuration leaves it
    # servers started earlier in this test process set uvicorn's levels (log_level="warning")
    for name in ("uvicorn.error", "py.warnings"):
        other = logging.getLogger(name)
        monkeypatch.setattr(other, "disabled", False)
        monkeypatch.setattr(other, "level", logging.NOTSET)
    logging.getLogger().manager._clear_cache()  # levels were set behind the loggers' caches
    stream = io.StringIO()
    logs.configure_logging("json", "INFO", stream=stream)
    assert logs.configured_format() == "json"
    uvicorn.info("Uvicorn running on %s", "http://127.0.0.1:1")
    logging.getLogger("httpx").info("HTTP Request: GET /")  # kept at WARNING
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # the suite turns warnings into errors
        warnings.warn("old API", UserWarning, stacklevel=1)
    logging.getLogger("exgrpo.run").info("step", extra=logs.fields(step=3))
    # other threads of the test process (a live server) or the garbage collector (ResourceWarning)
    # may log meanwhile: only the records of this test are looked at
    ours = ("uvicorn.error", "httpx", "exgrpo.run")
    lines = [
        doc
        for doc in map(json.loads, stream.getvalue().splitlines())
        if doc["logger"] in ours or (doc["logger"] == "py.warnings" and "old API" in doc["event"])
    ]
    assert [d["logger"] for d in lines] == ["uvicorn.error", "py.warnings", "exgrpo.run"]
    assert lines[0]["event"] == "Uvicorn running on http://127.0.0.1:1" and lines[0]["level"] == "info"
    assert "UserWarning: old API" in lines[1]["event"] and lines[1]["level"] == "warning"
    assert lines[2] == {**lines[2], "event": "step", "step": 3}
    # stderr here is not a terminal: no progress bars, in this process and its children
    assert not logs.progress_allowed() and logs.os.environ["TQDM_DISABLE"] == "1"


@pytest.mark.usefixtures("restore_logging")
def test_progress_only_on_a_terminal_and_never_in_json() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    logs.configure_logging("plain", stream=io.StringIO())
    assert logs.progress_allowed(Terminal()) and not logs.progress_allowed(io.StringIO())
    logs.configure_logging("json", stream=io.StringIO())
    assert not logs.progress_allowed(Terminal())


@pytest.mark.usefixtures("restore_logging")
def test_printed_lines_become_records() -> None:
    stream = io.StringIO()
    logs.configure_logging("json", stream=stream)
    out = logs.LogLines(logging.getLogger("exgrpo.run"))
    out.write("run folder: /x\nsettings: K = 8")
    out.write(", B = 16\n\n")
    out.write("tail without newline")
    out.flush()
    events = [json.loads(line)["event"] for line in stream.getvalue().splitlines()]
    assert events == ["run folder: /x", "settings: K = 8, B = 16", "tail without newline"]
