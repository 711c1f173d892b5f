"""The block pool: the one place where a KV block is stored, found, evicted and released.

:class:`BlockPool` owns a fixed set of blocks (block 0 is the null block, a
placeholder that is never handed out), their reference counts, the free queue
and the hash -> block map. Everything that keeps KV blocks goes through it: the
allocator actor (which owns one pool for the runtime) and the seed-compatible
classes (:class:`~mlxkv.cache.paged.PagedCacheManager` owns one and adapts the
seed's methods to it; :class:`~mlxkv.cache.block_prefix.BlockAwarePrefixCache`
works on its manager's pool). The keys blocks are stored under come from
:mod:`mlxkv.cache.block_hash`, the one place a block is keyed.

Every block with no reference sits in the free queue, in the order it became
free. A free block that still holds a hash is a cached block: it can be found
again until allocation takes it, and only then is its content dropped (lazy
eviction, as in vLLM v1). A hit is always exact: blocks are found by
parent-chained hash only. What leaves the cache is reported once by
:meth:`BlockPool.take_evicted`, for whoever keeps hints.

The operations (typed errors; every one that raises has changed nothing):

* :meth:`~BlockPool.allocate` -- fresh blocks, evicting cached free ones;
* :meth:`~BlockPool.lookup` -- how much of a chain is cached (no side effect);
* :meth:`~BlockPool.acquire` -- a reference to each block of a chain's
  longest cached leading run;
* :meth:`~BlockPool.store` -- keep computed full blocks under their chain
  hashes, sharing those cached already: all or nothing, or the leading
  blocks that fit;
* :meth:`~BlockPool.commit`, :meth:`~BlockPool.fill` -- publish a held block
  under its hash, set a held block's payload;
* :meth:`~BlockPool.hold`, :meth:`~BlockPool.retain` -- one more reference to
  blocks in hand, or to blocks named by id that must still hold a hash;
* :meth:`~BlockPool.release` -- drop references;
* :meth:`~BlockPool.evict`, :meth:`~BlockPool.forget` -- drop the content of
  free blocks;
* :meth:`~BlockPool.statistics`, :meth:`~BlockPool.check_invariants`,
  :meth:`~BlockPool.check_references`.

Tiers below the pool (a disk directory, a shared server) plug in at two seams
without a second place that stores or finds blocks: a lookup continues a chain
where :meth:`~BlockPool.acquire` stops (``hashes[len(found):]``) and what it
loads enters through :meth:`~BlockPool.store`, as cached blocks; and
:attr:`Stored.fresh` lists exactly the blocks a store newly committed, which is
what a write-behind queue takes.

The module is synchronous and takes no locks: a pool has one owner at a time.
It never reads the wall clock.
"""

from __future__ import annotations

import logging
import operator
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Optional, Union

import attrs

from mlxkv.cache.block_hash import BlockHash
from mlxkv.cache.blocks import (
    AllocatedBlocks,
    BlockHashToBlockMap,
    CacheBlock,
    FreeKVCacheBlockQueue,
    check_count,
    next_tick,
)
from mlxkv.cache.errors import DoubleFree, InvalidInput, InvariantViolation, OutOfBlocks

__all__ = ["BlockPool", "PoolStatistics", "Stored"]

logger = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class Stored:
    """What :meth:`BlockPool.store` did.

    Attributes:
        blocks: one referenced block per stored hash, in order (a leading
            store may stop early: then fewer than asked).
        fresh: those of them newly committed (their payload was stored),
            in order; the others were cached already and are shared.
        refused: for a leading store that could not keep every block, the
            :class:`OutOfBlocks` the all-or-nothing store would have raised;
            None when every block was stored.
    """

    blocks: tuple[CacheBlock, ...] = attrs.field(eq=False)
    fresh: tuple[CacheBlock, ...] = attrs.field(eq=False)
    refused: Optional[OutOfBlocks] = attrs.field(default=None, eq=False)

    @property
    def num_reused(self) -> int:
        """Stored hashes that were found cached (their given payload dropped)."""
        return len(self.blocks) - len(self.fresh)


