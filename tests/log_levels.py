"""The service's log levels kept across a block (`tests/conftest.py` keeps them across every test)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def service_log_levels_kept() -> Iterator[None]:
    """The service's loggers' levels put back as they were when the block began. Every app sets
    them for the whole process from its `log_level` (`create_app`), so an app a test makes at INFO
    would leave the session's live server logging every request at INFO, into the stderr of the
    CLI commands later tests run against it."""
    from exgrpo_pool.app import SERVICE_LOGGERS

    loggers = [logging.getLogger(name) for name in SERVICE_LOGGERS]
    levels = [logger.level for logger in loggers]
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            if logger.level != level:
                logger.setLevel(level)
