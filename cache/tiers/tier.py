"""The protocol every tier below the pool implements, and its statistics.

A tier stores values (:mod:`~mlxkv.cache.tiers.block_format`) under storage
keys for one namespace. It is entered as an async context manager (it may
hold connections or scan a directory) and, once entered:

- answers :meth:`Tier.contains_many` and :meth:`Tier.get_many` in key order,
  a miss being ``False`` / ``None``. A value is returned only if it verified
  (:func:`~mlxkv.cache.tiers.block_format.check_value`, at the position it
  was asked for when the caller knows it); one that did not is counted
  corrupt, deleted (unless it is not the tier's to delete: a planted file
  that is not a regular file) and answered as a miss. No more than
  :func:`~mlxkv.cache.tiers.block_format.max_value_size` bytes of anything
  stored under a key are read;
- counts as loaded only what its user says it used
  (:meth:`Tier.count_loaded`): a value read past where a chain stopped is
  not a block loaded;
- stores with :meth:`Tier.put`, which answers whether the tier now holds
  the value;
- never raises for what its storage does (a missing file, a server that is
  down, slow or full): that is a miss or a dropped write, counted and logged
  once, never an error to the caller. Only bugs raise;
- queues what it removed on its own (evicted, corrupt) for
  :meth:`Tier.take_removals`, so whoever publishes KV events can say so.

Tiers are driven from the event loop; their blocking work runs in worker
threads, and their counters are written on the event loop only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from types import TracebackType
from typing import Literal, Optional, Protocol

import attrs

from mlxkv.cache.tiers.block_format import CheckedValue
from mlxkv.cache.tiers.storage_key import StorageKey

__all__ = ["RemovalReason", "Tier", "TierCounters", "TierRemoval", "TierStatistics"]

#: Why a tier removed a value on its own or on request.
RemovalReason = Literal["evicted", "corrupt", "deleted"]


@attrs.frozen
class TierRemoval:
    """A value a tier no longer holds, and why."""

    key: StorageKey
    reason: RemovalReason


@attrs.frozen
class TierStatistics:
    """A tier's counters at one moment.

    Attributes:
        name: the tier's name (its URL without options or credentials).
        num_written: puts after which the tier held the value.
        num_loaded: values a lookup used (:meth:`Tier.count_loaded`; a
            value read but not used is not counted).
        num_missed: keys a probe or a get did not find, or could not ask for.
        num_dropped: puts that stored nothing (too big, storage failing,
            server down or full).
        num_corrupt: values that did not verify (or were not values: a
            planted FIFO, link or directory, a Redis list); each was deleted
            unless it was not the tier's to delete.
        num_evicted: values removed to stay within a byte budget.
        num_bytes: bytes the tier holds as far as it knows, or None when it
            cannot tell (a shared server).
        available: whether the tier's storage answered its last call.
    """

    name: str
    num_written: int
    num_loaded: int
    num_missed: int
    num_dropped: int
    num_corrupt: int
    num_evicted: int
    num_bytes: Optional[int]
    available: bool

    def counts(self) -> tuple[tuple[str, int], ...]:
        """The block counters by what happened to the blocks, in one order
        (what the run report, the statistics and /metrics show)."""
        return (
            ("written", self.num_written),
            ("loaded", self.num_loaded),
            ("missed", self.num_missed),
            ("dropped", self.num_dropped),
            ("corrupt", self.num_corrupt),
            ("evicted", self.num_evicted),
        )

    def summary(self) -> str:
        """The counters as one line a person can read (without the name)."""
        line = ", ".join(f"{value} {event}" for event, value in self.counts())
        return line + ("" if self.available else " (unavailable)")


@attrs.define
class TierCounters:
    """The mutable counters behind a tier's :class:`TierStatistics`, and its
    queue of removals. One per tier, written on the event loop only.

    The removal queue keeps the latest ``max_removals``: a tier whose
    removals nobody takes does not grow without bound.
    """

    num_written: int = 0
    num_loaded: int = 0
    num_missed: int = 0
    num_dropped: int = 0
    num_corrupt: int = 0
    num_evicted: int = 0
    max_removals: int = 4096
    _removals: deque[TierRemoval] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._removals = deque(maxlen=self.max_removals)

    def removed(self, key: StorageKey, reason: RemovalReason) -> None:
        """Count and queue a removal."""
        if reason == "evicted":
            self.num_evicted += 1
        elif reason == "corrupt":
            self.num_corrupt += 1
        self._removals.append(TierRemoval(key, reason))

    def found_corrupt(self, key: StorageKey, *, removed: bool) -> None:
        """Count a corrupt value; queue its removal if it was deleted."""
        if removed:
            self.removed(key, "corrupt")
        else:
            self.num_corrupt += 1

    def take_removals(self) -> list[TierRemoval]:
        """The removals queued since the last call, oldest first."""
        taken = list(self._removals)
        self._removals.clear()
        return taken

    def snapshot(self, name: str, *, num_bytes: Optional[int], available: bool) -> TierStatistics:
        """These counters as a frozen record."""
        return TierStatistics(
            name=name,
            num_written=self.num_written,
            num_loaded=self.num_loaded,
            num_missed=self.num_missed,
            num_dropped=self.num_dropped,
            num_corrupt=self.num_corrupt,
            num_evicted=self.num_evicted,
            num_bytes=num_bytes,
            available=available,
        )


class Tier(Protocol):
    """A store of verified block values under storage keys (see the module docstring)."""

    @property
    def name(self) -> str:
        """The tier's URL without options or credentials: ``file:///...``,
        ``redis://host:port/db`` (it is shown in reports and metric labels)."""
        ...

    async def __aenter__(self) -> Tier: ...

    async def __aexit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> Optional[bool]: ...

    async def contains_many(self, keys: Sequence[StorageKey]) -> list[bool]:
        """Whether each key is stored (cheap: no value is read or verified)."""
        ...

    async def get_many(
        self, keys: Sequence[StorageKey], *, starts: Optional[Sequence[int]] = None
    ) -> list[Optional[CheckedValue]]:
        """Each key's verified value, or None.

        Args:
            keys: the keys to read.
            starts: the position (token index) each key's block must begin
                at, when the caller knows it; a value for another position
                is corrupt.
        """
        ...

    def count_loaded(self, num_values: int) -> None:
        """Count ``num_values`` of the values this tier returned as loaded:
        its user (a lookup) used them."""
        ...

    async def get(self, key: StorageKey) -> Optional[CheckedValue]:
        """One key's verified value, or None."""
        ...

    async def put(self, key: StorageKey, value: bytes) -> bool:
        """Store ``value`` under ``key``; whether the tier now holds it."""
        ...

    async def delete(self, key: StorageKey) -> None:
        """Remove ``key``'s value, if any."""
        ...

    def take_removals(self) -> list[TierRemoval]:
        """What the tier removed since the last call, oldest first."""
        ...

    def statistics(self) -> TierStatistics:
        """The tier's counters now."""
        ...