@attrs.frozen(kw_only=True)
class PoolStatistics:
    """A snapshot of a :class:`BlockPool`.

    Attributes:
        block_size: tokens per block.
        num_blocks: usable blocks (the null block excluded):
            ``num_referenced + num_reusable + num_empty``.
        num_free: blocks with no reference, cached ones included
            (``num_reusable + num_empty``).
        num_referenced: blocks with at least one reference (held).
        num_cached: distinct hashes cached (held or free).
        num_reusable: blocks with no reference that still hold cached KV: a
            later request that shares their prefix takes them; allocation
            evicts them (least recently released first) only when no empty
            block is left.
        num_hits: blocks found by acquisitions.
        num_misses: acquisitions that stopped before the end of their chain.
        num_evictions: cached blocks whose hash was dropped.
        num_stored: blocks newly committed by :meth:`BlockPool.store`.
        num_reused: blocks :meth:`BlockPool.store` found cached instead of storing.
        num_retained: references added by :meth:`BlockPool.retain`.
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


class BlockPool:
    """Owns a fixed pool of KV blocks, their references, the free queue and the hash map.

    Owns: ``blocks`` (block 0 is ``null_block``, always referenced, never
    freed), their reference counts, ``free_block_queue``,
    ``cached_block_hash_to_block`` (the prefix cache, by parent-chained
    hash), the hashes evicted and not yet taken, and the counters behind
    :meth:`statistics`. ``allocated_blocks`` is a read-only view of the
    blocks with references. The attributes are the pool's to change: read
    them, change them through the operations.

    Invariants:
        - ``free_block_queue.num_free_blocks + len(allocated_blocks) ==
          max_blocks``; the null block counts as allocated.
        - A block is in the free queue iff its ``ref_count`` is 0; the null
          block is never in it; no ``ref_count`` is negative.
        - Every entry of ``cached_block_hash_to_block`` points at a block whose
          ``block_hash`` is the entry's key, and every block with a
          ``block_hash`` is in the map under it.
        - A block taken from the free queue for reuse keeps no hash, legacy
          hash or payload, so it is never served for its old content.

    :meth:`check_invariants` verifies them.
    """

    def __init__(
        self,
        block_size: int = 64,
        max_blocks: int = 1000,
        *,
        caching: bool = True,
        forget_hook: Optional[Callable[[CacheBlock], None]] = None,
    ) -> None:
        """Create ``max_blocks`` blocks of ``block_size`` tokens, all free but the null block.

        Args:
            block_size: tokens per block, > 0.
            max_blocks: blocks in the pool, >= 1 (block 0 is the null block).
            caching: whether committed blocks are published under their hash
                (found by later lookups); without it a commit only stores the
                payload.
            forget_hook: called with a block whose content is dropped while it
                still holds a legacy content hash (``hash_value``), before it
                is cleared, so that an adapter's legacy index stays in step.

        Raises:
            InvalidInput: ``block_size`` or ``max_blocks`` is out of range.
        """
        self.block_size = check_count(block_size, "block_size", minimum=1)
        self.max_blocks = check_count(max_blocks, "max_blocks", minimum=1)
        self.caching = caching
        self._forget_hook = forget_hook
        # Hashes awaiting take_evicted. A seed-only owner never drains it, so
        # it keeps the newest ones only; a hint lost here is merely stale.
        self._evicted: list[BlockHash] = []
        self._evicted_limit = 4 * self.max_blocks + 1024
        self._num_hits = self._num_misses = self._num_evictions = 0
        self._num_stored = self._num_reused = self._num_retained = 0
        self._build()

    def _build(self) -> None:
        self.blocks: list[CacheBlock] = [CacheBlock(block_id=i) for i in range(self.max_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        null_block = self.free_block_queue.popleft()
        null_block.is_null = True
        null_block.ref_count = 1
        self.null_block = null_block
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.allocated_blocks = AllocatedBlocks(self.blocks, self.free_block_queue)

    # -- taking blocks ---------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[CacheBlock]:
        """Take ``num_blocks`` fresh blocks, each with one reference.

        Free blocks are taken least recently freed first; a cached one is
        evicted on the way (it loses its hash, legacy hash, payload and token
        count, and its hash is reported by :meth:`take_evicted`).

        Args:
            num_blocks: how many, >= 0.

        Returns:
            The blocks, unhashed and empty, with ``ref_count == 1``.

        Raises:
            InvalidInput: ``num_blocks`` is not a non-negative int.
            OutOfBlocks: fewer than ``num_blocks`` blocks are free; nothing
                was taken.
        """
        if num_blocks.__class__ is not int or num_blocks < 0:
            num_blocks = check_count(num_blocks, "num_blocks")
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise OutOfBlocks(num_blocks, queue.num_free_blocks)
        blocks = queue.popleft_n(num_blocks)
        self._renew(blocks)
        return blocks

    def allocate_one(self) -> CacheBlock:
        """:meth:`allocate` of one block, returned alone (the hottest path).

        Raises:
            OutOfBlocks: no block is free.
        """
        # The queue's popleft, inlined: one call per block for the seed's
        # allocate_block.
        queue = self.free_block_queue
        head = queue.fake_head
        block = head.next_free_block
        if block is queue.fake_tail:
            raise OutOfBlocks(1, 0)
        following = block.next_free_block
        head.next_free_block = following
        following.prev_free_block = head
        block.prev_free_block = block.next_free_block = None
        queue.num_free_blocks -= 1
        if block.block_hash is not None or block.hash_value is not None:
            self._forget(block)
        block.cache_data = None
        block.token_count = 0
        block.ref_count = 1
        block.last_access = next_tick()
        return block

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        """Count how many leading hashes of a chain are cached right now.

        Changes nothing, not even statistics.

        Args:
            block_hashes: a parent-chained hash sequence.

        Returns:
            The length of the longest cached leading run.
        """
        cache = self.cached_block_hash_to_block._cache
        found = 0
        for block_hash in block_hashes:
            if block_hash not in cache:
                break
            found += 1
        return found

    def is_cached(self, block_hash: BlockHash) -> bool:
        """Whether a block is cached under ``block_hash`` right now."""
        return block_hash in self.cached_block_hash_to_block._cache

    def acquire(self, block_hashes: Sequence[BlockHash]) -> list[CacheBlock]:
        """Take a reference to each block of the longest cached leading run.

        A free cached block leaves the free queue. Each block found counts as
        a hit, and stopping before the end of the chain as one miss.

        Args:
            block_hashes: a parent-chained hash sequence.

        Returns:
            The blocks in chain order, ``blocks[i].block_hash ==
            block_hashes[i]``.
        """
        get_block = self.cached_block_hash_to_block.get_block
        found: list[CacheBlock] = []
        for block_hash in block_hashes:
            block = get_block(block_hash)
            if block is None:
                self._num_misses += 1
                break
            found.append(block)
        self._num_hits += len(found)
        self._reference(found)
        return found

    def store(
        self,
        block_hashes: Sequence[BlockHash],
        payloads: Sequence[Any],
        *,
        leading: bool = False,
    ) -> Stored:
        """Keep one computed full block per hash; the caller holds each.

        A hash cached already is shared (its block gains a reference and the
        given payload is dropped); any other gets a fresh block, committed
        under the hash with its payload. All or nothing -- or, with
        ``leading``, the longest leading run of blocks that fits (a cached
        chain has no gaps, so nothing after a block that does not fit is
        kept).

        Args:
            block_hashes: the blocks' parent-chained hashes, in chain order.
            payloads: one payload per hash.
            leading: keep the leading blocks that fit instead of raising.

        Returns:
            The blocks, which of them are new, and (``leading``) what did not fit.

        Raises:
            InvalidInput: not one payload per hash, or a hash that is not
                bytes; nothing changed.
            OutOfBlocks: without ``leading``, the fresh blocks do not fit;
                nothing changed.
        """
        if len(payloads) != len(block_hashes):
            raise InvalidInput(
                "payloads", len(payloads), f"must be one per hash ({len(block_hashes)})"
            )
        for block_hash in block_hashes:
            if not isinstance(block_hash, bytes):
                raise InvalidInput("hashes", block_hash, "must be BlockHash (bytes)")
        get_block = self.cached_block_hash_to_block.get_block
        found = [get_block(block_hash) for block_hash in block_hashes]
        num_fresh = found.count(None)
        # Reviving a free cached block takes it out of the free queue, so it
        # cannot also be counted as room for a fresh block.
        room = self.free_block_queue.num_free_blocks - sum(
            1 for block in found if block is not None and block.ref_count == 0
        )
        refused = None
        if num_fresh > room:
            refused = OutOfBlocks(num_fresh, max(room, 0))
            if not leading:
                raise refused
            found = found[: self._num_fitting(found)]
            num_fresh = found.count(None)
        # References first: allocation below may evict free cached blocks,
        # and must not evict the ones being shared.
        self._reference([block for block in found if block is not None])
        new = iter(self.allocate(num_fresh))
        size = self.block_size
        kept: list[CacheBlock] = []
        fresh: list[CacheBlock] = []
        for block, block_hash, payload in zip(found, block_hashes, payloads):
            if block is None:
                block = next(new)
                self.commit(block, block_hash, num_tokens=size, cache_data=payload)
                fresh.append(block)
            kept.append(block)
        self._num_stored += len(fresh)
        self._num_reused += len(kept) - len(fresh)
        return Stored(blocks=tuple(kept), fresh=tuple(fresh), refused=refused)

    def _num_fitting(self, found: list[Optional[CacheBlock]]) -> int:
        """How many leading blocks of a store fit: each fresh one takes a free
        block, and so does each cached free one it revives."""
        room = self.free_block_queue.num_free_blocks
        for count, block in enumerate(found):
            if block is None or block.ref_count == 0:
                if room == 0:
                    return count
                room -= 1
        return len(found)

    def commit(
        self,
        block: CacheBlock,
        block_hash: BlockHash,
        *,
        num_tokens: int,
        cache_data: Any = None,
    ) -> None:
        """Publish a held block in the prefix cache under ``block_hash``.

        The block keeps its references; released, it stays cached (and can be
        acquired) until allocation evicts it. A block already cached under the
        same hash stays too. Without ``caching`` the payload and token count
        are stored but nothing is published.

        Args:
            block: a block of this pool with ``ref_count > 0``, not the null
                block, not committed yet.
            block_hash: its parent-chained hash.
            num_tokens: tokens the block holds, in ``1..block_size``.
            cache_data: its KV payload; None keeps the payload it has.

        Raises:
            InvalidInput: any of the above does not hold; nothing changed.
        """
        self._check_held(block)
        if block.block_hash is not None:
            raise InvalidInput("block", block, "is already committed under a hash")
        if not isinstance(block_hash, bytes):
            raise InvalidInput("block_hash", block_hash, "must be a BlockHash (bytes)")
        self._check_num_tokens(num_tokens)
        if cache_data is not None:
            block.cache_data = cache_data
        block.token_count = num_tokens
        block.last_access = next_tick()
        if self.caching:
            block.block_hash = block_hash
            self.cached_block_hash_to_block.insert(block_hash, block)

    def publish(self, blocks: Sequence[CacheBlock], block_hashes: Sequence[BlockHash]) -> None:
        """Publish full blocks under their hashes, whatever they are referenced by.

        The seed's way (``cache_full_blocks``): the blocks need not be held,
        and they keep their payload. Without ``caching`` nothing happens.

        Args:
            blocks: distinct blocks of this pool (not the null block) that hold
                no hash yet.
            block_hashes: one hash per block.

        Raises:
            InvalidInput: a block is foreign, the null block or hashed already;
                nothing changed.
        """
        if not self.caching:
            return
        pool = self.blocks
        size = len(pool)
        for block in blocks:
            if (
                block.__class__ is not CacheBlock
                or not 0 < block.block_id < size
                or pool[block.block_id] is not block
                or block.block_hash is not None
            ):
                self._check_own(block, "blocks")
                raise InvalidInput("blocks", block, "is already committed under a hash")
        cache = self.cached_block_hash_to_block
        entries = cache._cache
        num_tokens = self.block_size
        for block, block_hash in zip(blocks, block_hashes):
            block.block_hash = block_hash
            block.token_count = num_tokens
            if block_hash in entries:
                cache.insert(block_hash, block)
            else:
                entries[block_hash] = block

    def fill(self, block: CacheBlock, cache_data: Any, *, num_tokens: Optional[int] = None) -> None:
        """Set the payload of a held block, and its token count if uncommitted.

        A committed block's tokens are fixed by its hash, so only its payload
        may be replaced, with one for the same tokens (for example the same KV
        plus a recurrent-state snapshot). An uncommitted block is the holder's
        private block (a partial tail) and takes any count.

        Args:
            block: a block of this pool with ``ref_count > 0``, not the null
                block.
            cache_data: the new payload.
            num_tokens: tokens the block holds, in ``1..block_size``; must be
                omitted or unchanged for a committed block.

        Raises:
            InvalidInput: any of the above does not hold; nothing changed.
        """
        self._check_held(block)
        if num_tokens is not None:
            self._check_num_tokens(num_tokens)
            if block.block_hash is not None and num_tokens != block.token_count:
                raise InvalidInput("num_tokens", num_tokens, "a committed block's count is fixed")
            block.token_count = num_tokens
        block.cache_data = cache_data
        block.last_access = next_tick()

    def hold(self, blocks: Iterable[CacheBlock], *, skip_null: bool = False) -> None:
        """Add one reference to each block in hand; free ones leave the free queue.

        Args:
            blocks: blocks of this pool, not the null block.
            skip_null: pass over the null block instead of refusing it.

        Raises:
            InvalidInput: a block is foreign or the null block; nothing changed.
        """
        self._reference(self.own_blocks(blocks, "blocks", skip_null=skip_null))

    def retain(self, pairs: Iterable[tuple[int, BlockHash]]) -> list[CacheBlock]:
        """Add one reference to each named block that still holds the named hash.

        Args:
            pairs: ``(block_id, block_hash)`` of blocks seen holding those hashes.

        Returns:
            The blocks, in order.

        Raises:
            InvalidInput: an item is not such a pair, or its block no longer
                holds its hash (evicted or reused); nothing changed.
        """
        pool = self.blocks
        blocks = []
        for item in pairs:
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
        self._reference(blocks)
        self._num_retained += len(blocks)
        return blocks

    # -- giving blocks back ------------------------------------------------------

    def release(self, blocks: Iterable[Union[CacheBlock, int]], *, skip_null: bool = False) -> int:
        """Drop one reference per listed block (a block listed twice, two).

        A block left with no reference goes to the back of the free queue and
        keeps its hash and payload: it stays cached until it is evicted (a
        block with no hash can never be found again, so its payload is
        dropped now). All or nothing: when an error is raised, nothing has
        changed.

        Args:
            blocks: blocks of this pool, or their ids, in the order they
                should become evictable.
            skip_null: pass over the null block instead of refusing it.

        Returns:
            How many blocks became free.

        Raises:
            InvalidInput: an item is not a block (id) of this pool, or is the
                null block; nothing changed.
            DoubleFree: a block would drop below zero references; nothing
                changed.
        """
        listed = blocks if blocks.__class__ is list else list(blocks)
        if listed and listed[0].__class__ is int:
            # Ids of this pool take the fast path as their blocks; anything
            # odd goes through as given, to be refused with the pool's error.
            pool = self.blocks
            size = len(pool)
            listed = [pool[i] if i.__class__ is int and 0 < i < size else i for i in listed]
        return self._dereference(listed, skip_null=skip_null)

    def release_one(self, block_id: int) -> bool:
        """:meth:`release` of one block, by id (the hottest path).

        Returns:
            Whether it became free.

        Raises:
            InvalidInput: not a block id of this pool, or the null block.
            DoubleFree: the block holds no reference.
        """
        try:
            block = self.blocks[block_id]
        except (IndexError, TypeError):
            raise InvalidInput("block_id", block_id, "is not a block id of this pool") from None
        if block.block_id != block_id or block.is_null:
            raise InvalidInput("block_id", block_id, "is not a block id of this pool (or is the null block)")
        count = block.ref_count
        if count > 1:
            block.ref_count = count - 1
            return False
        if count < 1:
            raise DoubleFree(block_id)
        block.ref_count = 0
        if block.block_hash is None and block.hash_value is None:
            block.cache_data = None  # unfindable once free: see _link_free
        # The queue's append, inlined (see allocate_one).
        queue = self.free_block_queue
        tail = queue.fake_tail
        last = tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = tail
        tail.prev_free_block = block
        queue.num_free_blocks += 1
        return True

    def share(self, block_ids: Iterable[int]) -> list[CacheBlock]:
        """Add one reference to each listed block that is held already, by id.

        The null block is passed over (a seed table may list it). Held blocks
        are in no queue, so sharing them moves nothing.

        Args:
            block_ids: ids of blocks with at least one reference.

        Returns:
            The blocks shared, in order, the null block left out.

        Raises:
            InvalidInput: an id that is not of a held block of this pool;
                nothing changed.
        """
        pool = self.blocks
        blocks: list[CacheBlock] = []
        ident: Any = None
        try:
            for ident in block_ids:
                block = pool[ident]
                if block.ref_count <= 0 or block.block_id != ident:
                    break
                if not block.is_null:
                    blocks.append(block)
            else:
                tick = next_tick()
                for block in blocks:
                    block.ref_count += 1
                    block.last_access = tick
                return blocks
        except (IndexError, TypeError):
            pass
        raise InvalidInput("block_ids", ident, "is not a held block of this pool")

    def evict(self, num_blocks: int) -> int:
        """Drop the cached content of up to ``num_blocks`` free cached blocks.

        Cached free blocks are evicted least recently freed first (their hash,
        legacy hash and payload go; the hashes are reported by
        :meth:`take_evicted`) and stay where they are in the free queue. Free
        blocks that hold no hash are skipped and not counted.

        Args:
            num_blocks: the most to evict, >= 0.

        Returns:
            How many blocks lost their hash.

        Raises:
            InvalidInput: ``num_blocks`` is not a non-negative int.
        """
        num_blocks = check_count(num_blocks, "num_blocks")
        evicted = 0
        queue = self.free_block_queue
        block = queue.fake_head.next_free_block
        while evicted < num_blocks and block is not queue.fake_tail:
            if block.block_hash is not None:
                self._forget(block)
                evicted += 1
            block = block.next_free_block
        if evicted:
            logger.info("evicted %d cached blocks", evicted)
        return evicted

    def forget(self, blocks: Iterable[CacheBlock]) -> None:
        """Drop whatever free blocks still hold (hash, legacy hash, payload).

        They stay where they are in the free queue; their hashes are reported
        by :meth:`take_evicted`.

        Args:
            blocks: free blocks of this pool.

        Raises:
            InvalidInput: a block is foreign, the null block or referenced;
                nothing changed.
        """
        listed = self.own_blocks(blocks, "blocks")
        for block in listed:
            if block.ref_count:
                raise InvalidInput("blocks", block, "is referenced")
        for block in listed:
            if block.block_hash is not None or block.hash_value is not None or block.cache_data is not None:
                self._forget(block)

    def take_evicted(self) -> list[BlockHash]:
        """Drain the hashes that left the prefix cache since the last call.

        A hash is reported once, and only if no block is cached under it any
        more (a duplicate block, or a later commit, keeps it cached). Only the
        newest ``4 * max_blocks + 1024`` evictions are kept between calls.

        Returns:
            The hashes, oldest eviction first.
        """
        evicted, self._evicted = self._evicted, []
        cache = self.cached_block_hash_to_block._cache
        return [block_hash for block_hash in dict.fromkeys(evicted) if block_hash not in cache]

    def reset(self) -> None:
        """Start over with new blocks, nothing referenced and nothing cached.

        Blocks handed out before are no longer blocks of this pool. The
        dropped hashes are reported by :meth:`take_evicted`; counters are kept.
        """
        self._note_evicted(list(self.cached_block_hash_to_block))
        self._build()

    # -- reading -----------------------------------------------------------------

    def statistics(self) -> PoolStatistics:
        """A snapshot of the pool and its counters (O(blocks))."""
        queue = self.free_block_queue
        return PoolStatistics(
            block_size=self.block_size,
            num_blocks=self.max_blocks - 1,
            num_free=queue.num_free_blocks,
            num_referenced=self.max_blocks - 1 - queue.num_free_blocks,
            num_cached=len(self.cached_block_hash_to_block),
            num_reusable=sum(
                1 for block in self.blocks if block.ref_count == 0 and block.block_hash is not None
            ),
            num_hits=self._num_hits,
            num_misses=self._num_misses,
            num_evictions=self._num_evictions,
            num_stored=self._num_stored,
            num_reused=self._num_reused,
            num_retained=self._num_retained,
        )

    def check_invariants(self) -> None:
        """Verify every invariant listed in the class docstring.

        Raises:
            InvariantViolation: naming the first block or hash found wrong.
        """
        blocks = self.blocks
        queued = self._check_queue()
        allocated = self.allocated_blocks
        if len(queued) + len(allocated) != self.max_blocks:
            raise InvariantViolation(
                f"free {len(queued)} + allocated {len(allocated)} != total {self.max_blocks}"
            )
        if blocks[0] is not self.null_block or not self.null_block.is_null:
            raise InvariantViolation("block 0 is not the null block")
        cache = self.cached_block_hash_to_block
        for block in blocks:
            ident = block.block_id
            if block.ref_count < 0:
                raise InvariantViolation(f"block {ident} has ref_count {block.ref_count}")
            if (block.ref_count == 0) != (ident in queued):
                raise InvariantViolation(
                    f"block {ident} has ref_count {block.ref_count} but queued={ident in queued}"
                )
            if block.is_null != (ident == 0):
                raise InvariantViolation(f"block {ident} has is_null={block.is_null}")
            if block.block_hash is not None and block not in cache.blocks(block.block_hash):
                raise InvariantViolation(f"block {ident} holds a hash but is not in the hash map")
        for block_hash in cache:
            for block in cache.blocks(block_hash):
                if block.block_hash != block_hash or blocks[block.block_id] is not block:
                    raise InvariantViolation(
                        f"hash map entry {block_hash.hex()[:12]} points at block"
                        f" {block.block_id}, which does not hold it"
                    )

    def check_references(self, expected: Mapping[int, int]) -> list[str]:
        """Compare every block's reference count with the references its
        holders list (block id -> count; a block not listed is held by none).

        Returns:
            One line per block whose count differs (empty when all agree).
        """
        wanted = Counter(expected)
        mismatches = []
        for block in self.blocks:
            held = wanted.get(block.block_id, 0)
            if not block.is_null and block.ref_count != held:
                mismatches.append(
                    f"block {block.block_id} has ref_count {block.ref_count}, its holders list {held}"
                )
        return mismatches

    def _check_queue(self) -> set[int]:
        """Walk the free queue checking its links; return the queued block ids."""
        queue = self.free_block_queue
        blocks = self.blocks
        queued: set[int] = set()
        previous = queue.fake_head
        block = previous.next_free_block
        while block is not queue.fake_tail:
            if block is None:
                raise InvariantViolation(f"free queue ends after block {previous.block_id}")
            ident = block.block_id
            if block.prev_free_block is not previous:
                raise InvariantViolation(f"block {ident}: prev_free_block disagrees with the queue")
            if not 0 <= ident < len(blocks) or blocks[ident] is not block:
                raise InvariantViolation(f"block {ident} in the free queue is not of this pool")
            if ident in queued:
                raise InvariantViolation(f"block {ident} is in the free queue twice")
            queued.add(ident)
            previous, block = block, block.next_free_block
        if queue.fake_tail.prev_free_block is not previous:
            raise InvariantViolation("fake_tail.prev_free_block is not the last queued block")
        if len(queued) != queue.num_free_blocks:
            raise InvariantViolation(
                f"free queue holds {len(queued)} blocks, num_free_blocks is {queue.num_free_blocks}"
            )
        return queued

    # -- checking arguments --------------------------------------------------------

    def own_block(self, item: Union[CacheBlock, int], argument: str) -> CacheBlock:
        """``item`` (a block or a block id) as a block of this pool other than the null block.

        Raises:
            InvalidInput: it is not one.
        """
        if isinstance(item, CacheBlock):
            return self._check_own(item, argument)
        try:
            ident = -1 if isinstance(item, bool) else operator.index(item)
        except TypeError:
            ident = -1
        if 0 <= ident < self.max_blocks:
            return self._check_own(self.blocks[ident], argument)
        raise InvalidInput(argument, item, "is not a block id of this pool")

    def own_blocks(
        self, items: Iterable[Union[CacheBlock, int]], argument: str, *, skip_null: bool = False
    ) -> list[CacheBlock]:
        """``items`` as blocks of this pool (ids resolved), or InvalidInput.

        ``skip_null`` drops the null block instead of rejecting it.
        """
        listed = list(items)
        pool = self.blocks
        try:
            for block in listed:
                if pool[block.block_id] is not block or block.is_null:
                    break
            else:
                return listed
        except (AttributeError, IndexError, TypeError):
            pass
        null_block = self.null_block
        return [
            self.own_block(item, argument)
            for item in listed
            if not (skip_null and item is null_block)
        ]

    def _check_own(self, block: object, argument: str) -> CacheBlock:
        if not isinstance(block, CacheBlock):
            raise InvalidInput(argument, block, "is not a CacheBlock")
        ident = block.block_id
        if not (0 <= ident < self.max_blocks and self.blocks[ident] is block):
            raise InvalidInput(argument, block, "is not a block of this pool")
        if block.is_null:
            raise InvalidInput(argument, block, "is the null block")
        return block

    def _check_held(self, block: CacheBlock) -> None:
        self._check_own(block, "block")
        if block.ref_count <= 0:
            raise InvalidInput("block", block, "is not held (ref_count is 0)")

    def _check_num_tokens(self, num_tokens: Any) -> None:
        if num_tokens.__class__ is not int or not 0 < num_tokens <= self.block_size:
            raise InvalidInput("num_tokens", num_tokens, f"must be an int in 1..{self.block_size}")

    # -- state changes -------------------------------------------------------------

    def _renew(self, blocks: Iterable[CacheBlock]) -> None:
        """Turn blocks just taken from the free queue into fresh, referenced ones."""
        tick = next_tick()
        for block in blocks:
            if block.block_hash is not None or block.hash_value is not None:
                self._forget(block)
            block.cache_data = None
            block.token_count = 0
            block.ref_count = 1
            block.last_access = tick

    def _reference(self, blocks: list[CacheBlock]) -> None:
        """Add one reference to each block, taking free ones out of the queue."""
        tick = next_tick()
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.ref_count == 0:
                remove(block)
            block.ref_count += 1
            block.last_access = tick

    def _dereference(
        self, blocks: Sequence[Union[CacheBlock, int]], *, skip_null: bool = False
    ) -> int:
        """Drop one reference per listed block, all or nothing.

        Items that are not blocks of this pool (ids included) are resolved on
        a slower second pass. The null block is rejected, or skipped when
        ``skip_null`` is set.

        Returns:
            How many blocks became free.

        Raises:
            InvalidInput: an item is not a block (id) of this pool, or is the
                null block; every count is restored.
            DoubleFree: a block had no reference left; every count is restored.
        """
        pool = self.blocks
        freed: list[CacheBlock] = []
        position = 0
        try:
            for position, block in enumerate(blocks):
                if pool[block.block_id] is not block:
                    break
                if block.is_null:
                    if skip_null:
                        continue
                    break
                count = block.ref_count
                if count > 1:
                    block.ref_count = count - 1
                elif count == 1:
                    block.ref_count = 0
                    freed.append(block)
                else:
                    _restore(blocks, position)
                    raise DoubleFree(block.block_id)
            else:
                self._link_free(freed)
                return len(freed)
        except (AttributeError, IndexError, TypeError):
            pass
        _restore(blocks, position)
        null_block = self.null_block
        return self._dereference(
            [
                self.own_block(item, "blocks")
                for item in blocks
                if not (skip_null and item is null_block)
            ]
        )

    def _link_free(self, freed: list[CacheBlock]) -> None:
        """Queue blocks whose last reference just went.

        A block without a hash can never be looked up again, so its payload
        is dropped now rather than when the block is reused: a released
        private (partial) block must not hold KV memory.
        """
        for block in freed:
            if block.block_hash is None and block.hash_value is None:
                block.cache_data = None
        self.free_block_queue._link_n(freed)

    def _forget(self, block: CacheBlock) -> None:
        """Drop every index entry of ``block``, and its payload."""
        block_hash = block.block_hash
        if block_hash is not None:
            cache = self.cached_block_hash_to_block
            if cache.pop(block_hash, block.block_id) is not None:
                self._num_evictions += 1
                if block_hash not in cache._cache:
                    self._note_evicted((block_hash,))
            block.block_hash = None
        if block.hash_value is not None:
            if self._forget_hook is not None:
                self._forget_hook(block)
            block.hash_value = None
        block.cache_data = None

    def _note_evicted(self, hashes: Sequence[BlockHash]) -> None:
        evicted = self._evicted
        evicted.extend(hashes)
        if len(evicted) > self._evicted_limit:
            del evicted[: len(evicted) - self._evicted_limit // 2]


def _restore(blocks: Sequence[Any], stop: int) -> None:
    """Give back the reference just taken from each of ``blocks[:stop]``.

    Those are all blocks of the pool; the null block among them was skipped,
    not released, so it gets nothing back.
    """
    for block in blocks[:stop]:
        if not block.is_null:
            block.ref_count += 1
