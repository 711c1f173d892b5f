"""Where mlxkv's events go: the application's structlog, else the standard logger ``mlxkv``.

A library prints nothing it was not asked to. structlog, left unconfigured,
prints every event to standard output, so mlxkv hands an event to structlog
only once the application has configured it (``structlog.is_configured()``;
``structlog.testing.capture_logs`` counts as configuring). Until then events
go to the standard-library logger ``mlxkv``, which carries a ``NullHandler``:
silent unless the application gives it a handler (``logging.basicConfig`` or
its own), in which case each event arrives as one record whose message is
``event key=value ...`` and whose ``mlxkv`` attribute holds the fields as a
dict.

The choice is made per event, not when a logger is built: an application may
configure structlog after the runtime started, and the check is one
attribute read. Events are emitted only for warnings, errors and opt-in
tracing, never per token on a quiet runtime.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

__all__ = ["EventLog"]

_STDLIB = logging.getLogger("mlxkv")
_STDLIB.addHandler(logging.NullHandler())
# A lazy proxy: it reads structlog's configuration at each call.
_STRUCTLOG = structlog.get_logger("mlxkv")


class EventLog:
    """Emits named events with key-value fields; ``bind`` adds fields to every event.

    Owns: the bound fields (immutable; ``bind`` returns a new log).
    """

    __slots__ = ("_context",)

    def __init__(self, **context: Any) -> None:
        self._context = context

    def bind(self, **context: Any) -> EventLog:
        """A log whose events also carry ``context``."""
        return EventLog(**self._context, **context)

    def debug(self, event: str, **fields: Any) -> None:
        """Emit ``event`` at debug level."""
        self._emit(logging.DEBUG, "debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        """Emit ``event`` at info level."""
        self._emit(logging.INFO, "info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        """Emit ``event`` at warning level."""
        self._emit(logging.WARNING, "warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        """Emit ``event`` at error level."""
        self._emit(logging.ERROR, "error", event, fields)

    def _emit(self, level: int, method: str, event: str, fields: dict[str, Any]) -> None:
        if structlog.is_configured():
            getattr(_STRUCTLOG, method)(event, **{**self._context, **fields})
        elif _STDLIB.isEnabledFor(level):
            merged = {**self._context, **fields}
            text = " ".join(f"{key}={value!r}" for key, value in merged.items())
            _STDLIB.log(level, "%s %s", event, text, extra={"mlxkv": {"event": event, **merged}})
