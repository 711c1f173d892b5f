"""Paged KV blocks: allocation, reference counts, prefix caching, copy-on-write.

The seed-compatible API of vllm-mlx 0.6.0's ``paged_cache`` (same names,
signatures, defaults, return values and statistics), built on a small typed
core that the actor layer calls:

* :meth:`PagedCacheManager.allocate` -- fresh blocks, all or nothing.
* :meth:`PagedCacheManager.lookup` -- how much of a hash chain is cached.
* :meth:`PagedCacheManager.acquire` -- take references to cached blocks.
* :meth:`PagedCacheManager.commit` -- publish a held block under its hash.
* :meth:`PagedCacheManager.release` -- drop references.
* :meth:`PagedCacheManager.evict` -- drop free cached blocks' content, LRU first.
* :meth:`PagedCacheManager.take_evicted` -- hashes that left the cache.

Every block whose reference count is zero sits in one free queue, ordered by
when it was freed. A free block that still holds a hash is a cached block: it
can be acquired again until allocation pops it, and only then is its hash
dropped (lazy eviction, as in vLLM v1). A hit is always exact: blocks are found
by parent-chained hashes only.

The module is synchronous and takes no locks: a manager has one owner at a
time. It never reads the wall clock; ``last_access`` is a logical tick.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import logging
import operator
import sys
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from mlxkv.cache.block_hash import BlockHash, compute_block_hash, hash_block_chain
from mlxkv.cache.errors import (
    DoubleFree,
    DuplicateRequest,
    InvalidInput,
    InvariantViolation,
    OutOfBlocks,
)

__all__ = [
    "BlockHash",
    "BlockHashToBlockMap",
    "BlockTable",
    "CacheBlock",
    "CacheStats",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "PagedCacheManager",
    "compute_block_hash",
]

logger = logging.getLogger(__name__)

#: The logical clock behind ``CacheBlock.last_access``: larger is more recent.
_next_tick = itertools.count(1).__next__

_SWAP_TO_BIG_ENDIAN = sys.byteorder == "little"
_IMMUTABLE_LEAVES = (type(None), bool, int, float, complex, str, bytes)


@dataclass(eq=False, slots=True)
class CacheBlock:
    """One physical block: metadata, links in the free queue, and its KV payload.

    Blocks compare by identity: two blocks are the same block only if they are
    the same object (field-wise equality would walk the free-queue links).

    Attributes:
        block_id: index of the block in its manager, or < 0 for queue sentinels.
        ref_count: number of holders; 0 means the block is in the free queue.
        block_hash: parent-chained hash under which the block is cached, if any.
        prev_free_block: previous block in the free queue (None when not queued).
        next_free_block: next block in the free queue (None when not queued).
        is_null: True for the manager's placeholder block, which is never freed.
        cache_data: the KV payload, typically one ``(keys, values)`` per layer.
        token_count: number of tokens the payload covers.
        hash_value: legacy content-only hash (16 hex), if registered.
        last_access: logical tick of the last allocation, hit or touch.

    Invariants:
        - ``prev_free_block`` and ``next_free_block`` are both set or both None.
        - ``ref_count >= 0``.
    """

    block_id: int
    ref_count: int = 0
    block_hash: Optional[BlockHash] = None
    prev_free_block: Optional[CacheBlock] = None
    next_free_block: Optional[CacheBlock] = None
    is_null: bool = False
    cache_data: Optional[Any] = None
    token_count: int = 0
    hash_value: Optional[str] = None
    last_access: float = field(default_factory=_next_tick)

    def is_full(self, block_size: int) -> bool:
        """Whether the block holds ``block_size`` tokens or more.

        Args:
            block_size: tokens per block.

        Returns:
            True if the block is full.
        """
        return self.token_count >= block_size

    def is_shared(self) -> bool:
        """Whether more than one holder references the block.

        Returns:
            True if ``ref_count > 1``.
        """
        return self.ref_count > 1

    def reset_hash(self) -> None:
        """Forget both the chained and the legacy hash of the block."""
        self.block_hash = None
        self.hash_value = None

    def touch(self) -> None:
        """Stamp the block with the next logical tick."""
        self.last_access = _next_tick()

    def __repr__(self) -> str:
        prev_block = self.prev_free_block
        next_block = self.next_free_block
        return (
            f"CacheBlock(id={self.block_id}, ref={self.ref_count}, "
            f"tokens={self.token_count}, hashed={self.block_hash is not None}, "
            f"prev={None if prev_block is None else prev_block.block_id}, "
            f"next={None if next_block is None else next_block.block_id})"
        )


KVCacheBlock = CacheBlock


class FreeKVCacheBlockQueue:
    """An intrusive doubly linked list of free blocks with O(1) updates.

    The links live in the blocks themselves (``prev_free_block`` and
    ``next_free_block``), so removing a block from the middle allocates nothing.
    Two sentinels, ``fake_head`` and ``fake_tail``, are never removed.

    Ordering: blocks are kept in the order in which they became free. The front
    holds the block freed longest ago, which is taken first by :meth:`popleft`
    (and so evicted first if it is cached); :meth:`append` puts a block freed
    now at the back. :meth:`remove` takes a block out of the middle when a
    cache hit revives it, leaving the order of the others unchanged.

    Invariants:
        - Following ``next_free_block`` from ``fake_head`` reaches ``fake_tail``
          after exactly ``num_free_blocks`` blocks, and ``prev_free_block``
          mirrors every step.
        - A block is in the queue iff its links are set.
    """

    def __init__(self, blocks: list[CacheBlock]) -> None:
        """Queue ``blocks``, in order, front to back.

        Args:
            blocks: the blocks that start out free; their links are overwritten.
        """
        self.fake_head = CacheBlock(block_id=-1)
        self.fake_tail = CacheBlock(block_id=-2)
        self.num_free_blocks = len(blocks)
        previous = self.fake_head
        for block in blocks:
            previous.next_free_block = block
            block.prev_free_block = previous
            previous = block
        previous.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = previous

    def popleft(self) -> CacheBlock:
        """Take the block at the front (freed longest ago).

        Returns:
            The block, unlinked.

        Raises:
            OutOfBlocks: the queue is empty (a ``ValueError``).
        """
        block = self.fake_head.next_free_block
        if block is self.fake_tail or block is None:
            raise OutOfBlocks(1, 0)
        following = block.next_free_block
        self.fake_head.next_free_block = following
        following.prev_free_block = self.fake_head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[CacheBlock]:
        """Take ``n`` blocks from the front, in queue order.

        Args:
            n: how many blocks, >= 0.

        Returns:
            The blocks, unlinked.

        Raises:
            InvalidInput: ``n`` is negative.
            OutOfBlocks: fewer than ``n`` blocks are queued (a ``ValueError``).
        """
        if n <= 0:
            if n < 0:
                raise InvalidInput("n", n, "must be >= 0")
            return []
        if n > self.num_free_blocks:
            raise OutOfBlocks(n, self.num_free_blocks)
        taken: list[CacheBlock] = []
        append = taken.append
        block = self.fake_head.next_free_block
        for _ in range(n):
            append(block)
            following = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = following
        self.fake_head.next_free_block = block
        block.prev_free_block = self.fake_head
        self.num_free_blocks -= n
        return taken

    def remove(self, block: CacheBlock) -> None:
        """Unlink ``block`` from wherever it is in the queue.

        Args:
            block: a queued block.

        Raises:
            RuntimeError: ``block`` is not in the queue.
        """
        before = block.prev_free_block
        after = block.next_free_block
        if before is None or after is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        before.next_free_block = after
        after.prev_free_block = before
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: CacheBlock) -> None:
        """Put ``block`` at the back (freed most recently).

        Args:
            block: a block that is in no queue.

        Raises:
            RuntimeError: ``block`` is already queued.
        """
        if block.prev_free_block is not None:
            raise RuntimeError(f"block {block.block_id} is already in the free queue")
        tail = self.fake_tail
        last = tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = tail
        tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: list[CacheBlock]) -> None:
        """Put ``blocks`` at the back, in order (the last one ends up last).

        Args:
            blocks: distinct blocks that are in no queue.

        Raises:
            RuntimeError: one of the blocks is already queued; nothing changed.
        """
        for block in blocks:
            if block.prev_free_block is not None:
                raise RuntimeError(f"block {block.block_id} is already in the free queue")
        self._link_n(blocks)

    def _link_n(self, blocks: Sequence[CacheBlock]) -> None:
        """:meth:`append_n` for blocks known to be in no queue."""
        if not blocks:
            return
        tail = self.fake_tail
        last = tail.prev_free_block
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
        last.next_free_block = tail
        tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[CacheBlock]:
        """List the queued blocks, front to back.

        Returns:
            A new list; the queue is unchanged.
        """
        found: list[CacheBlock] = []
        tail = self.fake_tail
        block = self.fake_head.next_free_block
        while block is not tail and block is not None:
            found.append(block)
            block = block.next_free_block
        return found


class BlockHashToBlockMap:
    """The prefix cache's index: block hash -> the blocks cached under it.

    Entries are append-only: when a second block is committed under a hash that
    is already present (two requests computed the same block at once), both stay
    until each is evicted, rather than merging or replacing one.

    Invariants:
        - A key maps to one block, or to a dict of two or more blocks keyed by
          ``block_id``; never to an empty dict.
    """

    def __init__(self) -> None:
        self._cache: dict[BlockHash, Union[CacheBlock, dict[int, CacheBlock]]] = {}

    def get_block(self, block_hash: BlockHash) -> Optional[CacheBlock]:
        """Find a block cached under ``block_hash``.

        When several are, one that is referenced is preferred, so that a hit
        shares it rather than reviving a free duplicate.

        Args:
            block_hash: the chained hash.

        Returns:
            A block, or None if nothing is cached under the hash.
        """
        entry = self._cache.get(block_hash)
        if entry is None or entry.__class__ is not dict:
            return entry
        fallback = None
        for block in entry.values():
            if block.ref_count > 0:
                return block
            fallback = fallback or block
        return fallback

    def insert(self, block_hash: BlockHash, block: CacheBlock) -> None:
        """Add ``block`` under ``block_hash``, keeping any block already there.

        Args:
            block_hash: the chained hash.
            block: the block that holds the content.
        """
        entry = self._cache.get(block_hash)
        if entry is None:
            self._cache[block_hash] = block
        elif entry.__class__ is dict:
            entry[block.block_id] = block
        elif entry is not block:
            pair = {entry.block_id: entry, block.block_id: block}
            self._cache[block_hash] = pair

    def pop(self, block_hash: BlockHash, block_id: int) -> Optional[CacheBlock]:
        """Remove the block ``block_id`` from under ``block_hash``.

        Args:
            block_hash: the chained hash.
            block_id: which of the blocks cached under it.

        Returns:
            The removed block, or None if it was not cached under the hash.
        """
        entry = self._cache.get(block_hash)
        if entry is None:
            return None
        if entry.__class__ is not dict:
            if entry.block_id != block_id:
                return None
            del self._cache[block_hash]
            return entry
        block = entry.pop(block_id, None)
        if len(entry) == 1:
            (self._cache[block_hash],) = entry.values()
        return block

    def blocks(self, block_hash: BlockHash) -> list[CacheBlock]:
        """List every block cached under ``block_hash``.

        Args:
            block_hash: the chained hash.

        Returns:
            A new list, empty when the hash is not cached.
        """
        entry = self._cache.get(block_hash)
        if entry is None:
            return []
        if entry.__class__ is dict:
            return list(entry.values())
        return [entry]

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._cache

    def __iter__(self):
        return iter(self._cache)

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        """Forget every entry."""
        self._cache.clear()


@dataclass(slots=True)
class BlockTable:
    """The blocks of one request, in token order.

    The table owns one reference to each block it lists (the manager's
    ``fork_block_table`` and ``delete_block_table`` keep it that way).

    Attributes:
        request_id: the request this table belongs to.
        block_ids: physical block ids, in token order.
        num_tokens: tokens covered by the blocks.

    Invariants:
        - ``num_tokens`` is the sum of the tokens added with the blocks.
    """

    request_id: str
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0

    def add_block(self, block_id: int, num_tokens: int) -> None:
        """Append a block that covers ``num_tokens`` tokens.

        Args:
            block_id: the physical block.
            num_tokens: tokens stored in it.
        """
        self.block_ids.append(block_id)
        self.num_tokens += num_tokens

    def __len__(self) -> int:
        return len(self.block_ids)

    def copy(self, new_request_id: str) -> BlockTable:
        """A table for ``new_request_id`` that lists the same blocks.

        Args:
            new_request_id: the request of the copy.

        Returns:
            A new table with its own list of block ids.
        """
        return BlockTable(new_request_id, list(self.block_ids), self.num_tokens)


@dataclass
class CacheStats:
    """Counters and gauges of a :class:`PagedCacheManager`.

    The gauges (``total_blocks``, ``allocated_blocks``, ``free_blocks``,
    ``shared_blocks``, ``total_tokens_cached``) are derived from the manager's
    state by ``get_stats``; the counters (``cache_hits``, ``cache_misses``,
    ``cow_copies``, ``evictions``) count events until ``reset_stats``.

    Attributes:
        total_blocks: blocks managed, the null block included.
        allocated_blocks: referenced blocks, the null block included.
        free_blocks: blocks in the free queue, cached ones included.
        shared_blocks: blocks with more than one reference.
        total_tokens_cached: tokens of the blocks that request tables list
            (``add_block_to_table``, forks...), each block counted once,
            the null block excluded; as in the seed, blocks held outside
            any table do not count.
        cache_hits: blocks found by prefix lookups.
        cache_misses: prefix lookups that stopped at a block not found.
        cow_copies: blocks copied on write.
        evictions: cached blocks whose hash was dropped.

    Invariants:
        - ``total_blocks == allocated_blocks + free_blocks`` whenever the
          gauges are fresh (the manager's ``stats`` and ``get_stats``).
        - No counter is negative.
    """

    total_blocks: int = 0
    allocated_blocks: int = 0
    free_blocks: int = 0
    shared_blocks: int = 0
    total_tokens_cached: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cow_copies: int = 0
    evictions: int = 0


class _AllocatedBlocks(Mapping[int, CacheBlock]):
    """A read-only, live view: block id -> block, for blocks with references.

    It owns nothing: it is derived from the reference counts rather than kept
    beside them, so it costs nothing to maintain.

    Invariants:
        - ``block_id in view`` iff ``blocks[block_id].ref_count > 0``.
        - ``len(view) == len(blocks) - queue.num_free_blocks``.
    """

    __slots__ = ("_blocks", "_queue")

    def __init__(self, blocks: list[CacheBlock], queue: FreeKVCacheBlockQueue) -> None:
        self._blocks = blocks
        self._queue = queue

    def get(self, block_id: object, default: Any = None) -> Any:
        try:
            block = self._blocks[block_id]
        except (IndexError, TypeError):
            return default
        if block.ref_count <= 0 or block.block_id != block_id:
            return default
        return block

    def __getitem__(self, block_id: int) -> CacheBlock:
        block = self.get(block_id)
        if block is None:
            raise KeyError(block_id)
        return block

    def __contains__(self, block_id: object) -> bool:
        return self.get(block_id) is not None

    def __len__(self) -> int:
        return len(self._blocks) - self._queue.num_free_blocks

    def __iter__(self) -> Iterator[int]:
        return (block.block_id for block in self._blocks if block.ref_count > 0)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({sorted(self)})"


class PagedCacheManager:
    """Owns a fixed pool of KV blocks and everything that points into it.

    It owns the blocks (``blocks``), their reference counts, the free queue
    (``free_block_queue``), the prefix cache (``cached_block_hash_to_block``,
    by parent-chained hash; plus the legacy content-only ``hash_to_block``),
    the per-request block tables (``request_tables``) and the statistics
    (``stats``). ``allocated_blocks`` is a read-only view of the blocks with
    references. Block 0 is the null block, a placeholder that is always
    referenced and never freed.

    The typed core (``allocate``, ``lookup``, ``acquire``, ``commit``,
    ``release``, ``evict``, ``take_evicted``) raises typed errors. The seed
    methods are adapters over it that keep the seed's return values: where the seed
    returns ``None`` or ``False`` on failure, so do they, and log a warning.

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
        - Every block id in a request table is allocated, and no block is
          listed by more tables than its ``ref_count`` (the null block aside).
        - The memo of chain hashes holds only true hashes of its keys.

    :meth:`check_invariants` verifies them.
    """

    def __init__(
        self,
        block_size: int = 64,
        max_blocks: int = 1000,
        enable_caching: bool = True,
    ) -> None:
        """Create ``max_blocks`` blocks of ``block_size`` tokens, all free but one.

        Args:
            block_size: tokens per block, > 0.
            max_blocks: blocks in the pool, >= 1 (block 0 is the null block).
            enable_caching: whether full blocks are shared by prefix hash.

        Raises:
            InvalidInput: ``block_size`` or ``max_blocks`` is out of range.
        """
        self.block_size = _count(block_size, "block_size", minimum=1)
        self.max_blocks = _count(max_blocks, "max_blocks", minimum=1)
        self.enable_caching = enable_caching
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.request_tables: dict[str, BlockTable] = {}
        self.hash_to_block: dict[str, int] = {}
        # (parent hash, block token bytes) -> block hash: a memo of the pure
        # chain function, so repeated prefix lookups do not hash again.
        self._chain_memo: dict[tuple[Optional[BlockHash], bytes], BlockHash] = {}
        self._chain_memo_limit = 4 * self.max_blocks + 1024
        # Hashes awaiting take_evicted. Seed-only users never drain it, so it
        # keeps the newest ones only; a hint lost here is merely a stale hint.
        self._evicted: list[BlockHash] = []
        self._evicted_limit = 4 * self.max_blocks + 1024
        self._build_pool()

    def _build_pool(self) -> None:
        self.blocks: list[CacheBlock] = [CacheBlock(block_id=i) for i in range(self.max_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        null_block = self.free_block_queue.popleft()
        null_block.is_null = True
        null_block.ref_count = 1
        self.null_block = null_block
        self.allocated_blocks = _AllocatedBlocks(self.blocks, self.free_block_queue)
        self._stats = CacheStats(total_blocks=self.max_blocks)

    # The typed core.

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
            num_blocks = _count(num_blocks, "num_blocks")
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise OutOfBlocks(num_blocks, queue.num_free_blocks)
        blocks = queue.popleft_n(num_blocks)
        self._renew(blocks)
        return blocks

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

    def acquire(self, block_hashes: Sequence[BlockHash]) -> list[CacheBlock]:
        """Take a reference to each block of the longest cached leading run.

        A free cached block leaves the free queue. Each block found counts as a
        cache hit, and stopping before the end of the chain as one miss.

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
                self._stats.cache_misses += 1
                break
            found.append(block)
        self._stats.cache_hits += len(found)
        self._reference(found)
        return found

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
        same hash stays too. With caching disabled, the payload and token
        count are stored but nothing is published.

        Args:
            block: a block of this manager with ``ref_count > 0``, not the null
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
        block.last_access = _next_tick()
        if self.enable_caching:
            block.block_hash = block_hash
            self.cached_block_hash_to_block.insert(block_hash, block)

    def fill(self, block: CacheBlock, cache_data: Any, *, num_tokens: Optional[int] = None) -> None:
        """Set the payload of a held block, and its token count if uncommitted.

        A committed block's tokens are fixed by its hash, so only its payload
        may be replaced, with one for the same tokens (for example the same KV
        plus a recurrent-state snapshot). An uncommitted block is the holder's
        private block (a partial tail) and takes any count.

        Args:
            block: a block of this manager with ``ref_count > 0``, not the null
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
        block.last_access = _next_tick()

    def _check_held(self, block: CacheBlock) -> None:
        self._check_own(block, "block")
        if block.ref_count <= 0:
            raise InvalidInput("block", block, "is not held (ref_count is 0)")

    def _check_num_tokens(self, num_tokens: Any) -> None:
        if num_tokens.__class__ is not int or not 0 < num_tokens <= self.block_size:
            raise InvalidInput("num_tokens", num_tokens, f"must be an int in 1..{self.block_size}")

    def release(self, blocks: Iterable[Union[CacheBlock, int]]) -> None:
        """Drop one reference per listed block (a block listed twice, two).

        A block left with no reference goes to the back of the free queue and
        keeps its hash and payload: it stays cached until it is evicted.
        All or nothing: when an error is raised, nothing has changed.

        Args:
            blocks: blocks of this manager, or their ids, in the order they
                should become evictable.

        Raises:
            InvalidInput: an item is not a block (id) of this manager, or is
                the null block; nothing changed.
            DoubleFree: a block would drop below zero references; nothing
                changed.
        """
        self._dereference(blocks if blocks.__class__ is list else list(blocks))

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
        num_blocks = _count(num_blocks, "num_blocks")
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

    def check_invariants(self) -> None:
        """Verify every invariant listed in the class docstring.

        Raises:
            InvariantViolation: naming the first block, hash or table found wrong.
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
        for key, ident in self.hash_to_block.items():
            if blocks[ident].hash_value != key:
                raise InvariantViolation(
                    f"legacy hash {key} points at block {ident}, which lacks it"
                )
        for (parent, raw), block_hash in self._chain_memo.items():
            tokens = array("I")
            tokens.frombytes(raw)
            if hash_block_chain(tokens, self.block_size, parent_hash=parent) != [block_hash]:
                raise InvariantViolation(f"chain memo holds a wrong hash {block_hash.hex()[:12]}")
        listed: Counter[int] = Counter()
        for request_id, table in self.request_tables.items():
            for ident in table.block_ids:
                if ident not in allocated:
                    raise InvariantViolation(
                        f"table {request_id!r} lists unallocated block {ident}"
                    )
                listed[ident] += 1
        for ident, count in listed.items():
            block = blocks[ident]
            if count > block.ref_count and not block.is_null:
                raise InvariantViolation(
                    f"block {ident} is listed {count} times in tables but has"
                    f" ref_count {block.ref_count}"
                )

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

    # Internals shared by the core and the seed adapters.

    def _check_own(self, block: object, argument: str) -> CacheBlock:
        if not isinstance(block, CacheBlock):
            raise InvalidInput(argument, block, "is not a CacheBlock")
        ident = block.block_id
        if not (0 <= ident < self.max_blocks and self.blocks[ident] is block):
            raise InvalidInput(argument, block, "is not a block of this manager")
        if block.is_null:
            raise InvalidInput(argument, block, "is the null block")
        return block

    def _resolve(self, item: Union[CacheBlock, int], argument: str) -> CacheBlock:
        if isinstance(item, CacheBlock):
            return self._check_own(item, argument)
        try:
            ident = -1 if isinstance(item, bool) else operator.index(item)
        except TypeError:
            ident = -1
        if 0 <= ident < self.max_blocks:
            return self._check_own(self.blocks[ident], argument)
        raise InvalidInput(argument, item, "is not a block id of this manager")

    def _own_blocks(
        self, items: Iterable[Union[CacheBlock, int]], argument: str, *, skip_null: bool = False
    ) -> list[CacheBlock]:
        """``items`` as blocks of this manager (ids resolved), or InvalidInput.

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
            self._resolve(item, argument)
            for item in listed
            if not (skip_null and item is null_block)
        ]

    def _listed_blocks(self, table: BlockTable) -> list[CacheBlock]:
        """The allocated blocks ``table`` lists, in order, the null block left out.

        Raises:
            InvalidInput: the table lists an id that is not allocated.
        """
        pool = self.blocks
        listed: list[CacheBlock] = []
        ident: Any = None
        try:
            for ident in table.block_ids:
                block = pool[ident]
                if block.ref_count <= 0 or block.block_id != ident:
                    break
                if not block.is_null:
                    listed.append(block)
            else:
                return listed
        except (IndexError, TypeError):
            pass
        raise InvalidInput("table", table.request_id, f"lists unallocated block {ident!r}")

    def _renew(self, blocks: Iterable[CacheBlock]) -> None:
        """Turn blocks just taken from the free queue into fresh, referenced ones."""
        tick = _next_tick()
        for block in blocks:
            if block.block_hash is not None or block.hash_value is not None:
                self._forget(block)
            block.cache_data = None
            block.token_count = 0
            block.ref_count = 1
            block.last_access = tick

    def _reference(self, blocks: list[CacheBlock]) -> None:
        """Add one reference to each block, taking free ones out of the queue."""
        tick = _next_tick()
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

        Items that are not blocks of this manager (ids included) are resolved
        on a slower second pass. The null block is rejected, or skipped when
        ``skip_null`` is set.

        Returns:
            How many blocks became free.

        Raises:
            InvalidInput: an item is not a block (id) of this manager, or is
                the null block; every count is restored.
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
                self._resolve(item, "blocks")
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
                self._stats.evictions += 1
                if block_hash not in cache._cache:
                    self._evicted.append(block_hash)
                    if len(self._evicted) > self._evicted_limit:
                        self._trim_evicted()
            block.block_hash = None
        legacy = block.hash_value
        if legacy is not None:
            if self.hash_to_block.get(legacy) == block.block_id:
                del self.hash_to_block[legacy]
            block.hash_value = None
        block.cache_data = None

    def _match_tokens(self, token_ids: Sequence[int], *, held_only: bool) -> list[CacheBlock]:
        """The cached blocks of the longest cached prefix of ``token_ids``.

        Walks the chain block by block and stops at the first miss. Tokens are
        converted in chunks that double in size, and each block is hashed at
        most once (not at all when the memo knows it), so the work is linear
        in the matched prefix, not in the prompt.
        """
        size = self.block_size
        num_full = len(token_ids) // size
        width = 4 * size
        memo = self._chain_memo
        cache = self.cached_block_hash_to_block
        entries = cache._cache
        matched: list[CacheBlock] = []
        parent: Optional[BlockHash] = None
        start = 0
        step = 4
        while start < num_full:
            stop = min(start + step, num_full)
            data = _token_array(token_ids[start * size : stop * size], (stop - start) * size)
            raw = data.tobytes()
            for offset in range(0, len(raw), width):
                key = (parent, raw[offset : offset + width])
                block_hash = memo.get(key)
                if block_hash is None:
                    block_hash = self._remember_chain(data, raw, offset, parent)
                block = entries.get(block_hash)
                if block is None:
                    return matched
                if block.__class__ is dict:
                    block = cache.get_block(block_hash)
                if held_only and block.ref_count == 0:
                    return matched
                matched.append(block)
                parent = block_hash
            start = stop
            step *= 2
        return matched

    def _remember_chain(
        self, data: array, raw: bytes, offset: int, parent: Optional[BlockHash]
    ) -> BlockHash:
        """Hash the blocks of ``data`` from byte ``offset`` on, in one pass, into the memo.

        Returns:
            The hash of the block at ``offset``.
        """
        size = self.block_size
        width = 4 * size
        chain = hash_block_chain(data[offset // 4 :], size, parent_hash=parent)
        memo = self._chain_memo
        if len(memo) + len(chain) > self._chain_memo_limit:
            memo.clear()
        for block_hash in chain:
            memo[(parent, raw[offset : offset + width])] = block_hash
            parent = block_hash
            offset += width
        return chain[0]

    def _count_lookup(self, found: int, wanted: int) -> None:
        stats = self._stats
        stats.cache_hits += found
        if found < wanted:
            stats.cache_misses += 1

    # The seed API: allocation and references.

    def allocate_block(self) -> Optional[CacheBlock]:
        """Allocate one block.

        Returns:
            The block (one reference), or None (logged) when no block is free.
        """
        queue = self.free_block_queue
        if queue.num_free_blocks == 0:
            logger.warning("out of cache blocks: all %d are referenced", self.max_blocks)
            return None
        block = queue.popleft()
        # _renew for one block, inlined: this is the hottest allocation path.
        if block.block_hash is not None or block.hash_value is not None:
            self._forget(block)
        block.cache_data = None
        block.token_count = 0
        block.ref_count = 1
        block.last_access = _next_tick()
        return block

    def get_new_blocks(self, num_blocks: int) -> list[CacheBlock]:
        """Allocate ``num_blocks`` blocks at once, all or nothing.

        Args:
            num_blocks: how many, >= 0.

        Returns:
            The blocks, each with one reference.

        Raises:
            OutOfBlocks: not enough free blocks (a ``ValueError``).
            InvalidInput: ``num_blocks`` is not a non-negative int (a
                ``ValueError``).
        """
        return self.allocate(num_blocks)

    def free_block(self, block_id: int) -> bool:
        """Drop one reference to a block.

        Args:
            block_id: the block.

        Returns:
            True if the block became free; False if it is still referenced,
            or (logged) if it is the null block or not allocated.
        """
        try:
            block: Optional[CacheBlock] = self.blocks[block_id]
        except (IndexError, TypeError):
            block = None
        if block is None or block.ref_count <= 0 or block.is_null or block.block_id != block_id:
            logger.warning("free_block(%r) ignored: not an allocated, non-null block", block_id)
            return False
        # _dereference for one block, inlined: this is the hottest release path.
        count = block.ref_count
        if count > 1:
            block.ref_count = count - 1
            return False
        block.ref_count = 0
        if block.block_hash is None and block.hash_value is None:
            block.cache_data = None  # unfindable once free: see _link_free
        self.free_block_queue._link_n((block,))
        return True

    def free_block_batch(self, blocks: Iterable[CacheBlock]) -> None:
        """Drop one reference per listed block; the null block is skipped.

        The seed calls this ``free_blocks``, a name its own ``free_blocks``
        property hides; the behaviour is the same.

        Args:
            blocks: blocks of this manager, in the order they should become
                evictable.

        Raises:
            InvalidInput: a block is not of this manager; nothing changed.
            DoubleFree: a block has no reference left; nothing changed.
        """
        listed = blocks if blocks.__class__ is list else list(blocks)
        self._dereference(listed, skip_null=True)

    def touch(self, blocks: Iterable[CacheBlock]) -> None:
        """Add one reference to each block (a cache hit on blocks in hand).

        Free blocks leave the free queue; the null block is skipped.

        Args:
            blocks: blocks of this manager.

        Raises:
            InvalidInput: a block is not of this manager; nothing changed.
        """
        self._reference(self._own_blocks(blocks, "blocks", skip_null=True))

    def increment_ref(self, block_id: int) -> bool:
        """Add one reference to an allocated block.

        Args:
            block_id: the block.

        Returns:
            True on success; False (logged) if the block is not allocated or
            is the null block.
        """
        block = self.allocated_blocks.get(block_id)
        if block is None or block.is_null:
            logger.warning(
                "increment_ref(%r) ignored: %s",
                block_id,
                "null block" if block is not None else "not allocated",
            )
            return False
        block.ref_count += 1
        block.last_access = _next_tick()
        return True

    def decrement_ref(self, block_id: int) -> bool:
        """Same as :meth:`free_block`.

        Args:
            block_id: the block.

        Returns:
            True if the block became free.
        """
        return self.free_block(block_id)

    # The seed API: prefix caching by chained hash.

    def get_cached_block(self, block_hash: BlockHash) -> Optional[CacheBlock]:
        """Find a block cached under ``block_hash``; counts a hit or a miss.

        Args:
            block_hash: the chained hash.

        Returns:
            The block (no reference taken), or None.
        """
        if not self.enable_caching:
            return None
        block = self.cached_block_hash_to_block.get_block(block_hash)
        self._count_lookup(block is not None, 1)
        return block

    def cache_full_blocks(
        self,
        blocks: list[CacheBlock],
        token_ids: list[int],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Publish ``blocks[num_cached_blocks:num_full_blocks]`` in the prefix cache.

        Each block is hashed after its parent, the block before it; a block
        that already holds a hash keeps it, and the chain continues from
        there. Unlike the seed, the blocks do not enter the legacy
        content-only index: they are found by chained hash only.

        Args:
            blocks: the request's blocks, in token order.
            token_ids: the request's tokens, from the first.
            num_cached_blocks: leading blocks already published.
            num_full_blocks: leading blocks that are full.

        Raises:
            InvalidInput: too few blocks or tokens, a bad token id, a foreign
                or null block, or a negative count; nothing changed.
        """
        if not self.enable_caching or num_cached_blocks >= num_full_blocks:
            return
        size = self.block_size
        first = _count(num_cached_blocks, "num_cached_blocks")
        stop = _count(num_full_blocks, "num_full_blocks")
        if len(blocks) < stop:
            raise InvalidInput("blocks", len(blocks), f"has fewer than {stop} blocks")
        if len(token_ids) < stop * size:
            raise InvalidInput("token_ids", len(token_ids), f"has fewer than {stop} full blocks")
        targets = self._own_blocks(blocks[first:stop], "blocks")
        parent = blocks[first - 1].block_hash if first else None
        # An unpublished parent leaves the chain unknown: hash from the start.
        base = 0 if parent is None else first
        data = _token_array(token_ids[base * size : stop * size], (stop - base) * size)
        full_chain = hash_block_chain(data, size, parent_hash=parent)
        chain = full_chain[first - base :]
        previous = full_chain[first - base - 1] if first > base else parent
        raw = data.tobytes()
        width = 4 * size
        start = (first - base) * width
        memo = self._chain_memo
        if len(memo) + len(chain) > self._chain_memo_limit:
            memo.clear()
        cache = self.cached_block_hash_to_block
        entries = cache._cache
        for offset, block in enumerate(targets):
            existing = block.block_hash
            if existing is not None:
                if existing != chain[offset]:
                    resume = (first + offset + 1 - base) * size
                    chain[offset + 1 :] = hash_block_chain(
                        data[resume:], size, parent_hash=existing
                    )
                previous = existing
                continue
            block_hash = chain[offset]
            block.block_hash = block_hash
            block.token_count = size
            if block_hash in entries:
                cache.insert(block_hash, block)
            else:
                entries[block_hash] = block
            # Remembered for the prefix lookups that will follow this prompt.
            begin = start + offset * width
            memo[(previous, raw[begin : begin + width])] = block_hash
            previous = block_hash

    def get_computed_blocks(self, token_ids: list[int]) -> tuple[list[CacheBlock], int]:
        """Find the cached blocks of the longest cached prefix of ``token_ids``.

        Counts one hit per block found and one miss if a full block was not.
        Takes no references (pass the blocks to :meth:`touch` for that).

        Args:
            token_ids: the prompt.

        Returns:
            ``(blocks, num_cached_tokens)``.

        Raises:
            InvalidInput: a token id is not an int in ``[0, 2**32)``.
        """
        if not self.enable_caching:
            return [], 0
        matched = self._match_tokens(token_ids, held_only=False)
        self._count_lookup(len(matched), len(token_ids) // self.block_size)
        return matched, len(matched) * self.block_size

    # The seed API: the legacy content-only hash.

    @staticmethod
    def compute_block_hash(tokens: list[int]) -> str:
        """The legacy content-only hash of a block: 16 hex digits.

        It ignores everything before the block, so no prefix lookup uses it.

        Args:
            tokens: the block's token ids, each in ``[0, 2**32)``.

        Returns:
            The first 16 hex digits of SHA-256 over the tokens as big-endian
            unsigned 32-bit integers.
        """
        data = array("I", tokens)
        if _SWAP_TO_BIG_ENDIAN:
            data.byteswap()
        return hashlib.sha256(data.tobytes()).hexdigest()[:16]

    def _set_legacy_hash(self, block: CacheBlock, key: str) -> None:
        index = self.hash_to_block
        old = block.hash_value
        if old is not None and old != key and index.get(old) == block.block_id:
            del index[old]
        block.hash_value = key
        index[key] = block.block_id

    def find_cached_block(self, tokens: list[int]) -> Optional[CacheBlock]:
        """Find a referenced block registered with the same content (legacy).

        Content only: the block may sit at another position of another
        sequence. Counts a hit or a miss.

        Args:
            tokens: the block's token ids.

        Returns:
            The block (no reference taken), or None.
        """
        ident = self.hash_to_block.get(self.compute_block_hash(tokens))
        block = None if ident is None else self.allocated_blocks.get(ident)
        self._count_lookup(block is not None, 1)
        if block is not None:
            block.last_access = _next_tick()
        return block

    def register_block_hash(self, block: CacheBlock, tokens: list[int]) -> None:
        """Enter ``block`` in the legacy content-only index.

        Args:
            block: a block of this manager.
            tokens: its token ids.

        Raises:
            InvalidInput: the block is not of this manager, or the null block.
        """
        self._check_own(block, "block")
        self._set_legacy_hash(block, self.compute_block_hash(tokens))

    # The seed API: block tables.

    def create_block_table(self, request_id: str) -> BlockTable:
        """Start an empty block table for ``request_id``.

        Args:
            request_id: a request with no table yet.

        Returns:
            The new table.

        Raises:
            DuplicateRequest: the request already has a table (replacing it
                would leak its blocks).
        """
        if request_id in self.request_tables:
            raise DuplicateRequest(request_id)
        table = self.request_tables[request_id] = BlockTable(request_id)
        return table

    def get_block_table(self, request_id: str) -> Optional[BlockTable]:
        """The table of ``request_id``, or None if it has none.

        Args:
            request_id: the request.

        Returns:
            Its table, or None.
        """
        return self.request_tables.get(request_id)

    def get_or_create_block_table(self, request_id: str) -> BlockTable:
        """The table of ``request_id``, created empty if it has none.

        Args:
            request_id: the request.

        Returns:
            Its table.
        """
        table = self.request_tables.get(request_id)
        if table is None:
            table = self.request_tables[request_id] = BlockTable(request_id)
        return table

    def delete_block_table(self, request_id: str) -> None:
        """Drop the table of ``request_id`` and release its blocks.

        The blocks are released last first, so that the end of a sequence is
        evicted before its beginning and a cached prefix stays usable longer.
        An unknown request is logged and ignored.

        Args:
            request_id: the request.
        """
        table = self.request_tables.pop(request_id, None)
        if table is None:
            logger.warning("delete_block_table(%r) ignored: unknown request", request_id)
            return
        try:
            blocks = self._listed_blocks(table)
            blocks.reverse()
            self._dereference(blocks)
        except (InvalidInput, DoubleFree) as exc:
            logger.warning("table %r is inconsistent (%s); freeing block by block", request_id, exc)
            for ident in reversed(table.block_ids):
                self.free_block(ident)

    def add_block_to_table(
        self, table: BlockTable, block: CacheBlock, tokens_in_block: int
    ) -> None:
        """Append ``block`` to ``table``, which takes over the caller's reference.

        Args:
            table: the request's table.
            block: a referenced block of this manager.
            tokens_in_block: tokens stored in it, in ``0..block_size``.

        Raises:
            InvalidInput: the block is foreign, the null block or not
                referenced, or the token count is out of range; nothing
                changed.
        """
        self._check_own(block, "block")
        if block.ref_count <= 0:
            raise InvalidInput("block", block, "is not referenced")
        if tokens_in_block.__class__ is not int or not 0 <= tokens_in_block <= self.block_size:
            raise InvalidInput(
                "tokens_in_block", tokens_in_block, f"must be an int in 0..{self.block_size}"
            )
        table.block_ids.append(block.block_id)
        block.token_count = tokens_in_block
        table.num_tokens += tokens_in_block

    # The seed API: sharing and copy-on-write.

    def find_shared_prefix(self, tokens: list[int]) -> tuple[list[int], list[int]]:
        """Find referenced blocks that hold the longest prefix of ``tokens``.

        Blocks match by parent-chained hash (same position, same everything
        before), never by content alone. Only referenced blocks count, so the
        caller can ``increment_ref`` each id. Counts one hit per block and one
        miss if a full block was not found.

        Args:
            tokens: the prompt.

        Returns:
            ``(block_ids, remaining_tokens)``: the shared blocks, and the
            tokens after them.

        Raises:
            InvalidInput: a token id is not an int in ``[0, 2**32)``.
        """
        matched = self._match_tokens(tokens, held_only=True)
        self._count_lookup(len(matched), len(tokens) // self.block_size)
        tick = _next_tick()
        for block in matched:
            block.last_access = tick
        remaining = tokens[len(matched) * self.block_size :]
        if remaining.__class__ is not list:
            remaining = list(remaining)
        return [block.block_id for block in matched], remaining

    def fork_block_table(self, source_table: BlockTable, new_request_id: str) -> BlockTable:
        """Give ``new_request_id`` a table that shares every block of ``source_table``.

        Each shared block gains one reference (the null block aside).

        Args:
            source_table: the table to share.
            new_request_id: a request with no table yet.

        Returns:
            The new table.

        Raises:
            DuplicateRequest: ``new_request_id`` already has a table.
            InvalidInput: ``source_table`` lists a block that is not allocated;
                nothing changed.
        """
        if new_request_id in self.request_tables:
            raise DuplicateRequest(new_request_id)
        shared = self._listed_blocks(source_table)
        self._reference(shared)
        table = self.request_tables[new_request_id] = source_table.copy(new_request_id)
        return table

    def get_blocks_for_generation(self, table: BlockTable) -> tuple[list[CacheBlock], bool]:
        """The table's blocks, each shared one replaced by a private copy.

        A copy that cannot be made (no free block) is logged and the shared
        block is returned instead; ids that are not allocated are logged and
        skipped.

        Args:
            table: the request's table; its ids are updated in place.

        Returns:
            ``(blocks, was_copied)``.
        """
        allocated = self.allocated_blocks
        blocks: list[CacheBlock] = []
        was_copied = False
        tick = _next_tick()
        block_ids = table.block_ids
        for position, ident in enumerate(block_ids):
            block = allocated.get(ident)
            if block is None:
                logger.warning("table %r lists unallocated block %r", table.request_id, ident)
                continue
            block.last_access = tick
            if block.ref_count > 1 and not block.is_null:
                copied = self._cow_copy_block(block)
                if copied is not None:
                    block_ids[position] = copied.block_id
                    self._stats.cow_copies += 1
                    was_copied = True
                    block = copied
            blocks.append(block)
        return blocks, was_copied

    def _cow_copy_block(self, source_block: CacheBlock) -> Optional[CacheBlock]:
        """Move one reference of ``source_block`` to a new private copy of it.

        The copy gets its own payload: containers are rebuilt and MLX arrays
        are copied into new, evaluated buffers, so later changes to either
        block never show in the other. The copy is not hashed.

        Args:
            source_block: a referenced block of this manager.

        Returns:
            The copy (one reference), or None (logged) if no block is free.

        Raises:
            InvalidInput: ``source_block`` is foreign, null or not referenced.
        """
        self._check_own(source_block, "source_block")
        if source_block.ref_count <= 0:
            raise InvalidInput("source_block", source_block, "is not referenced")
        if self.free_block_queue.num_free_blocks == 0:
            logger.warning("copy-on-write of block %d failed: no free block", source_block.block_id)
            return None
        (copied,) = self.allocate(1)
        copied.token_count = source_block.token_count
        copied.cache_data = _copy_payload(source_block.cache_data)
        self._dereference((source_block,))
        return copied

    def allocate_blocks_for_tokens(self, num_tokens: int) -> list[CacheBlock]:
        """Allocate enough blocks for ``num_tokens`` tokens, all or nothing.

        Args:
            num_tokens: >= 0.

        Returns:
            ``ceil(num_tokens / block_size)`` blocks, each with one reference.

        Raises:
            OutOfBlocks: not enough free blocks (a ``ValueError``).
            InvalidInput: ``num_tokens`` is not a non-negative int.
        """
        num_tokens = _count(num_tokens, "num_tokens")
        return self.allocate(-(-num_tokens // self.block_size))

    # The seed API: eviction and memory pressure.

    def evict_lru_blocks(self, num_blocks: int) -> int:
        """Clear the ``num_blocks`` free blocks at the LRU end of the free queue.

        As in the seed, each of them loses whatever it still holds (its hash,
        legacy hash and payload; a block with none is cleared all the same)
        and counts. Unlike the seed, they stay where they are in the queue,
        so they are the next to be allocated: moving them to the back would
        make the next allocations evict cached blocks instead.

        Args:
            num_blocks: the most to clear, >= 0.

        Returns:
            How many blocks were cleared: ``min(num_blocks, free_blocks)``.

        Raises:
            InvalidInput: ``num_blocks`` is not a non-negative int.
        """
        num_blocks = _count(num_blocks, "num_blocks")
        cleared = 0
        queue = self.free_block_queue
        block = queue.fake_head.next_free_block
        while cleared < num_blocks and block is not queue.fake_tail:
            if (
                block.block_hash is not None
                or block.hash_value is not None
                or block.cache_data is not None
            ):
                self._forget(block)
            cleared += 1
            block = block.next_free_block
        if cleared:
            logger.info("cleared %d free blocks from the LRU end", cleared)
        return cleared

    def handle_memory_pressure(self, requested_blocks: int) -> bool:
        """Whether ``requested_blocks`` blocks can be allocated now.

        Every free block counts, cached or not, because allocation evicts
        cached blocks by itself; so nothing is evicted here ahead of time.

        Args:
            requested_blocks: blocks about to be allocated.

        Returns:
            True if that many are free; False (logged) otherwise.
        """
        available = self.free_block_queue.num_free_blocks
        if available >= requested_blocks:
            return True
        logger.warning("memory pressure: %s blocks requested, %d free", requested_blocks, available)
        return False

    # The seed API: statistics and resets.

    @property
    def free_blocks(self) -> int:
        """Blocks in the free queue, cached ones included."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable (non-null) blocks that are referenced."""
        usable = self.max_blocks - 1
        if usable == 0:
            return 0.0
        return 1.0 - self.free_block_queue.num_free_blocks / usable

    @property
    def stats(self) -> CacheStats:
        """The statistics record; its block counts are brought up to date on read."""
        stats = self._stats
        stats.total_blocks = self.max_blocks
        stats.allocated_blocks = len(self.allocated_blocks)
        stats.free_blocks = self.free_block_queue.num_free_blocks
        return stats

    @stats.setter
    def stats(self, value: CacheStats) -> None:
        self._stats = value

    def get_stats(self) -> CacheStats:
        """Bring every gauge of the statistics record up to date.

        Returns:
            The manager's :class:`CacheStats` (the same object every time).
        """
        stats = self.stats
        stats.shared_blocks = sum(1 for block in self.blocks if block.ref_count > 1)
        stats.total_tokens_cached = self._tokens_in_tables()
        return stats

    def _tokens_in_tables(self) -> int:
        """Tokens of the distinct blocks that request tables list (null block aside)."""
        allocated = self.allocated_blocks
        listed: set[int] = set()
        tokens = 0
        for table in self.request_tables.values():
            for ident in table.block_ids:
                if ident in listed:
                    continue
                listed.add(ident)
                block = allocated.get(ident)
                if block is not None and not block.is_null:
                    tokens += block.token_count
        return tokens

    def get_memory_usage(self) -> dict[str, Any]:
        """A summary of block usage and hit rate.

        Returns:
            A dict with ``block_size``, ``max_blocks``, ``allocated_blocks``,
            ``free_blocks``, ``shared_blocks``, ``total_tokens_cached``,
            ``utilization`` and ``cache_hit_rate``.
        """
        stats = self.get_stats()
        lookups = stats.cache_hits + stats.cache_misses
        return {
            "block_size": self.block_size,
            "max_blocks": self.max_blocks,
            "allocated_blocks": stats.allocated_blocks,
            "free_blocks": stats.free_blocks,
            "shared_blocks": stats.shared_blocks,
            "total_tokens_cached": stats.total_tokens_cached,
            "utilization": stats.allocated_blocks / self.max_blocks,
            "cache_hit_rate": stats.cache_hits / lookups if lookups else 0.0,
        }

    def reset_stats(self) -> None:
        """Zero the hit, miss, copy-on-write and eviction counters."""
        stats = self._stats
        stats.cache_hits = stats.cache_misses = stats.cow_copies = stats.evictions = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, provided no block is referenced.

        The dropped hashes are reported by :meth:`take_evicted`; the hit, miss
        and eviction counters are zeroed.

        Returns:
            True on success; False (logged) while any block other than the
            null block is referenced.
        """
        in_use = len(self.allocated_blocks) - 1
        if in_use:
            logger.warning("prefix cache not reset: %d blocks in use", in_use)
            return False
        self._drop_prefix_cache()
        for block in self.blocks:
            block.block_hash = None
            block.hash_value = None
            block.cache_data = None
        stats = self._stats
        stats.evictions = stats.cache_hits = stats.cache_misses = 0
        logger.info("prefix cache reset")
        return True

    def clear(self) -> None:
        """Start over: new blocks, no tables, nothing cached, statistics zeroed.

        Blocks handed out before are no longer blocks of this manager. The
        dropped hashes are reported by :meth:`take_evicted`.
        """
        self._drop_prefix_cache()
        self.request_tables.clear()
        self._build_pool()
        logger.info("paged cache cleared")

    def _trim_evicted(self) -> None:
        del self._evicted[: len(self._evicted) - self._evicted_limit // 2]

    def _drop_prefix_cache(self) -> None:
        self._evicted.extend(self.cached_block_hash_to_block)
        if len(self._evicted) > self._evicted_limit:
            self._trim_evicted()
        self.cached_block_hash_to_block.clear()
        self.hash_to_block.clear()


def _count(value: Any, argument: str, *, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum`` (ints and int-likes such as NumPy's)."""
    if isinstance(value, bool):
        raise InvalidInput(argument, value, "must be an int, not a bool")
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidInput(argument, value, "must be an int") from None
    if number < minimum:
        raise InvalidInput(argument, value, f"must be >= {minimum}")
    return number


def _restore(blocks: Sequence[Any], stop: int) -> None:
    """Give back the reference just taken from each of ``blocks[:stop]``.

    Those are all blocks of the manager; the null block among them was
    skipped, not released, so it gets nothing back.
    """
    for block in blocks[:stop]:
        if not block.is_null:
            block.ref_count += 1


def _token_array(token_ids: Sequence[int], length: int) -> array:
    """The first ``length`` token ids as unsigned 32-bit ints, or InvalidInput."""
    if len(token_ids) != length:
        token_ids = token_ids[:length]
    try:
        return array("I", token_ids)
    except (OverflowError, TypeError):
        raise InvalidInput(
            "token_ids", token_ids, "token ids must be ints in [0, 2**32)"
        ) from None


def _copy_payload(data: Any) -> Any:
    """A copy of a block payload that shares no mutable state with ``data``.

    Lists, tuples and dicts are rebuilt; MLX arrays are copied into new buffers
    and evaluated here; anything else with a ``copy()`` method (NumPy arrays)
    is copied with it, and other objects are deep-copied.
    """
    if data is None:
        return None
    fresh: list[Any] = []
    copied = _copy_tree(data, fresh)
    if fresh:
        import mlx.core as mx

        mx.eval(*fresh)
    return copied


def _copy_tree(value: Any, fresh: list[Any]) -> Any:
    """Rebuild containers and copy leaves; new MLX arrays are collected in ``fresh``."""
    if isinstance(value, _IMMUTABLE_LEAVES):
        return value
    if isinstance(value, list):
        return [_copy_tree(item, fresh) for item in value]
    if isinstance(value, tuple):
        items = [_copy_tree(item, fresh) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, dict):
        return {key: _copy_tree(item, fresh) for key, item in value.items()}
    kind = type(value)
    if kind.__name__ == "array" and kind.__module__.startswith("mlx"):
        import mlx.core as mx

        duplicate = mx.array(value)
        fresh.append(duplicate)
        return duplicate
    if callable(getattr(value, "copy", None)):
        return value.copy()
    return copy.deepcopy(value)
