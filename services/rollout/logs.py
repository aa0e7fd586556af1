"""Structured logs of the rollout worker: one JSON object per line.

    log.info("task_completed", extra={"fields": {"task": 12, "reward_mean": 0.25}})

gives ``{"ts": "...", "level": "info", "logger": "exgrpo_rollout.worker", "event": "task_completed",
"task": 12, "reward_mean": 0.25}``. Records from other libraries (no ``fields``) keep their message
as ``event``; exceptions are added as ``error``.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

__all__ = ["JsonFormatter", "configure_json_logging", "fields"]

_RESERVED = ("ts", "level", "logger", "event")


def fields(**values: Any) -> dict[str, Any]:
    """`extra=` argument carrying structured fields: ``log.info("ev", extra=fields(a=1))``."""
    return {"fields": values}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            for key, value in extra.items():
                doc[f"field_{key}" if key in _RESERVED else key] = value
        if record.exc_info:
            doc["error"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str, ensure_ascii=False)


def configure_json_logging(level: int | str = logging.INFO, stream: TextIO | None = None) -> None:
    """Send every record of the process as JSON lines to `stream` (stderr by default)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("httpx", "httpcore", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
