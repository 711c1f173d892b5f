"""The block allocator actor: sole owner of the KV block pool and its payloads.

:class:`BlockAllocatorActor` wraps one :class:`~mlxkv.cache.paged.PagedCacheManager`.
It answers "which of these hashes can I have?" (:class:`Acquire`), "keep these
computed blocks" (:class:`StoreBlocks`), "one more reference to these blocks"
(:class:`Retain`) and takes references back (:class:`Release`). Every grant is
validated here, where the state lives: a hash whose block was evicted or
reused is simply not granted, so a stale hint elsewhere turns into a miss,
never into a wrong block.

Evictions happen here (lazily, when allocation reuses a cached free block,
or on :class:`Evict`) and are *announced*: every reply that can carry them
includes the hashes that left the cache since the last such reply, and the
caller forwards them to whoever keeps hints. An actor never sends to another
actor from a handler.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any, NamedTuple, NewType, Optional

import attrs

from mlxkv.actors.actor import Actor, ActorHandle, Ask, Message, Tell
from mlxkv.cache.block_hash import BlockHash
from mlxkv.cache.errors import InvalidInput, InvariantViolation, OutOfBlocks
from mlxkv.cache.paged import PagedCacheManager

__all__ = [
    "Acquire",
    "AllocatorReport",
    "AllocatorStatistics",
    "BlockAllocatorActor",
    "BlockAllocatorHandle",
    "BlockGrant",
    "BlockId",
    "CheckInvariants",
    "Evict",
    "Eviction",
    "Grants",
    "Release",
    "Retain",
    "Statistics",
    "StoreBlocks",
]

#: Index of a block in the allocator's pool (block 0 is the null block).
BlockId = NewType("BlockId", int)


class BlockGrant(NamedTuple):
    """One reference to one cached block, handed to a caller.

    A named tuple rather than an attrs class: a request of a few thousand
    tokens gets dozens per call, and this is about five times cheaper to build.
    Immutable all the same.

    Attributes:
        block_id: the block.
        block_hash: the parent-chained hash the block holds.
        num_tokens: tokens the block covers (a full block).
        payload: the block's KV data, shared by reference (never copied).
    """

    block_id: BlockId
    block_hash: BlockHash
    num_tokens: int
    payload: Any = None

    def __repr__(self) -> str:
        return (
            f"BlockGrant(block_id={self.block_id}, block_hash={self.block_hash.hex()[:12]}...,"
            f" num_tokens={self.num_tokens})"
        )


@attrs.frozen(kw_only=True)
class Grants:
    """Reply to :class:`Acquire`, :class:`StoreBlocks` and :class:`Retain`.

    Attributes:
        grants: one reference per block, in the order asked for.
        num_reused: how many of them were found cached rather than stored
            (``StoreBlocks`` only).
        evicted: hashes that left the cache since the previous reply that
            announced evictions; forward them to the prefix index.
    """

    # Payloads are arrays, whose == is elementwise: not part of equality.
    grants: tuple[BlockGrant, ...] = attrs.field(default=(), eq=False)
    num_reused: int = 0
    evicted: tuple[BlockHash, ...] = ()

    @property
    def block_ids(self) -> tuple[BlockId, ...]:
        """The granted block ids, in order."""
        return tuple(grant.block_id for grant in self.grants)

    def trace_fields(self) -> dict[str, int]:
        """What the grant gave, for tracing."""
        return {"granted": len(self.grants), "reused": self.num_reused, "evicted": len(self.evicted)}


@attrs.frozen(kw_only=True)
class Eviction:
    """Reply to :class:`Evict`.

    Attributes:
        num_evicted: cached free blocks that lost their hash.
        evicted: hashes that left the cache (see :attr:`Grants.evicted`).
    """

    num_evicted: int
    evicted: tuple[BlockHash, ...] = ()

    def trace_fields(self) -> dict[str, int]:
        """What was evicted, for tracing."""
        return {"evicted": self.num_evicted}


@attrs.frozen(kw_only=True)
class AllocatorStatistics:
    """A snapshot of the block pool.

    Attributes:
        block_size: tokens per block.
        num_blocks: usable blocks (the null block excluded):
            ``num_referenced + num_reusable + num_empty``.
        num_free: blocks with no reference, cached ones included
            (``num_reusable + num_empty``).
        num_referenced: blocks with at least one reference (held by requests).
        num_cached: distinct hashes cached (held or free).
        num_reusable: blocks with no reference that still hold cached KV: a
            later request that shares their prefix takes them; allocation
            evicts them (least recently released first) only when no empty
            block is left.
        num_hits: blocks found by acquisitions.
        num_misses: acquisitions that stopped before the end of their chain.
        num_evictions: cached blocks whose hash was dropped.
        num_stored: blocks newly committed by ``StoreBlocks``.
        num_reused: blocks ``StoreBlocks`` found cached instead of storing.
        num_retained: references added by ``Retain``.
    """

    block_size: int
    num_blocks: int
    num_free: int
    num_referenced: int
    num_cached: int
    num_reusable: int
    num_hits: int
    num_misses: int
    num_evictions: int
    num_stored: int
    num_reused: int
    num_retained: int

    @property
    def num_empty(self) -> int:
        """Blocks with no reference and no cached KV."""
        return self.num_free - self.num_reusable


@attrs.frozen(kw_only=True)
class Acquire(Ask[Grants]):
    """Take a reference to each block of the longest cached leading run of ``hashes``."""

    hashes: tuple[BlockHash, ...] = attrs.field(converter=tuple)

    def trace_fields(self) -> dict[str, int]:
        """How many blocks were asked for, for tracing."""
        return {"asked": len(self.hashes)}


@attrs.frozen(kw_only=True)
class StoreBlocks(Ask[Grants]):
    """Keep one computed block per hash, all or nothing.

    A hash already cached is reused (its block gains a reference and the
    given payload is dropped); any other gets a fresh block that is committed
    under the hash with its payload. Raises OutOfBlocks, changing nothing, if
    the fresh blocks do not fit.
    """

    hashes: tuple[BlockHash, ...] = attrs.field(converter=tuple)
    payloads: tuple[Any, ...] = attrs.field(converter=tuple)


@attrs.frozen(kw_only=True)
class Retain(Ask[Grants]):
    """One more reference to each listed block, if it still holds the listed hash."""

    blocks: tuple[tuple[BlockId, BlockHash], ...] = attrs.field(converter=tuple)


@attrs.frozen(kw_only=True)
class Release(Tell):
    """Drop one reference per listed block.

    ``reannounce`` hands back eviction announcements that never reached the
    prefix index (their reply was undone), so a later reply carries them.
    """

    block_ids: tuple[BlockId, ...] = attrs.field(converter=tuple)
    reannounce: tuple[BlockHash, ...] = attrs.field(default=(), converter=tuple)

    def trace_fields(self) -> dict[str, int]:
        """How many references were given back, for tracing."""
        return {"released": len(self.block_ids)}


@attrs.frozen(kw_only=True)
class Evict(Ask[Eviction]):
    """Drop the cached content of up to ``num_blocks`` free blocks, least recently freed first."""

    num_blocks: int


@attrs.frozen(kw_only=True)
class Statistics(Ask[AllocatorStatistics]):
    """Report :class:`AllocatorStatistics`."""

    polled = True


@attrs.frozen(kw_only=True)
class AllocatorReport:
    """Reply to :class:`CheckInvariants`.

    Attributes:
        violations: broken invariants of the pool itself.
        reference_mismatches: blocks whose reference count differs from the
            expected references (only if they were given).
    """

    violations: tuple[str, ...] = ()
    reference_mismatches: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class CheckInvariants(Ask[AllocatorReport]):
    """Verify the pool; with ``expected_references`` also that every block's
    reference count equals the references listed there (block id -> count)."""

    polled = True

    expected_references: Optional[Mapping[BlockId, int]] = None


class BlockAllocatorActor(Actor):
    """Owns the paged block pool, its reference counts, hashes and payloads.

    Owns: one :class:`PagedCacheManager` (blocks, reference counts, free LRU
    queue, hash -> block map), the KV payload of every block (as the block's
    ``cache_data``), the eviction announcements not yet handed out, and
    counters.

    Invariants:
        - the manager's invariants (``PagedCacheManager.check_invariants``);
        - a grant names a block that holds the granted hash at grant time;
        - every hash evicted is announced in exactly one delivered reply, or
          handed back by the undo of an undelivered one and announced later;
        - a handler that raises a CacheError has changed nothing.
    """

    name = "allocator"

    def __init__(
        self,
        *,
        block_size: int = 64,
        max_blocks: int = 1024,
        **options: Any,
    ) -> None:
        """Create the pool.

        Args:
            block_size: tokens per block.
            max_blocks: blocks in the pool, the null block included.
            **options: the :class:`Actor` options (``mailbox_size``, ``trace``,
                ``trace_polls``, ``intercept``).

        Raises:
            InvalidInput: ``block_size`` or ``max_blocks`` is out of range.
        """
        self._cache = PagedCacheManager(block_size=block_size, max_blocks=max_blocks)
        super().__init__(**options)
        self._unannounced: dict[BlockHash, None] = {}
        self._num_stored = 0
        self._num_reused = 0
        self._num_retained = 0

    def handle(self, message: Message) -> Any:
        """Dispatch ``message`` to its handler.

        Raises:
            CacheError: the handler's domain error; nothing changed.
        """
        match message:
            case Acquire():
                return self._acquire(message)
            case StoreBlocks():
                return self._store(message)
            case Retain():
                return self._retain(message)
            case Release():
                return self._release(message)
            case Evict():
                return self._evict(message)
            case Statistics():
                return self._statistics()
            case CheckInvariants():
                return self._check(message)
        return super().handle(message)

    def undo(self, message: Ask[Any], reply: Any) -> Optional[Tell]:
        """Give back an undelivered reply's references and announcements."""
        if isinstance(reply, Grants):
            return Release(
                block_ids=reply.block_ids, reannounce=reply.evicted, request_id=message.request_id
            )
        if isinstance(reply, Eviction) and reply.evicted:
            return Release(block_ids=(), reannounce=reply.evicted, request_id=message.request_id)
        return None

    # -- handlers ---------------------------------------------------------

    def _acquire(self, message: Acquire) -> Grants:
        blocks = self._cache.acquire(message.hashes)
        return Grants(grants=tuple(map(self._grant, blocks)), evicted=self._announce())

    def _store(self, message: StoreBlocks) -> Grants:
        hashes, payloads = message.hashes, message.payloads
        if len(payloads) != len(hashes):
            raise InvalidInput(
                "payloads", len(payloads), f"must be one per hash ({len(hashes)})"
            )
        for block_hash in hashes:
            if not isinstance(block_hash, bytes):
                raise InvalidInput("hashes", block_hash, "must be BlockHash (bytes)")
        cache = self._cache
        index = cache.cached_block_hash_to_block
        found = [index.get_block(block_hash) for block_hash in hashes]
        num_fresh = found.count(None)
        # Reviving a free cached block takes it out of the free queue, so it
        # cannot also be counted as room for a fresh block.
        available = cache.free_blocks - sum(
            1 for block in found if block is not None and block.ref_count == 0
        )
        if num_fresh > available:
            raise OutOfBlocks(num_fresh, max(available, 0))
        # References first: allocation below may evict free cached blocks,
        # and must not evict the ones being reused.
        cache.touch([block for block in found if block is not None])
        fresh = iter(cache.allocate(num_fresh))
        size = cache.block_size
        granted = []
        for block, block_hash, payload in zip(found, hashes, payloads):
            if block is None:
                block = next(fresh)
                cache.commit(block, block_hash, num_tokens=size, cache_data=payload)
            granted.append(self._grant(block))
        num_reused = len(hashes) - num_fresh
        self._num_stored += num_fresh
        self._num_reused += num_reused
        return Grants(grants=tuple(granted), num_reused=num_reused, evicted=self._announce())

    def _retain(self, message: Retain) -> Grants:
        cache = self._cache
        pool = cache.blocks
        blocks = []
        for item in message.blocks:
            try:
                block_id, block_hash = item
            except (TypeError, ValueError):
                raise InvalidInput("blocks", item, "must be (block_id, block_hash) pairs") from None
            if block_id.__class__ is not int or not 0 < block_id < len(pool):
                raise InvalidInput("blocks", block_id, "is not a block id of this pool")
            block = pool[block_id]
            if block.block_hash is None or block.block_hash != block_hash:
                raise InvalidInput(
                    "blocks", block_id, "no longer holds the expected hash (evicted or reused)"
                )
            blocks.append(block)
        cache.touch(blocks)
        self._num_retained += len(blocks)
        return Grants(grants=tuple(map(self._grant, blocks)), evicted=self._announce())

    def _release(self, message: Release) -> None:
        cache = self._cache
        ids = message.block_ids
        pool = cache.blocks
        # Blocks rather than ids take the manager's fast path; anything odd
        # goes through as given, to be refused with the manager's own error.
        if all(i.__class__ is int and 0 < i < len(pool) for i in ids):
            cache.release([pool[i] for i in ids])
        else:
            cache.release(ids)
        for block_hash in message.reannounce:
            self._unannounced[block_hash] = None

    def _evict(self, message: Evict) -> Eviction:
        num_evicted = self._cache.evict(message.num_blocks)
        return Eviction(num_evicted=num_evicted, evicted=self._announce())

    def _statistics(self) -> AllocatorStatistics:
        cache = self._cache
        stats = cache.stats
        return AllocatorStatistics(
            block_size=cache.block_size,
            num_blocks=cache.max_blocks - 1,
            num_free=cache.free_blocks,
            num_referenced=len(cache.allocated_blocks) - 1,
            num_cached=len(cache.cached_block_hash_to_block),
            num_reusable=sum(
                1 for block in cache.blocks if block.ref_count == 0 and block.block_hash is not None
            ),
            num_hits=stats.cache_hits,
            num_misses=stats.cache_misses,
            num_evictions=stats.evictions,
            num_stored=self._num_stored,
            num_reused=self._num_reused,
            num_retained=self._num_retained,
        )

    def _check(self, message: CheckInvariants) -> AllocatorReport:
        violations = []
        try:
            self._cache.check_invariants()
        except InvariantViolation as error:
            violations.append(f"allocator: {error}")
        mismatches = []
        expected = message.expected_references
        if expected is not None:
            wanted = Counter(expected)
            for block in self._cache.blocks:
                held = wanted.get(block.block_id, 0)
                if not block.is_null and block.ref_count != held:
                    mismatches.append(
                        f"allocator: block {block.block_id} has ref_count {block.ref_count},"
                        f" request tables hold {held}"
                    )
        return AllocatorReport(violations=tuple(violations), reference_mismatches=tuple(mismatches))

    # -- helpers ----------------------------------------------------------

    @staticmethod
    def _grant(block: Any) -> BlockGrant:
        return BlockGrant(block.block_id, block.block_hash, block.token_count, block.cache_data)

    def _announce(self) -> tuple[BlockHash, ...]:
        """Drain the evictions not announced yet, minus hashes cached again since."""
        pending = self._unannounced
        pending.update(dict.fromkeys(self._cache.take_evicted()))
        if not pending:
            return ()
        index = self._cache.cached_block_hash_to_block
        evicted = tuple(block_hash for block_hash in pending if block_hash not in index)
        pending.clear()
        return evicted


