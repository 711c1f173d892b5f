"""Typed errors of mlxkv: every one is a :class:`CacheError`.

The seed-compatible methods keep the seed's return contracts (``None``,
``False``, ``ValueError``); everything new raises one of these. Each error
carries its facts as attributes, so callers can act on them without parsing
the message.

:class:`InvariantViolation` is the odd one out: it reports a bug (state that
should be impossible), not a request that was refused, so it is an
``AssertionError`` rather than a :class:`CacheError`.
"""

from __future__ import annotations

import reprlib
from typing import Any

__all__ = [
    "CacheError",
    "DoubleFree",
    "DuplicateRequest",
    "InvalidInput",
    "InvariantViolation",
    "OutOfBlocks",
    "Shown",
    "UnknownRequest",
    "counted",
    "plural",
]


class CacheError(Exception):
    """Base class of every error mlxkv raises on purpose."""


class InvalidInput(CacheError, ValueError):
    """An argument was rejected before any state changed.

    Attributes:
        argument: name of the offending argument.
        value: the value given (possibly abbreviated).
    """

    def __init__(self, argument: str, value: Any, reason: str) -> None:
        self.argument = argument
        self.value = value
        self.reason = reason
        super().__init__(f"invalid {argument}={_abbrev(value)}: {reason}")


class OutOfBlocks(CacheError, ValueError):
    """Not enough free blocks, even after evicting every evictable one.

    Subclasses ``ValueError`` because the seed's ``get_new_blocks`` raises
    ``ValueError`` in this case; seed-era ``except ValueError`` keeps working.

    Attributes:
        requested: how many blocks were asked for.
        available: how many could have been had (free, counting evictable).
    """

    def __init__(self, requested: int, available: int) -> None:
        self.requested = requested
        self.available = available
        noun = "block" if requested == 1 else "blocks"
        super().__init__(f"asked for {requested} {noun}, only {available} available")


class UnknownRequest(CacheError, KeyError):
    """A request id that holds nothing here (never seen, or already released)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(request_id)

    def __str__(self) -> str:
        return f"unknown request {self.request_id!r}"


class DuplicateRequest(CacheError):
    """A request id that is already in use was used to start another request."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(f"request {request_id!r} is already active")


class DoubleFree(CacheError):
    """A block was released by someone who holds no reference to it."""

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        super().__init__(f"block {block_id} released while not referenced")


class Shown(str):
    """A value's description that an error message shows as it is, unquoted:
    ``invalid images=<2 images>: ...`` rather than a count or a repr that
    names another thing (``images=2``) or an address (``<_io.BytesIO object at 0x...>``)."""

    def __repr__(self) -> str:
        return str(self)


def plural(n: int, noun: str) -> str:
    """``1 image``, ``2 images``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def counted(n: int, noun: str) -> Shown:
    """``<1 image>``, ``<2 images>``: a count as an error message's value."""
    return Shown(f"<{plural(n, noun)}>")


class InvariantViolation(AssertionError):
    """A ``check_invariants()`` found the state broken: a bug, never bad input.

    Raised explicitly rather than by ``assert``, so the checks still run under
    ``python -O``. It subclasses ``AssertionError`` (what the checks raised
    before) and not :class:`CacheError`, so no caller mistakes it for a
    refused request.
    """


def _abbrev(value: Any, limit: int = 60) -> str:
    # Bounded work whatever the value: a 50 MB string or a list nested a
    # thousand deep is cut before it is written out, not after. One line: a
    # multi-line repr (a 2-D array's) is joined, so a message stays one line
    # wherever it is printed.
    if type(value) in (str, bytes, bytearray) and len(value) > limit:
        value = value[:limit]
    text = " ".join(line.strip() for line in _SHORT_REPR.repr(value).splitlines())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short_repr() -> reprlib.Repr:
    short = reprlib.Repr()
    short.maxlevel = 4
    short.maxtuple = short.maxlist = short.maxarray = short.maxset = short.maxfrozenset = 16
    short.maxdict = short.maxdeque = 8
    short.maxstring = short.maxother = short.maxlong = 80
    return short


_SHORT_REPR = _short_repr()
