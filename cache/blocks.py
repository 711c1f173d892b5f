"""Blocks and the two structures that index them: the free queue and the hash map.

These are the records of the block pool (:mod:`mlxkv.cache.pool`), which owns
them, and also the seed's public classes (vllm-mlx 0.6.0's ``paged_cache``
names, re-exported by :mod:`mlxkv.cache.paged`):

* :class:`CacheBlock` -- one physical block: reference count, hash, payload,
  and its links in the free queue;
* :class:`FreeKVCacheBlockQueue` -- every unreferenced block, in the order it
  became free (intrusive, doubly linked, O(1) updates);
* :class:`BlockHashToBlockMap` -- chain hash -> the blocks cached under it.

Nothing here reads the wall clock: ``last_access`` is a logical tick.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from mlxkv.cache.block_hash import BlockHash
from mlxkv.cache.errors import InvalidInput, OutOfBlocks

__all__ = [
    "AllocatedBlocks",
    "BlockHashToBlockMap",
    "CacheBlock",
    "FreeKVCacheBlockQueue",
    "check_count",
    "next_tick",
]

#: The logical clock behind ``CacheBlock.last_access``: larger is more recent.
next_tick = itertools.count(1).__next__

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
    last_access: float = field(default_factory=next_tick)

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
        self.last_access = next_tick()

    def __repr__(self) -> str:
        prev_block = self.prev_free_block
        next_block = self.next_free_block
        return (
            f"CacheBlock(id={self.block_id}, ref={self.ref_count}, "
            f"tokens={self.token_count}, hashed={self.block_hash is not None}, "
            f"prev={None if prev_block is None else prev_block.block_id}, "
            f"next={None if next_block is None else next_block.block_id})"
        )



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



class AllocatedBlocks(Mapping[int, CacheBlock]):
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



def check_count(value: Any, argument: str, *, minimum: int = 0) -> int:
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

