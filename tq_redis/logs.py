"""``get_logger``: a logger that prints even in a process that configured no logging.

Ray actors and workers start with no logging set up, so a library's log lines vanish there. The
``transfer_queue`` alias serves this as ``transfer_queue.utils.logging_utils.get_logger``, which
the reference's recipes call.
"""

from __future__ import annotations

import logging

from tq_redis.errors import ConfigError
from tq_redis.settings import settings

LEVEL_ENV = "TQ_LOGGING_LEVEL"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def get_logger(name: str | None, default_level: str = "WARNING") -> logging.Logger:
    """The logger ``name``, its level from ``TQ_LOGGING_LEVEL`` (else ``default_level``), with a
    stderr handler when neither it nor an ancestor has one.

    Raises:
        ConfigError: the level is not a logging level name (``DEBUG``, ``INFO``, ...) or number.
    """
    level_text = settings.logging_level or default_level
    level = logging.getLevelName(level_text.upper()) if isinstance(level_text, str) else level_text
    if isinstance(level_text, str) and level_text.isdigit():
        level = int(level_text)
    if not isinstance(level, int):
        source = LEVEL_ENV if settings.logging_level else "default_level"
        raise ConfigError(
            f"{source}={level_text!r} is not a logging level; use DEBUG, INFO, WARNING, ERROR or CRITICAL"
        )
    logger = logging.getLogger(name)
    logger.setLevel(level)
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        logger.addHandler(handler)
    return logger
