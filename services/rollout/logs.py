"""Logs of the rollout worker: the stack's one log format, `exgrpo_client.logs` (json or plain).

    log.info("task_completed", extra=fields(task=12, reward_mean=0.25))

gives ``{"ts": "...", "level": "info", "logger": "exgrpo_rollout.worker", "event": "task_completed",
"task": 12, "reward_mean": 0.25}`` in json. This module keeps the names the worker and its tests
import.
"""

from __future__ import annotations

import logging
from typing import TextIO

from exgrpo_client.logs import JsonFormatter, configure_logging, fields

__all__ = ["JsonFormatter", "configure_json_logging", "fields"]


def configure_json_logging(level: int | str = logging.INFO, stream: TextIO | None = None) -> None:
    """Send every record of the process as JSON lines to `stream` (stderr by default)."""
    configure_logging("json", level, stream=stream)