class BlockAllocatorHandle(ActorHandle):
    """Typed calls to a :class:`BlockAllocatorActor`; messages stay inside.

    Every call is a cancellation point unless documented otherwise.
    """

    async def acquire(self, hashes: tuple[BlockHash, ...], *, request_id: Optional[str] = None) -> Grants:
        """See :class:`Acquire`.

        Raises:
            ActorFailed: the actor is not running.
        """
        return await self._ref.ask(Acquire, hashes=hashes, request_id=request_id)

    async def store_blocks(
        self,
        hashes: tuple[BlockHash, ...],
        payloads: tuple[Any, ...],
        *,
        request_id: Optional[str] = None,
    ) -> Grants:
        """See :class:`StoreBlocks`.

        Raises:
            OutOfBlocks: the fresh blocks do not fit; nothing changed.
            InvalidInput: not one payload per hash.
            ActorFailed: the actor is not running.
        """
        return await self._ref.ask(
            StoreBlocks, hashes=hashes, payloads=payloads, request_id=request_id
        )

    async def retain(
        self, blocks: tuple[tuple[BlockId, BlockHash], ...], *, request_id: Optional[str] = None
    ) -> Grants:
        """See :class:`Retain`.

        Raises:
            InvalidInput: a block no longer holds its hash; nothing changed.
            ActorFailed: the actor is not running.
        """
        return await self._ref.ask(Retain, blocks=blocks, request_id=request_id)

    async def release(
        self,
        block_ids: tuple[BlockId, ...],
        *,
        reannounce: tuple[BlockHash, ...] = (),
        request_id: Optional[str] = None,
    ) -> None:
        """Send :class:`Release`; shielded from cancellation.

        Raises:
            ActorFailed: the actor is not running.
        """
        await self._ref.tell_shielded(
            Release(block_ids=block_ids, reannounce=reannounce, request_id=request_id)
        )

    async def evict(self, num_blocks: int, *, request_id: Optional[str] = None) -> Eviction:
        """See :class:`Evict`.

        Raises:
            InvalidInput: ``num_blocks`` is not a non-negative int.
            ActorFailed: the actor is not running.
        """
        return await self._ref.ask(Evict, num_blocks=num_blocks, request_id=request_id)

    async def statistics(self) -> AllocatorStatistics:
        """See :class:`Statistics`."""
        return await self._ref.ask(Statistics)

    async def check_invariants(
        self, expected_references: Optional[Mapping[BlockId, int]] = None
    ) -> AllocatorReport:
        """See :class:`CheckInvariants`."""
        return await self._ref.ask(CheckInvariants, expected_references=expected_references)
