"""Typed errors of the tiers below the block pool; both are :class:`CacheError`.

A tier never lets either reach a lookup or a writer: :class:`CorruptValue` is
how the value codec tells a tier "this is not a block of yours" (the tier
counts it, deletes the value and answers a miss), and :class:`MissingExtra`
is raised once, when a tier is configured, never per block.
"""

from __future__ import annotations

from mlxkv.cache.errors import CacheError

__all__ = ["CorruptValue", "MissingExtra"]


class CorruptValue(CacheError):
    """A stored value that is not exactly a block of the expected namespace and key.

    Raised for anything that does not verify: a short or over-long value, a
    wrong magic or format version, a checksum that disagrees, a header that
    does not parse or names another namespace, key, layout or block size, or
    array sizes that do not add up. Never a partial result: a value either
    decodes in full or raises this.

    Attributes:
        reason: what did not verify, in words.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"corrupt block value: {reason}")


class MissingExtra(CacheError, ImportError):
    """A tier needs a package of an optional extra that is not installed.

    Subclasses ``ImportError`` so ``except ImportError`` around an optional
    feature keeps working.

    Attributes:
        extra: the extra to install (``pip install 'mlxkv[<extra>]'``).
        package: the missing distribution.
    """

    def __init__(self, extra: str, package: str, needed_for: str) -> None:
        self.extra = extra
        self.package = package
        super().__init__(
            f"{needed_for} needs the {extra} extra: pip install 'mlxkv[{extra}]'"
            f" ({package} is not installed)"
        )
