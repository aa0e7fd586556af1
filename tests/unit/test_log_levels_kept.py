"""A test that makes an app at another log level leaves the process's service loggers as it found
them (`tests/conftest.py`): an in-process live server shared by the session keeps its own level."""

from __future__ import annotations

import logging
from pathlib import Path

from log_levels import service_log_levels_kept

from exgrpo_pool.app import SERVICE_LOGGERS, create_app
from exgrpo_pool.config import Settings


def test_an_app_at_info_leaves_the_service_loggers_as_they_were(tmp_path: Path) -> None:
    loggers = [logging.getLogger(name) for name in SERVICE_LOGGERS]
    before = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)  # as the session's live server sets them
    try:
        with service_log_levels_kept():
            create_app(
                Settings(
                    database_url=f"sqlite+aiosqlite:///{tmp_path / 'p.db'}",
                    log_level="INFO",
                    allow_anonymous=True,
                )
            )
            assert [logger.level for logger in loggers] == [logging.INFO] * len(loggers)
        assert [logger.level for logger in loggers] == [logging.WARNING] * len(loggers)
    finally:
        for logger, level in zip(loggers, before, strict=True):
            logger.setLevel(level)
