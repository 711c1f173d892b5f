"""Tracing set-up for applications; the library itself never configures structlog.

mlxkv logs through ``structlog.get_logger("mlxkv")``. With
``RuntimeConfig(trace=True)`` every actor emits one ``message.handled`` event
(info level) per message, with ``actor``, ``message``, ``request_id``,
``queued_ms``, ``handling_ms``, ``error`` and ``undone``. Without it the
library emits only warnings and errors (``message.failed``,
``actor.crashed``).

Where those events go is the application's choice. :func:`configure` is a
one-call set-up for applications that have none: console or JSON lines, a
level filter, any text file.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional, TextIO

import structlog

from mlxkv.cache.errors import InvalidInput

__all__ = ["configure"]

_LEVELS = ("debug", "info", "warning", "error", "critical")


def configure(json: bool = False, level: str = "info", file: Optional[TextIO] = None) -> None:
    """Configure structlog process-wide (for applications, never called by mlxkv).

    Args:
        json: render one JSON object per line instead of console text.
        level: the lowest level kept: ``debug``, ``info``, ``warning``,
            ``error`` or ``critical``.
        file: where events are written (default: standard error).

    Raises:
        InvalidInput: ``level`` is not one of the above.
    """
    if not isinstance(level, str) or level.lower() not in _LEVELS:
        raise InvalidInput("level", level, f"must be one of {', '.join(_LEVELS)}")
    processors: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json:
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        stream = file if file is not None else sys.stderr
        colors = bool(getattr(stream, "isatty", lambda: False)())
        processors.append(structlog.dev.ConsoleRenderer(colors=colors))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelName(level.upper())
        ),
        logger_factory=structlog.PrintLoggerFactory(file if file is not None else sys.stderr),
        cache_logger_on_first_use=False,
    )
