"""What a disk tier's directory holds, in least-recently-used order, against a byte budget.

Pure bookkeeping (no file system access): :class:`~mlxkv.cache.tiers.disk_tier.DiskTier`
keeps one on the event loop, asks it which files to evict before it writes,
and rebuilds it from a directory scan so that files written by other
processes are counted too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from typing import Optional

from mlxkv.cache.errors import InvalidInput, InvariantViolation

__all__ = ["DiskIndex"]


class DiskIndex:
    """File sizes by name, least recently used first, and their total.

    Owns: the name -> size map (in use order) and the byte total.

    Invariants:
        - ``num_bytes == sum of all sizes``.
        - every size is >= 0.
        - after :meth:`make_room` (size) and :meth:`touch` of that size,
          ``num_bytes <= max_bytes`` unless every other entry was kept.
    """

    __slots__ = ("_entries", "_num_bytes", "max_bytes")

    def __init__(self, max_bytes: int) -> None:
        if type(max_bytes) is not int or max_bytes <= 0:
            raise InvalidInput("max_bytes", max_bytes, "must be a positive int")
        self.max_bytes = max_bytes
        # Invariant: _num_bytes == sum(_entries.values()); first = least recent.
        self._entries: OrderedDict[str, int] = OrderedDict()
        self._num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    @property
    def num_bytes(self) -> int:
        """Bytes of all entries."""
        return self._num_bytes

    def size_of(self, name: str) -> Optional[int]:
        """The size recorded for ``name``, or None."""
        return self._entries.get(name)

    def names(self) -> list[str]:
        """Every name, least recently used first."""
        return list(self._entries)

    def touch(self, name: str, size: int) -> None:
        """Record that ``name`` (now ``size`` bytes) was just used or written."""
        if size < 0:
            raise InvalidInput("size", size, "must be >= 0")
        self._num_bytes += size - self._entries.pop(name, 0)
        self._entries[name] = size

    def forget(self, name: str) -> Optional[int]:
        """Drop ``name``; its size, or None if it was not there."""
        size = self._entries.pop(name, None)
        if size is not None:
            self._num_bytes -= size
        return size

    def fits(self, size: int) -> bool:
        """Whether ``size`` more bytes fit within the budget now."""
        return self._num_bytes + size <= self.max_bytes

    def make_room(self, size: int, *, keep: Collection[str] = ()) -> list[str]:
        """Drop least recently used entries until ``size`` more bytes fit.

        Args:
            size: bytes about to be added (0: just get back within budget).
            keep: names never dropped (files being written right now).

        Returns:
            The dropped names, least recent first: the files to delete. If
            the budget still cannot hold ``size`` (everything left is kept),
            those dropped so far are returned all the same; see :meth:`fits`.
        """
        victims: list[str] = []
        if self.fits(size):
            return victims
        for name in list(self._entries):
            if name in keep:
                continue
            victims.append(name)
            self._num_bytes -= self._entries.pop(name)
            if self.fits(size):
                break
        return victims

    def replace(
        self, scanned: Iterable[tuple[str, int, int]], *, keep: Optional[Mapping[str, int]] = None
    ) -> None:
        """Start over from a directory scan.

        Args:
            scanned: ``(name, size, last_used_ns)`` of every file found; use
                order is rebuilt from ``last_used_ns`` (oldest first; ties
                keep this index's order, unknown names first).
            keep: ``name -> size`` of files being written, which a scan may
                or may not have seen; they stay, as the most recent.
        """
        keep = keep or {}
        # File times are coarse (milliseconds): among equal times, what this
        # index already ordered keeps its order, after what it did not know.
        rank = {name: i for i, name in enumerate(self._entries)}
        self._entries = OrderedDict(
            (name, size)
            for name, size, _ in sorted(scanned, key=lambda entry: (entry[2], rank.get(entry[0], -1)))
            if name not in keep
        )
        self._entries.update(keep)
        self._num_bytes = sum(self._entries.values())

    def check_invariants(self) -> None:
        """Raise :class:`InvariantViolation` if the bookkeeping is broken."""
        if self._num_bytes != sum(self._entries.values()):
            raise InvariantViolation(
                f"num_bytes {self._num_bytes} != sum of sizes {sum(self._entries.values())}"
            )
        if any(size < 0 for size in self._entries.values()):
            raise InvariantViolation("a negative size")
