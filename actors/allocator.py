"""The block allocator actor: sole owner of the KV block pool and its payloads.

:class:`BlockAllocatorActor` wraps one :class:`~mlxkv.cache.pool.BlockPool`
and uses it through its public operations only: each handler is one of
them. It answers "which of these hashes can I have?" (:class:`Acquire`), "keep these
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

from collections.abc import Mapping
from typing import Any, NamedTuple, NewType, Optional

import attrs

from mlxkv.actors.actor import Actor, ActorHandle, Ask, Message, Tell
from mlxkv.cache.block_hash import BlockHash
from mlxkv.cache.errors import InvariantViolation, OutOfBlocks
from mlxkv.cache.pool import BlockPool, PoolStatistics

__all__ = [
    "Acquire",
    "AllocatorReport",
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
        refused: for a ``StoreBlocks`` of the leading blocks that fit, the
            :class:`OutOfBlocks` storing them all would have raised; None
            when every block was stored.
        fresh: hashes of the blocks a ``StoreBlocks`` newly committed (their
            given payload was stored), in order; the others were cached already.
    """

    # Payloads are arrays, whose == is elementwise: not part of equality.
    grants: tuple[BlockGrant, ...] = attrs.field(default=(), eq=False)
    num_reused: int = 0
    evicted: tuple[BlockHash, ...] = ()
    refused: Optional[OutOfBlocks] = attrs.field(default=None, eq=False)
    fresh: tuple[BlockHash, ...] = ()

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
class Acquire(Ask[Grants]):
    """Take a reference to each block of the longest cached leading run of ``hashes``."""

    hashes: tuple[BlockHash, ...] = attrs.field(converter=tuple)

    def trace_fields(self) -> dict[str, int]:
        """How many blocks were asked for, for tracing."""
        return {"asked": len(self.hashes)}


@attrs.frozen(kw_only=True)
class StoreBlocks(Ask[Grants]):
    """Keep one computed block per hash (:meth:`BlockPool.store`), all or nothing.

    A hash already cached is reused (its block gains a reference and the
    given payload is dropped); any other gets a fresh block that is committed
    under the hash with its payload. Raises OutOfBlocks, changing nothing, if
    the fresh blocks do not fit -- or, with ``leading``, keeps the leading
    blocks that fit and says what did not (``Grants.refused``).
    """

    hashes: tuple[BlockHash, ...] = attrs.field(converter=tuple)
    payloads: tuple[Any, ...] = attrs.field(converter=tuple)
    leading: bool = False


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
class Statistics(Ask[PoolStatistics]):
    """Report the pool's :class:`~mlxkv.cache.pool.PoolStatistics`."""

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
    """Owns the block pool, its reference counts, hashes and payloads.

    Owns: one :class:`~mlxkv.cache.pool.BlockPool` (blocks, reference counts,
    free LRU queue, hash -> block map, the KV payload of every block as the
    block's ``cache_data``, counters) and the eviction announcements not yet
    handed out.

    Invariants:
        - the pool's invariants (``BlockPool.check_invariants``);
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
        self._pool = BlockPool(block_size=block_size, max_blocks=max_blocks)
        super().__init__(**options)
        self._unannounced: dict[BlockHash, None] = {}

    def handle(self, message: Message) -> Any:
        """Dispatch ``message`` to its handler.

        Raises:
            CacheError: the handler's domain error; nothing changed.
        """
        pool = self._pool
        match message:
            case Acquire():
                return self._grants(pool.acquire(message.hashes))
            case StoreBlocks():
                stored = pool.store(message.hashes, message.payloads, leading=message.leading)
                return self._grants(
                    stored.blocks,
                    num_reused=stored.num_reused,
                    refused=stored.refused,
                    fresh=tuple(block.block_hash for block in stored.fresh),
                )
            case Retain():
                return self._grants(pool.retain(message.blocks))
            case Release():
                pool.release(message.block_ids)
                self._unannounced.update(dict.fromkeys(message.reannounce))
                return None
            case Evict():
                num_evicted = pool.evict(message.num_blocks)
                return Eviction(num_evicted=num_evicted, evicted=self._announce())
            case Statistics():
                return pool.statistics()
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

    # -- helpers ----------------------------------------------------------

    def _grants(self, blocks: Any, **fields: Any) -> Grants:
        """One grant per block (which the caller now holds), with the announcements."""
        return Grants(
            grants=tuple(
                BlockGrant(block.block_id, block.block_hash, block.token_count, block.cache_data)
                for block in blocks
            ),
            evicted=self._announce(),
            **fields,
        )

    def _announce(self) -> tuple[BlockHash, ...]:
        """Drain the evictions not announced yet, minus hashes cached again since."""
        pending = self._unannounced
        pending.update(dict.fromkeys(self._pool.take_evicted()))
        if not pending:
            return ()
        is_cached = self._pool.is_cached
        evicted = tuple(block_hash for block_hash in pending if not is_cached(block_hash))
        pending.clear()
        return evicted

    def _check(self, message: CheckInvariants) -> AllocatorReport:
        violations = []
        try:
            self._pool.check_invariants()
        except InvariantViolation as error:
            violations.append(f"allocator: {error}")
        mismatches = ()
        expected = message.expected_references
        if expected is not None:
            mismatches = tuple(
                f"allocator: {line}" for line in self._pool.check_references(expected)
            )
        return AllocatorReport(violations=tuple(violations), reference_mismatches=mismatches)


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
        leading: bool = False,
        request_id: Optional[str] = None,
    ) -> Grants:
        """See :class:`StoreBlocks`.

        Raises:
            OutOfBlocks: without ``leading``, the fresh blocks do not fit;
                nothing changed.
            InvalidInput: not one payload per hash.
            ActorFailed: the actor is not running.
        """
        return await self._ref.ask(
            StoreBlocks, hashes=hashes, payloads=payloads, leading=leading, request_id=request_id
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

    async def statistics(self) -> PoolStatistics:
        """See :class:`Statistics`."""
        return await self._ref.ask(Statistics)

    async def check_invariants(
        self, expected_references: Optional[Mapping[BlockId, int]] = None
    ) -> AllocatorReport:
        """See :class:`CheckInvariants`."""
        return await self._ref.ask(CheckInvariants, expected_references=expected_references)
