"""Paged KV blocks, the seed's way: vllm-mlx 0.6.0's ``paged_cache`` API.

:class:`PagedCacheManager` keeps the seed's names, signatures, defaults,
return values and statistics, as an adapter over one
:class:`~mlxkv.cache.pool.BlockPool` (its ``pool``), the block pool the
runtime's allocator actor runs too: allocation, references, prefix caching
by parent-chained hash, lazy LRU eviction of free cached blocks and the
invariants live there. What the manager adds is the seed's own: per-request
block tables, the legacy content-only hash (``hash_to_block``), lookups by
token ids (``get_computed_blocks``, ``find_shared_prefix``), copy-on-write
and the :class:`CacheStats` record. Where the seed returns ``None`` or
``False`` on failure, so does it, and logs a warning.

The block records (:class:`CacheBlock`, :class:`FreeKVCacheBlockQueue`,
:class:`BlockHashToBlockMap`) live in :mod:`mlxkv.cache.blocks` and are
re-exported here under the seed's import path.

The module is synchronous and takes no locks: a manager has one owner at a
time. It never reads the wall clock; ``last_access`` is a logical tick.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import sys
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from mlxkv.cache.block_hash import BlockHash, compute_block_hash, hash_block_chain
from mlxkv.cache.blocks import (
    AllocatedBlocks,
    BlockHashToBlockMap,
    CacheBlock,
    FreeKVCacheBlockQueue,
    check_count,
    next_tick,
)
from mlxkv.cache.errors import DoubleFree, DuplicateRequest, InvalidInput, InvariantViolation, OutOfBlocks
from mlxkv.cache.pool import BlockPool

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

_SWAP_TO_BIG_ENDIAN = sys.byteorder == "little"
_IMMUTABLE_LEAVES = (type(None), bool, int, float, complex, str, bytes)

#: The seed's alias of :class:`CacheBlock`.
KVCacheBlock = CacheBlock


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



class PagedCacheManager:
    """The seed's paged cache: block tables, legacy hashes and statistics over a block pool.

    It owns its :class:`~mlxkv.cache.pool.BlockPool` (``pool``: the blocks,
    their references, the free queue and the hash -> block map, also
    readable here as the seed's ``blocks``, ``free_block_queue``,
    ``cached_block_hash_to_block``, ``null_block`` and ``allocated_blocks``),
    the per-request block tables (``request_tables``), the legacy
    content-only index (``hash_to_block``), a memo of chain hashes for
    lookups by token ids, and the statistics (``stats``). Block 0 is the
    null block, a placeholder that is always referenced and never freed.
    Every change to a block goes through the pool.

    Invariants:
        - the pool's (:meth:`BlockPool.check_invariants`);
        - every entry of ``hash_to_block`` names a block that holds that
          legacy hash;
        - every block id in a request table is allocated, and no block is
          listed by more tables than its ``ref_count`` (the null block aside);
        - the memo of chain hashes holds only true hashes of its keys.

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
        self.hash_to_block: dict[str, int] = {}
        # The hook holds the legacy index, not the manager: no reference
        # cycle, so a manager dropped is freed at once, with its blocks' KV.
        self.pool = BlockPool(
            block_size, max_blocks, caching=enable_caching, forget_hook=_legacy_hash_dropper(self.hash_to_block)
        )
        self.block_size = self.pool.block_size
        self.max_blocks = self.pool.max_blocks
        self.enable_caching = enable_caching
        self.request_tables: dict[str, BlockTable] = {}
        # (parent hash, block token bytes) -> block hash: a memo of the pure
        # chain function, so repeated prefix lookups do not hash again.
        self._chain_memo: dict[tuple[Optional[BlockHash], bytes], BlockHash] = {}
        self._chain_memo_limit = 4 * self.max_blocks + 1024
        # The pool's single-block operations, bound once: the seed's hottest
        # calls (allocate_block, free_block) are one call into the pool each.
        self._allocate_one = self.pool.allocate_one
        self._release_one = self.pool.release_one
        self._stats = CacheStats(total_blocks=self.max_blocks)
        # The pool's (hits, misses, evictions) already added to ``_stats``.
        self._counted = (0, 0, 0)

    # The pool's structures, under the seed's names.

    @property
    def blocks(self) -> list[CacheBlock]:
        """Every block of the pool, by id (block 0 is the null block)."""
        return self.pool.blocks

    @property
    def free_block_queue(self) -> FreeKVCacheBlockQueue:
        """The pool's free queue: every unreferenced block, least recently freed first."""
        return self.pool.free_block_queue

    @property
    def cached_block_hash_to_block(self) -> BlockHashToBlockMap:
        """The pool's prefix cache: chain hash -> blocks."""
        return self.pool.cached_block_hash_to_block

    @property
    def null_block(self) -> CacheBlock:
        """The placeholder block 0: always referenced, never freed."""
        return self.pool.null_block

    @property
    def allocated_blocks(self) -> AllocatedBlocks:
        """A read-only view: block id -> block, for blocks with references."""
        return self.pool.allocated_blocks

    def check_invariants(self) -> None:
        """Verify every invariant listed in the class docstring.

        Raises:
            InvariantViolation: naming the first block, hash or table found wrong.
        """
        pool = self.pool
        pool.check_invariants()
        blocks = pool.blocks
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
        allocated = pool.allocated_blocks
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

    # Internals of the adapter.

    def _listed_blocks(self, table: BlockTable) -> list[CacheBlock]:
        """The allocated blocks ``table`` lists, in order, the null block left out.

        Raises:
            InvalidInput: the table lists an id that is not allocated.
        """
        pool = self.pool.blocks
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
        cache = self.pool.cached_block_hash_to_block
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
        try:
            return self._allocate_one()
        except OutOfBlocks:
            logger.warning("out of cache blocks: all %d are referenced", self.max_blocks)
            return None

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
        return self.pool.allocate(num_blocks)

    def free_block(self, block_id: int) -> bool:
        """Drop one reference to a block.

        Args:
            block_id: the block.

        Returns:
            True if the block became free; False if it is still referenced,
            or (logged) if it is the null block or not allocated.
        """
        try:
            return self._release_one(block_id)
        except (InvalidInput, DoubleFree):
            logger.warning("free_block(%r) ignored: not an allocated, non-null block", block_id)
            return False

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
        self.pool.release(blocks, skip_null=True)

    def touch(self, blocks: Iterable[CacheBlock]) -> None:
        """Add one reference to each block (a cache hit on blocks in hand).

        Free blocks leave the free queue; the null block is skipped.

        Args:
            blocks: blocks of this manager.

        Raises:
            InvalidInput: a block is not of this manager; nothing changed.
        """
        self.pool.hold(blocks, skip_null=True)

    def increment_ref(self, block_id: int) -> bool:
        """Add one reference to an allocated block.

        Args:
            block_id: the block.

        Returns:
            True on success; False (logged) if the block is not allocated or
            is the null block.
        """
        block = self.pool.allocated_blocks.get(block_id)
        if block is None or block.is_null:
            logger.warning(
                "increment_ref(%r) ignored: %s",
                block_id,
                "null block" if block is not None else "not allocated",
            )
            return False
        self.pool.share((block.block_id,))
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
        block = self.pool.cached_block_hash_to_block.get_block(block_hash)
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
        first = check_count(num_cached_blocks, "num_cached_blocks")
        stop = check_count(num_full_blocks, "num_full_blocks")
        if len(blocks) < stop:
            raise InvalidInput("blocks", len(blocks), f"has fewer than {stop} blocks")
        if len(token_ids) < stop * size:
            raise InvalidInput("token_ids", len(token_ids), f"has fewer than {stop} full blocks")
        targets = blocks[first:stop]
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
        # What to publish. A block listed twice (rare) is hashed once: ``listed``
        # remembers what it gets.
        new_blocks: list[CacheBlock] = []
        new_hashes: list[BlockHash] = []
        listed: Optional[dict[int, BlockHash]] = (
            {} if len(set(map(id, targets))) != len(targets) else None
        )
        try:
            for offset, block in enumerate(targets):
                existing = block.block_hash
                if existing is None and listed is not None:
                    existing = listed.get(block.block_id)
                if existing is not None:
                    if existing != chain[offset]:
                        resume = (first + offset + 1 - base) * size
                        chain[offset + 1 :] = hash_block_chain(
                            data[resume:], size, parent_hash=existing
                        )
                    previous = existing
                    continue
                block_hash = chain[offset]
                new_blocks.append(block)
                new_hashes.append(block_hash)
                if listed is not None:
                    listed[block.block_id] = block_hash
                # Remembered for the prefix lookups that will follow this prompt.
                begin = start + offset * width
                memo[(previous, raw[begin : begin + width])] = block_hash
                previous = block_hash
        except AttributeError:
            self.pool.own_blocks(targets, "blocks")  # not blocks: InvalidInput
            raise
        # The pool refuses foreign and null blocks before publishing any.
        self.pool.publish(new_blocks, new_hashes)

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
        block = None if ident is None else self.pool.allocated_blocks.get(ident)
        self._count_lookup(block is not None, 1)
        if block is not None:
            block.last_access = next_tick()
        return block

    def register_block_hash(self, block: CacheBlock, tokens: list[int]) -> None:
        """Enter ``block`` in the legacy content-only index.

        Args:
            block: a block of this manager.
            tokens: its token ids.

        Raises:
            InvalidInput: the block is not of this manager, or the null block.
        """
        self.pool.own_block(block, "block")
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
            self.pool.release(blocks)
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
        self.pool.own_block(block, "block")
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
        tick = next_tick()
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
        try:
            self.pool.share(source_table.block_ids)
        except InvalidInput as exc:
            raise InvalidInput("table", source_table.request_id, f"lists unallocated block {exc.value!r}") from None
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
        allocated = self.pool.allocated_blocks
        blocks: list[CacheBlock] = []
        was_copied = False
        tick = next_tick()
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
        pool = self.pool
        pool.own_block(source_block, "source_block")
        if source_block.ref_count <= 0:
            raise InvalidInput("source_block", source_block, "is not referenced")
        if pool.free_block_queue.num_free_blocks == 0:
            logger.warning("copy-on-write of block %d failed: no free block", source_block.block_id)
            return None
        (copied,) = pool.allocate(1)
        pool.fill(
            copied,
            _copy_payload(source_block.cache_data),
            num_tokens=source_block.token_count or None,
        )
        pool.release((source_block,))
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
        num_tokens = check_count(num_tokens, "num_tokens")
        return self.pool.allocate(-(-num_tokens // self.block_size))

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
        num_blocks = check_count(num_blocks, "num_blocks")
        queue = self.pool.free_block_queue
        lru: list[CacheBlock] = []
        block = queue.fake_head.next_free_block
        while len(lru) < num_blocks and block is not queue.fake_tail:
            lru.append(block)
            block = block.next_free_block
        self.pool.forget(lru)
        if lru:
            logger.info("cleared %d free blocks from the LRU end", len(lru))
        return len(lru)

    def handle_memory_pressure(self, requested_blocks: int) -> bool:
        """Whether ``requested_blocks`` blocks can be allocated now.

        Every free block counts, cached or not, because allocation evicts
        cached blocks by itself; so nothing is evicted here ahead of time.

        Args:
            requested_blocks: blocks about to be allocated.

        Returns:
            True if that many are free; False (logged) otherwise.
        """
        available = self.pool.free_block_queue.num_free_blocks
        if available >= requested_blocks:
            return True
        logger.warning("memory pressure: %s blocks requested, %d free", requested_blocks, available)
        return False

    # The seed API: statistics and resets.

    @property
    def free_blocks(self) -> int:
        """Blocks in the free queue, cached ones included."""
        return self.pool.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable (non-null) blocks that are referenced."""
        usable = self.max_blocks - 1
        if usable == 0:
            return 0.0
        return 1.0 - self.pool.free_block_queue.num_free_blocks / usable

    @property
    def stats(self) -> CacheStats:
        """The statistics record; its gauges, and the hits, misses and
        evictions the pool counted since the last read, are brought up to
        date on read (it stays the same object)."""
        stats = self._stats
        pool = self.pool.statistics()
        counted = (pool.num_hits, pool.num_misses, pool.num_evictions)
        hits, misses, evictions = self._counted
        stats.cache_hits += counted[0] - hits
        stats.cache_misses += counted[1] - misses
        stats.evictions += counted[2] - evictions
        self._counted = counted
        stats.total_blocks = self.max_blocks
        stats.allocated_blocks = pool.num_referenced + 1
        stats.free_blocks = pool.num_free
        return stats

    @stats.setter
    def stats(self, value: CacheStats) -> None:
        self.stats  # what the pool counted so far belongs to the old record
        self._stats = value

    def get_stats(self) -> CacheStats:
        """Bring every gauge of the statistics record up to date.

        Returns:
            The manager's :class:`CacheStats` (the same object every time).
        """
        stats = self.stats
        stats.shared_blocks = sum(1 for block in self.pool.blocks if block.ref_count > 1)
        stats.total_tokens_cached = self._tokens_in_tables()
        return stats

    def _tokens_in_tables(self) -> int:
        """Tokens of the distinct blocks that request tables list (null block aside)."""
        allocated = self.pool.allocated_blocks
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
        stats = self.stats
        stats.cache_hits = stats.cache_misses = stats.cow_copies = stats.evictions = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, provided no block is referenced.

        The dropped hashes are reported by the pool's ``take_evicted``; the
        hit, miss and eviction counters are zeroed.

        Returns:
            True on success; False (logged) while any block other than the
            null block is referenced.
        """
        pool = self.pool
        in_use = len(pool.allocated_blocks) - 1
        if in_use:
            logger.warning("prefix cache not reset: %d blocks in use", in_use)
            return False
        pool.forget(pool.free_block_queue.get_all_free_blocks())
        self.hash_to_block.clear()
        stats = self.stats
        stats.evictions = stats.cache_hits = stats.cache_misses = 0
        logger.info("prefix cache reset")
        return True

    def clear(self) -> None:
        """Start over: new blocks, no tables, nothing cached, statistics zeroed.

        Blocks handed out before are no longer blocks of this manager. The
        dropped hashes are reported by the pool's ``take_evicted``.
        """
        self.request_tables.clear()
        self.hash_to_block.clear()
        self.pool.reset()
        self.stats = CacheStats(total_blocks=self.max_blocks)
        logger.info("paged cache cleared")


def _legacy_hash_dropper(index: dict[str, int]) -> Callable[[CacheBlock], None]:
    """The pool's forget hook for a manager whose legacy index is ``index``:
    a block whose content is dropped leaves the index."""

    def drop(block: CacheBlock) -> None:
        if index.get(block.hash_value) == block.block_id:  # type: ignore[arg-type]
            del index[block.hash_value]  # type: ignore[arg-type]

    return drop


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
