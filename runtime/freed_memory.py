"""Handing memory that Python freed back to the operating system.

glibc's ``malloc`` keeps freed memory for reuse: after a request that held
tens of megabytes in pieces (a body read in 64 KiB messages, decoded
pictures), the process's resident set stays that much larger although
nothing holds it. ``malloc_trim(0)`` returns those free pages. Elsewhere
(macOS, musl) there is no such call, and nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any, Optional

__all__ = ["TRIM_AFTER_BYTES", "return_freed_memory"]

#: A request that held at least this much is followed by a trim.
TRIM_AFTER_BYTES = 1 << 20


@functools.cache
def _malloc_trim() -> Optional[Any]:
    name = ctypes.util.find_library("c")
    try:
        trim = getattr(ctypes.CDLL(name), "malloc_trim")
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def return_freed_memory() -> bool:
    """Give free heap pages back to the system (a few ms; call it off the event
    loop); whether the C library could."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
