"""Quantities as people write them: byte sizes (``"2GiB"``, ``"512 MB"``,
``1 << 30``) and counted nouns (``1 block``, ``4 blocks``)."""

from __future__ import annotations

import re
from typing import Any, Optional

from mlxkv.cache.errors import InvalidInput

__all__ = ["format_bytes", "format_count", "parse_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gib": 2**30,
    "t": 2**40,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


def parse_bytes(value: Any, *, argument: str = "bytes") -> int:
    """A byte count from an int or a string with a unit.

    ``KB``/``MB``/``GB``/``TB`` are powers of 1000; ``KiB``/``MiB``/``GiB``/
    ``TiB`` and the bare ``K``/``M``/``G``/``T`` are powers of 1024. Case is
    ignored.

    Args:
        value: an int >= 1, or a string such as ``"2GiB"`` or ``"1.5 GB"``.
        argument: the name errors report.

    Returns:
        The number of bytes (rounded down), at least 1.

    Raises:
        InvalidInput: not a positive int or a size string.
    """
    if isinstance(value, bool):
        raise InvalidInput(argument, value, "must be a byte count (int) or a size like '2GiB'")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and (match := _SIZE.match(value.lower())):
        digits, unit = match.groups()
        if unit not in _UNITS:
            raise InvalidInput(argument, value, f"unknown unit {unit!r}: use B, KB, MB, GB, KiB, MiB, GiB")
        number = int(float(digits) * _UNITS[unit])
    else:
        raise InvalidInput(argument, value, "must be a byte count (int) or a size like '2GiB'")
    if number < 1:
        raise InvalidInput(argument, value, "must be at least 1 byte")
    return number


def format_bytes(count: int) -> str:
    """``count`` bytes in the largest binary unit that keeps it >= 1 (``"1.5 MiB"``)."""
    if count < 1024:
        return f"{count} B"
    size, unit = count / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{size:.1f} {unit}"


def format_count(number: int, noun: str, plural: Optional[str] = None) -> str:
    """``number`` and ``noun``, plural unless one: ``1 block``, ``4 blocks``.

    Args:
        number: how many.
        noun: the singular.
        plural: the plural, if not ``noun + "s"`` (``"entries"``).
    """
    return f"{number} {noun if number == 1 else plural or noun + 's'}"
