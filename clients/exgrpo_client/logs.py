"""The one log format of every process of the stack: the pool service (`exgrpo serve`), the rollout
workers (`exgrpo rollout`), the trainer (`exgrpo train`, `python -m exgrpo_trainer`) and the
one-box main job (`exgrpo run`).

Two renderings of the same record, chosen by `--log-format` or ``EXGRPO_LOG_FORMAT``:

    json   {"ts": "2026-12-01T17:08:12.123+00:00", "level": "info", "logger": "exgrpo_rollout.worker",
            "event": "task_completed", "task": 12, "reward_mean": 0.25}
    plain  2026-12-01T17:08:12.123+00:00 INFO exgrpo_rollout.worker: task_completed task=12 reward_mean=0.25

Structured fields travel with a record as ``log.info("task_completed", extra=fields(task=12))``; a
field named like one of the fixed keys (ts, level, logger, event, error) is written as
``field_<name>``. An exception is added as ``error`` (its traceback). Records of other libraries
(uvicorn, httpx, warnings) take the same path, their message as ``event``.

Progress bars belong on a terminal only: `configure_logging` turns the tqdm bars of transformers
and huggingface_hub off when stderr is not a terminal or the format is json, and
`progress_allowed()` tells the trainer whether it may draw its own.

Standard library only: every package of the repository imports it.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TextIO

__all__ = [
    "LOG_FORMATS",
    "LOG_FORMAT_ENV",
    "JsonFormatter",
    "LogFormat",
    "LogLines",
    "PlainFormatter",
    "configure_logging",
    "configured_format",
    "fields",
    "file_handler",
    "make_formatter",
    "progress_allowed",
    "quiet_progress_bars",
    "resolve_format",
]

LogFormat = Literal["json", "plain"]
LOG_FORMATS: tuple[LogFormat, ...] = ("json", "plain")
LOG_FORMAT_ENV = "EXGRPO_LOG_FORMAT"
RESERVED = ("ts", "level", "logger", "event", "error")
QUIET_LIBRARIES = ("httpx", "httpcore", "urllib3")
"""Loggers that say one line per HTTP request at INFO: kept at WARNING."""

_configured: LogFormat | None = None


def fields(**values: Any) -> dict[str, Any]:
    """`extra=` argument carrying structured fields: ``log.info("ev", extra=fields(a=1))``."""
    return {"fields": values}


def _record_fields(record: logging.LogRecord, static: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    extra = getattr(record, "fields", None)
    for key, value in (*static.items(), *(extra.items() if isinstance(extra, dict) else ())):
        out[f"field_{key}" if key in RESERVED else key] = value
    return out


def _timestamp(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def __init__(self, static: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.static = dict(static or {})

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
            **_record_fields(record, self.static),
        }
        if record.exc_info:
            doc["error"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["error"] = record.exc_text
        return json.dumps(doc, default=str, ensure_ascii=False)


def _plain_value(value: Any) -> str:
    if isinstance(value, str) and value and not any(c in value for c in ' "=\n\t'):
        return value
    return json.dumps(value, default=str, ensure_ascii=False, separators=(",", ":"))


class PlainFormatter(logging.Formatter):
    """``ts LEVEL logger: event key=value ...``: the fields of the json rendering, for people.
    Values with spaces or quotes are written as JSON; a traceback follows on its own lines."""

    def __init__(self, static: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.static = dict(static or {})

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname} {record.name}: {record.getMessage()}"
        extra = _record_fields(record, self.static)
        if extra:
            line += " " + " ".join(f"{k}={_plain_value(v)}" for k, v in extra.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def make_formatter(fmt: LogFormat, static: Mapping[str, Any] | None = None) -> logging.Formatter:
    """The formatter of `fmt`; `static` fields are added to every record (e.g. a trainer's rank)."""
    return JsonFormatter(static) if fmt == "json" else PlainFormatter(static)


def resolve_format(flag: str | None, default: LogFormat) -> LogFormat:
    """The format a process logs in: the flag, else ``EXGRPO_LOG_FORMAT``, else `default`.
    Anything but json or plain raises `ValueError` naming the choices."""
    value = flag if flag is not None else os.environ.get(LOG_FORMAT_ENV) or default
    value = value.strip().lower()
    if value not in LOG_FORMATS:
        source = "--log-format" if flag is not None else LOG_FORMAT_ENV
        raise ValueError(f"{source} must be json or plain, got {value!r}")
    return value


class _StderrHandler(logging.StreamHandler[TextIO]):
    """Writes to the `sys.stderr` of the moment (a test runner or a wrapper may swap it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:  # called under the handler's lock
        self.stream = sys.stderr
        super().emit(record)


def configure_logging(
    fmt: LogFormat,
    level: int | str = logging.INFO,
    *,
    stream: TextIO | None = None,
    static: Mapping[str, Any] | None = None,
) -> logging.Handler:
    """Send every record of the process to `stream` (stderr by default) in format `fmt`; returns
    the handler. Replaces the root logger's handlers, routes uvicorn's loggers and Python warnings
    through the root, and keeps progress bars off unless stderr is a terminal and `fmt` is plain."""
    global _configured
    handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    handler.setFormatter(make_formatter(fmt, static))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    # loggers that kept handlers of their own from an earlier configuration write through the root
    for name in ("uvicorn", "uvicorn.error", "exgrpo"):
        own = logging.getLogger(name)
        own.handlers.clear()
        own.propagate = True
        own.disabled = False  # a dictConfig run earlier in the process may have disabled it
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(logging.WARNING)
    # off, then on: warnings go to the log even if something replaced showwarning since a first call
    logging.captureWarnings(False)
    logging.captureWarnings(True)
    _configured = fmt
    if not progress_allowed():
        quiet_progress_bars()
    return handler


def configured_format() -> LogFormat | None:
    """The format `configure_logging` set up in this process; None when it was not called."""
    return _configured


class LogLines(io.TextIOBase):
    """A text stream whose every line becomes an INFO record of `logger`: what a program prints for
    people (a rich console's lines) joins its log in json format."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger = logger
        self._partial = ""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        *lines, self._partial = (self._partial + s).split("\n")
        for line in lines:
            if line.strip():
                self.logger.info(line.rstrip())
        return len(s)

    def flush(self) -> None:
        if self._partial.strip():
            self.logger.info(self._partial.rstrip())
        self._partial = ""


def file_handler(path: Path, fmt: LogFormat, level: int = logging.INFO) -> logging.Handler:
    """A handler appending records to `path` in format `fmt` (add it to a logger yourself)."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(make_formatter(fmt))
    handler.setLevel(level)
    return handler


def progress_allowed(stream: TextIO | None = None) -> bool:
    """Whether a progress bar may be drawn: `stream` (stderr) is a terminal and the log format is
    not json (a bar between JSON lines breaks them)."""
    out = stream or sys.stderr
    try:
        tty = out.isatty()
    except (AttributeError, ValueError):  # a closed or odd stream
        tty = False
    return tty and _configured != "json"


def quiet_progress_bars() -> None:
    """Turn off the tqdm progress bars of huggingface_hub, transformers and tqdm itself, in this
    process and the processes it starts (by their environment variables)."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["TQDM_DISABLE"] = "1"
    hub = sys.modules.get("huggingface_hub.utils")
    if hub is not None:
        hub.disable_progress_bars()
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:
        hf_logging.disable_progress_bar()
