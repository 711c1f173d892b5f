"""Paged KV blocks: the seed-compatible API, an adapter over the block pool."""

from __future__ import annotations

import hashlib
import logging
import struct

import mlx.core as mx
import numpy as np
import pytest

from mlxkv.cache.block_hash import hash_block_chain
from mlxkv.cache.errors import DoubleFree, DuplicateRequest, InvalidInput, OutOfBlocks
from mlxkv.cache.paged import (
    BlockHash,
    BlockHashToBlockMap,
    BlockTable,
    CacheBlock,
    CacheStats,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    PagedCacheManager,
    compute_block_hash,
)

BS = 4


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


@pytest.fixture
def mgr() -> PagedCacheManager:
    return PagedCacheManager(block_size=BS, max_blocks=9)


def cached_prompt(mgr: PagedCacheManager, token_ids: list[int]) -> list[CacheBlock]:
    """Allocate and publish the full blocks of ``token_ids``; the caller holds them."""
    n = len(token_ids) // mgr.block_size
    blocks = mgr.pool.allocate(n)
    mgr.cache_full_blocks(blocks, token_ids, 0, n)
    return blocks


def queue_ids(mgr: PagedCacheManager) -> list[int]:
    return [b.block_id for b in mgr.free_block_queue.get_all_free_blocks()]


def snapshot(mgr: PagedCacheManager):
    return (
        [(b.ref_count, b.block_hash, b.token_count) for b in mgr.blocks],
        queue_ids(mgr),
        len(mgr.cached_block_hash_to_block),
    )


class TestCacheBlock:
    def test_defaults(self):
        """A new block is unreferenced, unhashed, empty and not the null block."""
        block = CacheBlock(block_id=3)
        assert (block.ref_count, block.block_hash, block.cache_data, block.token_count) == (
            0,
            None,
            None,
            0,
        )
        assert not block.is_null and block.hash_value is None
        assert block.prev_free_block is None and block.next_free_block is None

    def test_alias(self):
        """KVCacheBlock is the same class as CacheBlock."""
        assert KVCacheBlock is CacheBlock

    def test_is_full(self):
        """A block is full once it holds block_size tokens."""
        block = CacheBlock(block_id=1, token_count=3)
        assert not block.is_full(4)
        block.token_count = 4
        assert block.is_full(4)

    def test_is_shared(self):
        """A block is shared only with more than one reference."""
        assert not CacheBlock(block_id=1, ref_count=1).is_shared()
        assert CacheBlock(block_id=1, ref_count=2).is_shared()

    def test_reset_hash(self):
        """reset_hash forgets the chained and the legacy hash."""
        block = CacheBlock(block_id=1, block_hash=BlockHash(b"h"), hash_value="abc")
        block.reset_hash()
        assert block.block_hash is None and block.hash_value is None

    def test_touch_is_a_logical_tick(self):
        """touch stamps a strictly larger logical tick, not a wall-clock time."""
        block = CacheBlock(block_id=1)
        before = block.last_access
        block.touch()
        assert block.last_access > before
        assert float(block.last_access) < 1e9  # far below any Unix timestamp

    def test_identity_equality(self):
        """Blocks compare by identity and can be kept in sets."""
        a, b = CacheBlock(block_id=1), CacheBlock(block_id=1)
        a.last_access = b.last_access
        assert a != b and a == a
        assert len({a, b}) == 2

    def test_slots(self):
        """Blocks carry no per-instance __dict__."""
        assert not hasattr(CacheBlock(block_id=1), "__dict__")

    def test_repr(self):
        """The repr names the id, reference count and token count."""
        text = repr(CacheBlock(block_id=7, ref_count=2, token_count=5))
        assert "id=7" in text and "ref=2" in text and "tokens=5" in text


class TestFreeKVCacheBlockQueue:
    def make(self, n: int = 4):
        blocks = [CacheBlock(block_id=i) for i in range(n)]
        return blocks, FreeKVCacheBlockQueue(blocks)

    def test_initial_order(self):
        """The queue starts with the given blocks, front to back."""
        blocks, queue = self.make()
        assert queue.get_all_free_blocks() == blocks
        assert queue.num_free_blocks == 4

    def test_empty_queue(self):
        """An empty queue links its sentinels to each other."""
        queue = FreeKVCacheBlockQueue([])
        assert queue.num_free_blocks == 0
        assert queue.fake_head.next_free_block is queue.fake_tail
        assert queue.get_all_free_blocks() == []

    def test_popleft_takes_the_front(self):
        """popleft returns the front block, unlinked."""
        blocks, queue = self.make()
        block = queue.popleft()
        assert block is blocks[0]
        assert block.prev_free_block is None and block.next_free_block is None
        assert queue.get_all_free_blocks() == blocks[1:]
        assert queue.num_free_blocks == 3

    def test_popleft_empty_raises_value_error(self):
        """popleft on an empty queue raises a ValueError."""
        _, queue = self.make(0)
        with pytest.raises(ValueError):
            queue.popleft()

    def test_popleft_n(self):
        """popleft_n takes the n front blocks in order."""
        blocks, queue = self.make()
        assert queue.popleft_n(3) == blocks[:3]
        assert queue.get_all_free_blocks() == blocks[3:]
        assert queue.num_free_blocks == 1
        assert queue.popleft_n(0) == []

    def test_popleft_n_all(self):
        """popleft_n can empty the queue."""
        blocks, queue = self.make()
        assert queue.popleft_n(4) == blocks
        assert queue.get_all_free_blocks() == [] and queue.num_free_blocks == 0

    def test_popleft_n_too_many(self):
        """Asking for more blocks than queued raises OutOfBlocks and changes nothing."""
        blocks, queue = self.make()
        with pytest.raises(OutOfBlocks) as info:
            queue.popleft_n(5)
        assert (info.value.requested, info.value.available) == (5, 4)
        assert queue.get_all_free_blocks() == blocks

    def test_popleft_n_negative(self):
        """A negative count is rejected with InvalidInput."""
        _, queue = self.make()
        with pytest.raises(InvalidInput):
            queue.popleft_n(-1)
        assert queue.num_free_blocks == 4

    def test_remove_from_middle(self):
        """remove unlinks a block and keeps the others in order."""
        blocks, queue = self.make()
        queue.remove(blocks[2])
        assert queue.get_all_free_blocks() == [blocks[0], blocks[1], blocks[3]]
        assert queue.num_free_blocks == 3

    def test_remove_absent_raises(self):
        """Removing a block that is not queued raises RuntimeError."""
        blocks, queue = self.make()
        queue.remove(blocks[1])
        with pytest.raises(RuntimeError):
            queue.remove(blocks[1])
        assert queue.num_free_blocks == 3

    def test_append_goes_to_the_back(self):
        """append puts a block at the back."""
        blocks, queue = self.make()
        block = queue.popleft()
        queue.append(block)
        assert queue.get_all_free_blocks() == blocks[1:] + [block]

    def test_append_queued_block_raises(self):
        """Appending a block that is already queued raises RuntimeError."""
        blocks, queue = self.make()
        with pytest.raises(RuntimeError):
            queue.append(blocks[0])
        assert queue.get_all_free_blocks() == blocks

    def test_append_n(self):
        """append_n adds blocks at the back in the given order."""
        blocks, queue = self.make()
        taken = queue.popleft_n(3)
        queue.append_n([taken[2], taken[0]])
        queue.append_n([])
        assert queue.get_all_free_blocks() == [blocks[3], blocks[2], blocks[0]]
        assert queue.num_free_blocks == 3

    def test_append_n_rejects_queued_blocks_atomically(self):
        """append_n with a queued block raises and appends none of them."""
        blocks, queue = self.make()
        taken = queue.popleft()
        with pytest.raises(RuntimeError):
            queue.append_n([taken, blocks[2]])
        assert queue.get_all_free_blocks() == blocks[1:]

    def test_blocks_leave_in_the_order_they_came(self):
        """The queue is FIFO whatever was removed from its middle: the ordering invariant."""
        blocks, queue = self.make(6)
        queue.remove(blocks[3])
        queue.append(blocks[3])
        order = [queue.popleft().block_id for _ in range(len(blocks))]
        assert order == [0, 1, 2, 4, 5, 3]


class TestBlockHashToBlockMap:
    def test_insert_and_get(self):
        """A block inserted under a hash is found under it; other hashes miss."""
        cache = BlockHashToBlockMap()
        block = CacheBlock(block_id=1)
        cache.insert(BlockHash(b"a"), block)
        assert cache.get_block(BlockHash(b"a")) is block
        assert cache.get_block(BlockHash(b"b")) is None
        assert len(cache) == 1 and BlockHash(b"a") in cache

    def test_duplicates_are_kept(self):
        """A second block under the same hash is kept beside the first."""
        cache = BlockHashToBlockMap()
        a, b = CacheBlock(block_id=1), CacheBlock(block_id=2)
        cache.insert(BlockHash(b"h"), a)
        cache.insert(BlockHash(b"h"), b)
        assert len(cache) == 1
        assert cache.blocks(BlockHash(b"h")) == [a, b]
        assert cache.pop(BlockHash(b"h"), 1) is a
        assert cache.get_block(BlockHash(b"h")) is b
        assert cache.pop(BlockHash(b"h"), 2) is b
        assert len(cache) == 0

    def test_reinsert_same_block(self):
        """Inserting the same block twice keeps one entry."""
        cache = BlockHashToBlockMap()
        a = CacheBlock(block_id=1)
        cache.insert(BlockHash(b"h"), a)
        cache.insert(BlockHash(b"h"), a)
        assert cache.blocks(BlockHash(b"h")) == [a]

    def test_pop_wrong_id(self):
        """pop with an id not cached under the hash returns None and keeps the entry."""
        cache = BlockHashToBlockMap()
        a = CacheBlock(block_id=1)
        cache.insert(BlockHash(b"h"), a)
        assert cache.pop(BlockHash(b"h"), 2) is None
        assert cache.pop(BlockHash(b"x"), 1) is None
        assert cache.get_block(BlockHash(b"h")) is a

    def test_get_prefers_a_referenced_duplicate(self):
        """Among duplicates, get_block returns one that is referenced."""
        cache = BlockHashToBlockMap()
        free, held = CacheBlock(block_id=1), CacheBlock(block_id=2, ref_count=1)
        cache.insert(BlockHash(b"h"), free)
        cache.insert(BlockHash(b"h"), held)
        assert cache.get_block(BlockHash(b"h")) is held

    def test_clear(self):
        """clear forgets every entry."""
        cache = BlockHashToBlockMap()
        cache.insert(BlockHash(b"h"), CacheBlock(block_id=1))
        cache.clear()
        assert len(cache) == 0 and cache.get_block(BlockHash(b"h")) is None


class TestBlockTable:
    def test_add_block(self):
        """add_block appends an id and adds its tokens."""
        table = BlockTable("r")
        table.add_block(3, 4)
        table.add_block(5, 2)
        assert table.block_ids == [3, 5] and table.num_tokens == 6 and len(table) == 2

    def test_copy_is_independent(self):
        """copy gives a new request id and its own list of ids."""
        table = BlockTable("r", [1, 2], 8)
        other = table.copy("s")
        other.block_ids.append(3)
        assert (other.request_id, other.num_tokens) == ("s", 8)
        assert table.block_ids == [1, 2]


class TestCacheStats:
    def test_fields(self):
        """CacheStats has the seed's fields, all zero by default."""
        assert vars(CacheStats()) == dict.fromkeys(
            [
                "total_blocks",
                "allocated_blocks",
                "free_blocks",
                "shared_blocks",
                "total_tokens_cached",
                "cache_hits",
                "cache_misses",
                "cow_copies",
                "evictions",
            ],
            0,
        )


class TestManagerInit:
    def test_defaults(self):
        """The defaults are the seed's: 64-token blocks, 1000 blocks, caching on."""
        mgr = PagedCacheManager()
        assert (mgr.block_size, mgr.max_blocks, mgr.enable_caching) == (64, 1000, True)
        assert mgr.free_blocks == 999
        mgr.check_invariants()

    def test_null_block(self, mgr):
        """Block 0 is the null block: referenced, never free."""
        assert mgr.null_block is mgr.blocks[0] and mgr.null_block.is_null
        assert mgr.null_block.ref_count == 1
        assert 0 in mgr.allocated_blocks and 0 not in queue_ids(mgr)
        assert len(mgr.allocated_blocks) == 1

    def test_initial_stats(self, mgr):
        """The statistics start with the null block allocated and the rest free."""
        stats = mgr.stats
        assert (stats.total_blocks, stats.allocated_blocks, stats.free_blocks) == (9, 1, 8)
        assert stats.cache_hits == stats.cache_misses == stats.evictions == 0

    @pytest.mark.parametrize(
        "kwargs",
        [
            {"block_size": 0},
            {"block_size": -1},
            {"block_size": 2.5},
            {"max_blocks": 0},
            {"max_blocks": True},
            {"max_blocks": "8"},
        ],
    )
    def test_bad_sizes(self, kwargs):
        """Sizes that are not positive ints are rejected with InvalidInput."""
        with pytest.raises(InvalidInput):
            PagedCacheManager(**kwargs)

    def test_single_block_pool(self):
        """A pool of only the null block has no free block and zero usage."""
        mgr = PagedCacheManager(block_size=2, max_blocks=1)
        assert mgr.free_blocks == 0 and mgr.usage == 0.0
        assert mgr.allocate_block() is None
        mgr.check_invariants()

    def test_module_reexports(self):
        """BlockHash and compute_block_hash are the block_hash module's."""
        from mlxkv.cache import block_hash

        assert compute_block_hash is block_hash.compute_block_hash
        assert BlockHash is block_hash.BlockHash


class TestOwnership:
    def test_a_dropped_manager_is_freed_at_once(self):
        """The manager, its pool and their payloads form no reference cycle: dropped,
        they are freed without waiting for the garbage collector."""
        import gc
        import weakref

        gc.disable()
        try:
            mgr = PagedCacheManager(block_size=BS, max_blocks=9)
            blocks = mgr.get_new_blocks(2)
            mgr.register_block_hash(blocks[0], tokens(BS))
            refs = (weakref.ref(mgr), weakref.ref(mgr.pool))
            del mgr, blocks
            assert all(ref() is None for ref in refs)
        finally:
            gc.enable()


class TestAllocatedBlocks:
    def test_view_follows_reference_counts(self, mgr):
        """allocated_blocks maps the ids of referenced blocks to the blocks, live."""
        a, b = mgr.pool.allocate(2)
        view = mgr.allocated_blocks
        assert sorted(view) == [0, a.block_id, b.block_id] and len(view) == 3
        assert view[a.block_id] is a and view.get(b.block_id) is b
        mgr.pool.release([a])
        assert a.block_id not in view and view.get(a.block_id) is None
        with pytest.raises(KeyError):
            view[a.block_id]
        assert view.get(-1) is None and view.get(99) is None and view.get("x") is None
        assert dict(view) == {0: mgr.null_block, b.block_id: b}

    def test_view_is_read_only(self, mgr):
        """allocated_blocks cannot be written to."""
        with pytest.raises(TypeError):
            mgr.allocated_blocks[3] = mgr.blocks[3]


class TestEvictOnReuse:
    def test_reused_block_is_never_served_for_old_content(self, mgr):
        """A freed block that is reallocated loses its hash everywhere at that moment."""
        prompt = tokens(4)
        (block,) = cached_prompt(mgr, prompt)
        block.cache_data = "old kv"
        mgr.register_block_hash(block, prompt)
        mgr.pool.release([block])
        taken = mgr.pool.allocate(8)
        assert block in taken
        assert block.block_hash is None and block.hash_value is None
        assert block.cache_data is None and block.token_count == 0
        assert mgr.get_computed_blocks(prompt) == ([], 0)
        assert mgr.pool.acquire(hash_block_chain(prompt, BS)) == []
        assert mgr.find_cached_block(prompt) is None
        assert mgr.hash_to_block == {}
        mgr.check_invariants()

    def test_reuse_through_allocate_block(self, mgr):
        """allocate_block evicts like allocate."""
        prompt = tokens(4)
        mgr.pool.release(cached_prompt(mgr, prompt))
        for _ in range(8):
            mgr.allocate_block()
        assert mgr.pool.lookup(hash_block_chain(prompt, BS)) == 0
        mgr.check_invariants()


class TestPayloadOnRelease:
    @pytest.mark.parametrize("release", ["release", "free_block", "free_block_batch"])
    def test_unhashed_block_drops_payload_when_freed(self, mgr, release):
        """A block nobody can look up loses its payload with its last reference."""
        (block,) = mgr.pool.allocate(1)
        block.cache_data = "private kv"
        if release == "free_block":
            mgr.free_block(block.block_id)
        elif release == "release":
            mgr.pool.release([block])
        else:
            mgr.free_block_batch([block])
        assert block.cache_data is None
        mgr.check_invariants()

    def test_hashed_block_keeps_payload_until_reused(self, mgr):
        """A cached block stays servable after release: its payload stays."""
        prompt = tokens(4)
        (block,) = mgr.pool.allocate(1)
        mgr.pool.commit(block, hash_block_chain(prompt, BS)[0], num_tokens=BS, cache_data="kv")
        mgr.pool.release([block])
        assert block.cache_data == "kv"
        assert mgr.pool.acquire(hash_block_chain(prompt, BS)) == [block]

    def test_shared_block_keeps_payload_while_referenced(self, mgr):
        """Dropping one of two references leaves the payload in place."""
        (block,) = mgr.pool.allocate(1)
        block.cache_data = "private kv"
        mgr.increment_ref(block.block_id)
        mgr.pool.release([block])
        assert block.cache_data == "private kv"


class TestSeedAllocation:
    def test_allocate_block(self, mgr):
        """allocate_block returns one fresh block with one reference."""
        block = mgr.allocate_block()
        assert block.ref_count == 1 and not block.is_null and mgr.free_blocks == 7

    def test_allocate_block_exhausted(self, mgr, caplog):
        """allocate_block returns None, with a warning, when no block is free."""
        mgr.pool.allocate(8)
        with caplog.at_level(logging.WARNING, logger="mlxkv.cache.paged"):
            assert mgr.allocate_block() is None
        assert caplog.records
        mgr.check_invariants()

    def test_get_new_blocks(self, mgr):
        """get_new_blocks allocates all or raises a ValueError."""
        assert len(mgr.get_new_blocks(3)) == 3
        with pytest.raises(ValueError):
            mgr.get_new_blocks(6)
        with pytest.raises(ValueError):
            mgr.get_new_blocks(-1)
        assert mgr.free_blocks == 5

    def test_free_block(self, mgr):
        """free_block returns True when the block becomes free, False while still referenced."""
        block = mgr.allocate_block()
        mgr.increment_ref(block.block_id)
        assert mgr.free_block(block.block_id) is False
        assert mgr.free_block(block.block_id) is True
        assert block.block_id in queue_ids(mgr)
        mgr.check_invariants()

    @pytest.mark.parametrize("bad", [0, 3, -1, -8, 9, 100, "x", None, 2.0])
    def test_free_block_bad_id(self, mgr, bad, caplog):
        """free_block of the null block or of an unallocated id returns False with a warning."""
        mgr.pool.allocate(2)  # blocks 1 and 2
        before = snapshot(mgr)
        with caplog.at_level(logging.WARNING, logger="mlxkv.cache.paged"):
            assert mgr.free_block(bad) is False
        assert caplog.records
        assert snapshot(mgr) == before
        mgr.check_invariants()

    def test_decrement_ref_is_free_block(self, mgr):
        """decrement_ref behaves like free_block."""
        block = mgr.allocate_block()
        assert mgr.decrement_ref(block.block_id) is True
        assert mgr.decrement_ref(block.block_id) is False

    def test_increment_ref(self, mgr, caplog):
        """increment_ref adds a reference to an allocated block and refuses others."""
        block = mgr.allocate_block()
        assert mgr.increment_ref(block.block_id) is True and block.ref_count == 2
        with caplog.at_level(logging.WARNING, logger="mlxkv.cache.paged"):
            assert mgr.increment_ref(5) is False
            assert mgr.increment_ref(0) is False
        assert len(caplog.records) == 2
        assert mgr.null_block.ref_count == 1
        mgr.check_invariants()

    def test_free_block_batch(self, mgr):
        """free_block_batch releases every block and skips the null block."""
        blocks = mgr.get_new_blocks(3)
        mgr.free_block_batch([mgr.null_block] + blocks)
        assert mgr.free_blocks == 8 and mgr.null_block.ref_count == 1
        mgr.check_invariants()

    def test_free_block_batch_double_free(self, mgr):
        """free_block_batch with an unreferenced block raises DoubleFree, nothing changes."""
        a, b = mgr.get_new_blocks(2)
        mgr.free_block_batch([b])
        before = snapshot(mgr)
        with pytest.raises(DoubleFree):
            mgr.free_block_batch([mgr.null_block, a, b])
        assert snapshot(mgr) == before
        mgr.check_invariants()

    def test_free_blocks_is_a_count(self, mgr):
        """free_blocks is the int property, not the seed's shadowed batch method."""
        assert mgr.free_blocks == 8 and isinstance(mgr.free_blocks, int)

    def test_touch(self, mgr):
        """touch adds a reference, reviving free blocks, and skips the null block."""
        prompt = tokens(8)
        blocks = cached_prompt(mgr, prompt)
        mgr.pool.release(blocks)
        found, _ = mgr.get_computed_blocks(prompt)
        mgr.touch(found + [mgr.null_block])
        assert all(b.ref_count == 1 for b in blocks) and mgr.free_blocks == 6
        assert mgr.null_block.ref_count == 1
        mgr.touch(found)
        assert all(b.ref_count == 2 for b in blocks)
        mgr.check_invariants()

    def test_touch_foreign_block(self, mgr):
        """touch with a block of another manager raises InvalidInput and changes nothing."""
        (a,) = mgr.pool.allocate(1)
        other = PagedCacheManager(block_size=BS, max_blocks=9).pool.allocate(1)[0]
        with pytest.raises(InvalidInput):
            mgr.touch([a, other])
        assert a.ref_count == 1
        mgr.check_invariants()

    def test_allocate_blocks_for_tokens(self, mgr):
        """allocate_blocks_for_tokens allocates ceil(tokens / block_size) blocks."""
        assert len(mgr.allocate_blocks_for_tokens(0)) == 0
        assert len(mgr.allocate_blocks_for_tokens(1)) == 1
        assert len(mgr.allocate_blocks_for_tokens(BS)) == 1
        assert len(mgr.allocate_blocks_for_tokens(BS + 1)) == 2
        assert mgr.free_blocks == 4

    def test_allocate_blocks_for_tokens_all_or_nothing(self, mgr):
        """Too many tokens raise a ValueError and allocate nothing."""
        with pytest.raises(ValueError):
            mgr.allocate_blocks_for_tokens(8 * BS + 1)
        with pytest.raises(InvalidInput):
            mgr.allocate_blocks_for_tokens(-1)
        assert mgr.free_blocks == 8


class TestPrefixCaching:
    def test_cache_then_compute(self, mgr):
        """get_computed_blocks finds the blocks cache_full_blocks published."""
        prompt = tokens(10)
        blocks = cached_prompt(mgr, prompt)
        found, n = mgr.get_computed_blocks(prompt)
        assert found == blocks and n == 2 * BS
        assert [b.token_count for b in blocks] == [BS, BS]
        assert mgr.stats.cache_hits == 2 and mgr.stats.cache_misses == 0
        mgr.check_invariants()

    def test_hashes_are_the_chain(self, mgr):
        """cache_full_blocks hashes with hash_block_chain, so acquire finds its blocks."""
        prompt = tokens(12)
        blocks = cached_prompt(mgr, prompt)
        assert [b.block_hash for b in blocks] == hash_block_chain(prompt, BS)
        assert mgr.pool.acquire(hash_block_chain(prompt, BS)) == blocks

    def test_partial_match_counts_a_miss(self, mgr):
        """A prompt that diverges after one block matches one block and counts one miss."""
        cached_prompt(mgr, tokens(8))
        found, n = mgr.get_computed_blocks(tokens(4) + tokens(4, start=50))
        assert len(found) == 1 and n == BS
        assert (mgr.stats.cache_hits, mgr.stats.cache_misses) == (1, 1)

    def test_position_matters(self, mgr):
        """The same block content after a different prefix is not a hit."""
        cached_prompt(mgr, tokens(4) + tokens(4, start=100))
        found, _ = mgr.get_computed_blocks(tokens(4, start=100))
        assert found == []
        found, _ = mgr.get_computed_blocks(tokens(4, start=7) + tokens(4, start=100))
        assert found == []

    def test_empty_and_short_prompts(self, mgr):
        """Prompts shorter than a block find nothing and count nothing."""
        assert mgr.get_computed_blocks([]) == ([], 0)
        assert mgr.get_computed_blocks(tokens(BS - 1)) == ([], 0)
        assert mgr.stats.cache_hits == mgr.stats.cache_misses == 0

    def test_long_prompt(self):
        """A long prompt is matched across the doubling conversion chunks."""
        mgr = PagedCacheManager(block_size=2, max_blocks=80)
        prompt = tokens(2 * 70 + 1)
        blocks = cached_prompt(mgr, prompt)
        assert mgr.get_computed_blocks(prompt)[0] == blocks
        assert mgr.get_computed_blocks(prompt)[0] == blocks  # memoised hashes
        diverged = prompt[:100] + [9999] + prompt[101:]
        assert mgr.get_computed_blocks(diverged)[0] == blocks[:50]

    def test_memo_never_outlives_eviction(self, mgr):
        """After eviction, a prompt whose hashes were memoised is a miss."""
        prompt = tokens(8)
        mgr.pool.release(cached_prompt(mgr, prompt))
        assert len(mgr.get_computed_blocks(prompt)[0]) == 2
        mgr.pool.evict(2)
        assert mgr.get_computed_blocks(prompt) == ([], 0)

    def test_bad_tokens(self, mgr):
        """Token ids outside [0, 2**32) raise InvalidInput."""
        with pytest.raises(InvalidInput):
            mgr.get_computed_blocks([1, 2, -3, 4])
        blocks = mgr.pool.allocate(1)
        with pytest.raises(InvalidInput):
            mgr.cache_full_blocks(blocks, [1, 2, 3, 2**32], 0, 1)
        assert blocks[0].block_hash is None

    def test_incremental_caching(self, mgr):
        """Caching block by block gives the same hashes as caching all at once."""
        prompt = tokens(12)
        blocks = mgr.pool.allocate(3)
        for i in range(3):
            mgr.cache_full_blocks(blocks, prompt, i, i + 1)
        assert [b.block_hash for b in blocks] == hash_block_chain(prompt, BS)

    def test_already_hashed_blocks_are_kept(self, mgr):
        """An already hashed block keeps its hash and the chain continues from it."""
        prompt = tokens(12)
        blocks = mgr.pool.allocate(3)
        mgr.pool.commit(blocks[1], BlockHash(b"x" * 32), num_tokens=BS)
        mgr.cache_full_blocks(blocks, prompt, 0, 3)
        chain = hash_block_chain(prompt, BS)
        assert blocks[0].block_hash == chain[0]
        assert blocks[1].block_hash == b"x" * 32
        assert blocks[2].block_hash == hash_block_chain(prompt[8:], BS, parent_hash=b"x" * 32)[0]
        mgr.check_invariants()

    def test_unpublished_parent(self, mgr):
        """With an unhashed parent block, the chain is hashed from the first token."""
        prompt = tokens(8)
        blocks = mgr.pool.allocate(2)
        mgr.cache_full_blocks(blocks, prompt, 1, 2)
        assert blocks[0].block_hash is None
        assert blocks[1].block_hash == hash_block_chain(prompt, BS)[1]

    def test_nothing_to_cache(self, mgr):
        """num_cached_blocks >= num_full_blocks is a no-op."""
        blocks = mgr.pool.allocate(2)
        mgr.cache_full_blocks(blocks, tokens(8), 2, 2)
        mgr.cache_full_blocks(blocks, tokens(8), 2, 1)
        assert all(b.block_hash is None for b in blocks)

    @pytest.mark.parametrize(
        "args",
        [
            ("few_blocks", tokens(12), 0, 3),
            ("blocks", tokens(7), 0, 2),
            ("blocks", tokens(8), -1, 2),
            ("null", tokens(8), 0, 2),
            ("foreign", tokens(8), 0, 2),
        ],
    )
    def test_cache_full_blocks_bad_input(self, mgr, args):
        """Too few blocks or tokens, bad counts or foreign blocks raise InvalidInput."""
        kind, token_ids, first, stop = args
        blocks = mgr.pool.allocate(2)
        if kind == "null":
            blocks = [blocks[0], mgr.null_block]
        elif kind == "foreign":
            blocks = [blocks[0], CacheBlock(block_id=blocks[1].block_id, ref_count=1)]
        before = snapshot(mgr)
        with pytest.raises(InvalidInput):
            mgr.cache_full_blocks(blocks, token_ids, first, stop)
        assert snapshot(mgr) == before
        mgr.check_invariants()

    def test_caching_disabled(self):
        """Without caching, nothing is published and nothing is found."""
        mgr = PagedCacheManager(block_size=BS, max_blocks=4, enable_caching=False)
        blocks = cached_prompt(mgr, tokens(8))
        assert all(b.block_hash is None for b in blocks)
        assert mgr.get_computed_blocks(tokens(8)) == ([], 0)
        assert mgr.get_cached_block(hash_block_chain(tokens(4), BS)[0]) is None
        assert mgr.stats.cache_hits == mgr.stats.cache_misses == 0

    def test_get_cached_block(self, mgr):
        """get_cached_block returns a cached block and counts hits and misses."""
        (block,) = cached_prompt(mgr, tokens(4))
        assert mgr.get_cached_block(block.block_hash) is block
        assert mgr.get_cached_block(BlockHash(b"nope")) is None
        assert (mgr.stats.cache_hits, mgr.stats.cache_misses) == (1, 1)
        assert block.ref_count == 1


class TestLegacyHash:
    def test_compute_block_hash(self):
        """The legacy hash is 16 hex digits of SHA-256 over big-endian uint32 tokens."""
        ids = [0, 1, 255, 65536, 2**32 - 1]
        expected = hashlib.sha256(struct.pack(">5I", *ids)).hexdigest()[:16]
        assert PagedCacheManager.compute_block_hash(ids) == expected
        assert PagedCacheManager(block_size=2, max_blocks=2).compute_block_hash(ids) == expected
        assert PagedCacheManager.compute_block_hash([]) == hashlib.sha256(b"").hexdigest()[:16]

    def test_register_and_find(self, mgr):
        """A registered, referenced block is found by its content; stats count it."""
        block = mgr.allocate_block()
        mgr.register_block_hash(block, tokens(4))
        assert block.hash_value == mgr.compute_block_hash(tokens(4))
        assert mgr.find_cached_block(tokens(4)) is block
        assert mgr.find_cached_block(tokens(4, start=1)) is None
        assert (mgr.stats.cache_hits, mgr.stats.cache_misses) == (1, 1)
        mgr.check_invariants()

    def test_free_block_is_not_found(self, mgr):
        """A registered block that is free is not found."""
        block = mgr.allocate_block()
        mgr.register_block_hash(block, tokens(4))
        mgr.free_block(block.block_id)
        assert mgr.find_cached_block(tokens(4)) is None

    def test_reregister_moves_the_key(self, mgr):
        """Registering a block again replaces its old legacy entry."""
        block = mgr.allocate_block()
        mgr.register_block_hash(block, tokens(4))
        mgr.register_block_hash(block, tokens(4, start=9))
        assert mgr.hash_to_block == {mgr.compute_block_hash(tokens(4, start=9)): block.block_id}
        mgr.check_invariants()

    def test_chained_caching_does_not_feed_the_legacy_index(self, mgr):
        """Blocks published by chained hash are not found by content alone."""
        cached_prompt(mgr, tokens(8))
        assert mgr.hash_to_block == {}
        assert mgr.find_cached_block(tokens(4, start=4)) is None


class TestBlockTables:
    def test_create_get(self, mgr):
        """create_block_table registers an empty table that get_block_table returns."""
        table = mgr.create_block_table("r")
        assert mgr.get_block_table("r") is table and len(table) == 0
        assert mgr.get_block_table("missing") is None
        assert mgr.get_or_create_block_table("r") is table
        assert mgr.get_or_create_block_table("s").request_id == "s"

    def test_create_twice(self, mgr):
        """Creating a second table for one request raises DuplicateRequest and keeps the first."""
        table = mgr.create_block_table("r")
        table.block_ids.append(mgr.allocate_block().block_id)
        with pytest.raises(DuplicateRequest):
            mgr.create_block_table("r")
        assert mgr.get_block_table("r") is table
        mgr.check_invariants()

    def test_add_block_to_table(self, mgr):
        """add_block_to_table appends the block and sets its token count."""
        table = mgr.create_block_table("r")
        block = mgr.allocate_block()
        mgr.add_block_to_table(table, block, 3)
        assert table.block_ids == [block.block_id] and table.num_tokens == 3
        assert block.token_count == 3 and block.ref_count == 1
        assert mgr.get_stats().total_tokens_cached == 3
        mgr.check_invariants()

    @pytest.mark.parametrize("bad", ["free", "null", "foreign", -1, BS + 1, 1.5])
    def test_add_block_to_table_bad_input(self, mgr, bad):
        """Free, null or foreign blocks and bad token counts raise InvalidInput."""
        table = mgr.create_block_table("r")
        block = mgr.allocate_block()
        count = 2
        if bad == "free":
            mgr.free_block(block.block_id)
        elif bad == "null":
            block = mgr.null_block
        elif bad == "foreign":
            block = CacheBlock(block_id=block.block_id, ref_count=1)
        else:
            count = bad
        with pytest.raises(InvalidInput):
            mgr.add_block_to_table(table, block, count)
        assert table.block_ids == [] and table.num_tokens == 0
        mgr.check_invariants()

    def test_delete_releases_tail_first(self, mgr):
        """delete_block_table releases the table's blocks, last block first."""
        table = mgr.create_block_table("r")
        blocks = mgr.pool.allocate(3)
        for block in blocks:
            mgr.add_block_to_table(table, block, BS)
        mgr.delete_block_table("r")
        assert mgr.get_block_table("r") is None
        assert queue_ids(mgr)[-3:] == [b.block_id for b in reversed(blocks)]
        mgr.check_invariants()

    def test_delete_unknown(self, mgr, caplog):
        """Deleting an unknown request logs a warning and changes nothing."""
        before = snapshot(mgr)
        with caplog.at_level(logging.WARNING, logger="mlxkv.cache.paged"):
            mgr.delete_block_table("ghost")
        assert caplog.records and snapshot(mgr) == before

    def test_delete_inconsistent_table(self, mgr, caplog):
        """A table listing an unallocated id is dropped; its valid blocks are still freed."""
        table = mgr.create_block_table("r")
        block = mgr.allocate_block()
        mgr.add_block_to_table(table, block, BS)
        table.block_ids.append(7)
        with caplog.at_level(logging.WARNING, logger="mlxkv.cache.paged"):
            mgr.delete_block_table("r")
        assert block.ref_count == 0 and "r" not in mgr.request_tables
        mgr.check_invariants()

    def test_fork(self, mgr):
        """fork_block_table shares every block and adds one reference to each."""
        table = mgr.create_block_table("r")
        blocks = mgr.pool.allocate(2)
        for block in blocks:
            mgr.add_block_to_table(table, block, BS)
        child = mgr.fork_block_table(table, "c")
        assert child.block_ids == table.block_ids and child.block_ids is not table.block_ids
        assert child.num_tokens == 2 * BS and mgr.get_block_table("c") is child
        assert all(b.ref_count == 2 for b in blocks)
        assert mgr.get_stats().shared_blocks == 2
        mgr.check_invariants()
        mgr.delete_block_table("r")
        mgr.delete_block_table("c")
        assert mgr.free_blocks == 8
        mgr.check_invariants()

    def test_fork_with_null_block(self, mgr):
        """The null block in a table is shared without a reference change."""
        table = mgr.create_block_table("r")
        table.block_ids.append(0)
        mgr.fork_block_table(table, "c")
        assert mgr.null_block.ref_count == 1
        mgr.delete_block_table("c")
        mgr.delete_block_table("r")
        assert mgr.null_block.ref_count == 1
        mgr.check_invariants()

    def test_fork_errors(self, mgr):
        """Forking onto a live request or from a table with a free block changes nothing."""
        table = mgr.create_block_table("r")
        block = mgr.allocate_block()
        mgr.add_block_to_table(table, block, BS)
        mgr.create_block_table("c")
        with pytest.raises(DuplicateRequest):
            mgr.fork_block_table(table, "c")
        stale = BlockTable("s", [block.block_id, 5])
        with pytest.raises(InvalidInput):
            mgr.fork_block_table(stale, "d")
        assert block.ref_count == 1 and "d" not in mgr.request_tables
        mgr.check_invariants()

    def test_find_shared_prefix(self, mgr):
        """find_shared_prefix returns held blocks by chained hash and the tokens after them."""
        prompt = tokens(9)
        blocks = cached_prompt(mgr, prompt)
        ids, rest = mgr.find_shared_prefix(prompt + [77])
        assert ids == [b.block_id for b in blocks] and rest == [8, 77]
        assert mgr.stats.cache_hits == 2 and mgr.stats.cache_misses == 0
        ids, rest = mgr.find_shared_prefix(prompt[:4] + [50, 51, 52, 53])
        assert ids == [blocks[0].block_id] and rest == [50, 51, 52, 53]
        assert mgr.stats.cache_misses == 1

    def test_find_shared_prefix_held_only(self, mgr):
        """Free cached blocks are not offered for sharing by id."""
        prompt = tokens(8)
        blocks = cached_prompt(mgr, prompt)
        mgr.pool.release([blocks[1]])
        ids, rest = mgr.find_shared_prefix(prompt)
        assert ids == [blocks[0].block_id] and rest == prompt[4:]

    def test_find_shared_prefix_is_exact(self, mgr):
        """A block with the same content at another position is not shared."""
        block = mgr.allocate_block()
        mgr.register_block_hash(block, tokens(4, start=4))
        cached_prompt(mgr, tokens(8, start=100))
        ids, rest = mgr.find_shared_prefix(tokens(4, start=4))
        assert ids == [] and rest == tokens(4, start=4)

    def test_find_shared_prefix_empty(self, mgr):
        """An empty prompt shares nothing."""
        assert mgr.find_shared_prefix([]) == ([], [])


class TestCopyOnWrite:
    def shared_table(self, mgr, data=None):
        table = mgr.create_block_table("r")
        block = mgr.allocate_block()
        block.cache_data = data
        mgr.add_block_to_table(table, block, BS)
        child = mgr.fork_block_table(table, "c")
        return table, child, block

    def test_unshared_blocks_are_returned(self, mgr):
        """Blocks with one reference are returned as they are."""
        table = mgr.create_block_table("r")
        block = mgr.allocate_block()
        mgr.add_block_to_table(table, block, BS)
        assert mgr.get_blocks_for_generation(table) == ([block], False)
        assert mgr.stats.cow_copies == 0

    def test_shared_block_is_copied(self, mgr):
        """A shared block is replaced by a private copy in the writer's table only."""
        table, child, block = self.shared_table(mgr, data=[("k", "v")])
        blocks, copied = mgr.get_blocks_for_generation(child)
        (new,) = blocks
        assert copied and new is not block
        assert child.block_ids == [new.block_id] and table.block_ids == [block.block_id]
        assert block.ref_count == 1 and new.ref_count == 1
        assert new.token_count == BS and new.block_hash is None
        assert new.cache_data == [("k", "v")] and new.cache_data is not block.cache_data
        assert mgr.stats.cow_copies == 1
        mgr.check_invariants()

    def test_copy_owns_its_mlx_buffers(self, mgr):
        """Changing the source block's MLX arrays afterwards does not change the copy."""
        keys = mx.arange(12, dtype=mx.float32).reshape(1, 1, 3, 4)
        values = mx.ones((1, 1, 3, 4))
        mx.eval(keys, values)
        table, child, block = self.shared_table(mgr, data=[(keys, values)])
        (new,), _ = mgr.get_blocks_for_generation(child)
        new_keys, new_values = new.cache_data[0]
        assert new_keys is not keys and new_values is not values
        keys[..., 0] = -1.0  # in place on the source's array object
        block.cache_data[0] = (mx.zeros((1,)), mx.zeros((1,)))
        block.cache_data.append("extra")
        assert mx.array_equal(new_keys, mx.arange(12, dtype=mx.float32).reshape(1, 1, 3, 4))
        assert mx.array_equal(new_values, mx.ones((1, 1, 3, 4)))
        assert len(new.cache_data) == 1

    def test_copy_of_dict_and_numpy_payloads(self, mgr):
        """Dict payloads are rebuilt and NumPy arrays copied."""
        state = np.arange(4)
        table, child, block = self.shared_table(mgr, data=[{"state": (state,), "meta": "x"}])
        (new,), _ = mgr.get_blocks_for_generation(child)
        state[0] = 99
        block.cache_data[0]["meta"] = "changed"
        assert new.cache_data[0]["meta"] == "x"
        assert new.cache_data[0]["state"][0].tolist() == [0, 1, 2, 3]

    def test_copy_without_free_block(self, mgr, caplog):
        """When no block is free, the shared block is returned and a warning logged."""
        table, child, block = self.shared_table(mgr)
        mgr.pool.allocate(mgr.free_blocks)
        with caplog.at_level(logging.WARNING, logger="mlxkv.cache.paged"):
            blocks, copied = mgr.get_blocks_for_generation(child)
        assert blocks == [block] and not copied and caplog.records
        assert block.ref_count == 2
        mgr.check_invariants()

    def test_cow_copy_of_unshared_block_frees_source(self, mgr):
        """Copying a block with one reference moves that reference to the copy."""
        block = mgr.allocate_block()
        block.cache_data = ["kv"]
        copied = mgr._cow_copy_block(block)
        assert block.ref_count == 0 and block.block_id in queue_ids(mgr)
        assert copied.ref_count == 1 and copied.cache_data == ["kv"]
        mgr.check_invariants()

    def test_cow_copy_of_unreferenced_block(self, mgr):
        """Copying a block nobody holds raises InvalidInput and allocates nothing."""
        block = mgr.blocks[3]
        with pytest.raises(InvalidInput):
            mgr._cow_copy_block(block)
        assert mgr.free_blocks == 8

    def test_table_with_stale_id(self, mgr, caplog):
        """Ids that are not allocated are skipped with a warning."""
        table = BlockTable("x", [4])
        with caplog.at_level(logging.WARNING, logger="mlxkv.cache.paged"):
            assert mgr.get_blocks_for_generation(table) == ([], False)
        assert caplog.records


class TestEvictionAndPressure:
    def test_evict_drops_least_recently_freed_cached_blocks(self, mgr):
        """evict drops the hashes of the least recently freed cached blocks, skipping others."""
        first = cached_prompt(mgr, tokens(4))
        second = cached_prompt(mgr, tokens(4, start=10))
        held = cached_prompt(mgr, tokens(4, start=20))
        mgr.pool.release(second + first)
        order = queue_ids(mgr)
        assert mgr.pool.evict(1) == 1
        assert second[0].block_hash is None and first[0].block_hash is not None
        assert held[0].block_hash is not None
        assert queue_ids(mgr) == order  # nothing moved
        assert mgr.stats.evictions == 1
        assert mgr.pool.evict(10) == 1
        assert mgr.pool.evict(10) == 0
        mgr.check_invariants()

    def test_evict_lru_blocks_counts_every_cleared_free_block(self, mgr):
        """evict_lru_blocks clears the n free blocks at the LRU end, hashed or not, as the seed."""
        fresh = mgr.free_blocks - 1  # never used, at the LRU end
        blocks = cached_prompt(mgr, tokens(4))
        mgr.pool.release(blocks)
        assert queue_ids(mgr)[-1] == blocks[0].block_id
        order = queue_ids(mgr)
        assert mgr.evict_lru_blocks(fresh) == fresh
        assert blocks[0].block_hash is not None  # not reached
        assert mgr.evict_lru_blocks(fresh + 1) == fresh + 1
        assert blocks[0].block_hash is None and blocks[0].cache_data is None
        assert queue_ids(mgr) == order  # cleared blocks stay first in line
        assert mgr.stats.evictions == 1
        assert mgr.evict_lru_blocks(100) == mgr.free_blocks == 8
        assert mgr.pool.take_evicted() == hash_block_chain(tokens(4), BS)
        mgr.check_invariants()

    def test_evict_lru_blocks_drops_payloads_and_legacy_hashes(self, mgr):
        """A free block with only a payload or a legacy hash is cleared of it too."""
        block = mgr.allocate_block()
        mgr.register_block_hash(block, tokens(4))
        block.cache_data = ["kv"]
        mgr.free_block(block.block_id)
        assert block.hash_value is not None and block.cache_data == ["kv"]
        assert mgr.evict_lru_blocks(mgr.free_blocks) == 8
        assert block.hash_value is None and block.cache_data is None
        assert mgr.hash_to_block == {}
        mgr.check_invariants()

    @pytest.mark.parametrize("owner", ["pool", "manager"])
    def test_evict_bad_count(self, mgr, owner):
        """A negative or non-int count raises InvalidInput (the pool's evict, the seed's evict_lru_blocks)."""
        evict = mgr.pool.evict if owner == "pool" else mgr.evict_lru_blocks
        with pytest.raises(InvalidInput):
            evict(-1)
        with pytest.raises(InvalidInput):
            evict(None)

    def test_handle_memory_pressure(self, mgr, caplog):
        """handle_memory_pressure says whether enough blocks are free, evicting nothing."""
        mgr.pool.release(cached_prompt(mgr, tokens(4)))
        mgr.pool.allocate(5)
        assert mgr.handle_memory_pressure(3) is True
        with caplog.at_level(logging.WARNING, logger="mlxkv.cache.paged"):
            assert mgr.handle_memory_pressure(4) is False
        assert caplog.records
        assert mgr.pool.lookup(hash_block_chain(tokens(4), BS)) == 1


class TestStatsAndResets:
    def test_usage(self, mgr):
        """usage is the referenced fraction of the non-null blocks."""
        assert mgr.usage == 0.0
        mgr.pool.allocate(2)
        assert mgr.usage == pytest.approx(0.25)

    def test_stats_track_the_state(self, mgr):
        """The block counts in stats follow allocation without get_stats."""
        mgr.pool.allocate(3)
        assert (mgr.stats.allocated_blocks, mgr.stats.free_blocks) == (4, 5)

    def test_get_stats(self, mgr):
        """get_stats counts shared blocks, and tokens of blocks in tables only."""
        prompt = tokens(8)
        blocks = cached_prompt(mgr, prompt)
        mgr.touch(blocks[:1])
        stats = mgr.get_stats()
        assert stats is mgr.get_stats()
        assert (stats.shared_blocks, stats.total_tokens_cached) == (1, 0)
        table = mgr.create_block_table("r")
        mgr.add_block_to_table(table, blocks[0], BS)
        mgr.add_block_to_table(table, blocks[1], 3)
        assert mgr.get_stats().total_tokens_cached == BS + 3
        mgr.delete_block_table("r")
        mgr.pool.release(blocks[:1])
        assert mgr.get_stats().total_tokens_cached == 0

    def test_total_tokens_cached_counts_table_blocks_once(self, mgr):
        """Blocks shared by tables (a fork) count once; a deleted table's blocks stop counting."""
        table = mgr.create_block_table("a")
        for count in (BS, 2):
            mgr.add_block_to_table(table, mgr.allocate_block(), count)
        mgr.allocate_block().token_count = BS  # held, but in no table
        mgr.fork_block_table(table, "b")
        assert mgr.get_stats().total_tokens_cached == BS + 2
        mgr.delete_block_table("a")
        assert mgr.get_memory_usage()["total_tokens_cached"] == BS + 2
        mgr.delete_block_table("b")
        assert mgr.get_memory_usage()["total_tokens_cached"] == 0

    def test_get_memory_usage(self, mgr):
        """get_memory_usage has the seed's keys and values."""
        prompt = tokens(4)
        cached_prompt(mgr, prompt)
        mgr.get_computed_blocks(prompt)
        mgr.get_computed_blocks(tokens(4, start=50))
        usage = mgr.get_memory_usage()
        assert usage == {
            "block_size": BS,
            "max_blocks": 9,
            "allocated_blocks": 2,
            "free_blocks": 7,
            "shared_blocks": 0,
            "total_tokens_cached": 0,
            "utilization": 2 / 9,
            "cache_hit_rate": 0.5,
        }

    def test_hit_rate_without_lookups(self, mgr):
        """The hit rate is 0 before any lookup."""
        assert mgr.get_memory_usage()["cache_hit_rate"] == 0

    def test_reset_stats(self, mgr):
        """reset_stats zeroes hits, misses, copies and evictions."""
        mgr.get_computed_blocks(tokens(4))
        mgr.stats.cow_copies = mgr.stats.evictions = 3
        mgr.reset_stats()
        stats = mgr.stats
        assert stats.cache_hits == stats.cache_misses == stats.cow_copies == stats.evictions == 0

    def test_reset_prefix_cache_refused_while_in_use(self, mgr, caplog):
        """reset_prefix_cache returns False, with a warning, while blocks are referenced."""
        blocks = cached_prompt(mgr, tokens(4))
        with caplog.at_level(logging.WARNING, logger="mlxkv.cache.paged"):
            assert mgr.reset_prefix_cache() is False
        assert caplog.records and blocks[0].block_hash is not None

    def test_reset_prefix_cache(self, mgr):
        """reset_prefix_cache forgets every cached block and reports the hashes."""
        prompt = tokens(8)
        blocks = cached_prompt(mgr, prompt)
        blocks[0].cache_data = "kv"
        mgr.pool.release(blocks)
        mgr.get_computed_blocks(prompt)
        assert mgr.reset_prefix_cache() is True
        assert all(b.block_hash is None and b.cache_data is None for b in mgr.blocks)
        assert len(mgr.cached_block_hash_to_block) == 0
        assert sorted(mgr.pool.take_evicted()) == sorted(hash_block_chain(prompt, BS))
        assert mgr.stats.cache_hits == 0
        mgr.check_invariants()

    def test_clear(self, mgr):
        """clear starts over; blocks handed out before are no longer accepted."""
        prompt = tokens(8)
        old = cached_prompt(mgr, prompt)
        mgr.create_block_table("r")
        mgr.clear()
        assert mgr.request_tables == {} and mgr.free_blocks == 8
        assert mgr.pool.lookup(hash_block_chain(prompt, BS)) == 0
        assert sorted(mgr.pool.take_evicted()) == sorted(hash_block_chain(prompt, BS))
        assert mgr.blocks[0].is_null and mgr.stats.allocated_blocks == 1
        with pytest.raises(InvalidInput):
            mgr.pool.release(old)
        mgr.check_invariants()


class TestCheckInvariants:
    def test_detects_a_referenced_block_in_the_queue(self, mgr):
        """A queued block with a reference is reported by id."""
        mgr.blocks[3].ref_count = 1
        with pytest.raises(AssertionError, match="block 3"):
            mgr.check_invariants()

    def test_detects_a_lost_block(self, mgr):
        """A block that is neither queued nor referenced is reported."""
        (block,) = mgr.pool.allocate(1)
        block.ref_count = 0
        with pytest.raises(AssertionError, match=f"block {block.block_id}"):
            mgr.check_invariants()

    def test_detects_a_wrong_hash_entry(self, mgr):
        """A hash-map entry whose block holds another hash is reported."""
        (block,) = cached_prompt(mgr, tokens(4))
        block.block_hash = BlockHash(b"other")
        with pytest.raises(AssertionError):
            mgr.check_invariants()

    def test_detects_overlisted_blocks(self, mgr):
        """A block listed by more tables than its references is reported."""
        block = mgr.allocate_block()
        mgr.create_block_table("a").block_ids.append(block.block_id)
        mgr.create_block_table("b").block_ids.append(block.block_id)
        with pytest.raises(AssertionError, match=f"block {block.block_id}"):
            mgr.check_invariants()

    def test_detects_a_table_with_a_free_block(self, mgr):
        """A table listing a free block is reported."""
        mgr.create_block_table("a").block_ids.append(5)
        with pytest.raises(AssertionError, match="'a'"):
            mgr.check_invariants()

    def test_detects_a_broken_queue_count(self, mgr):
        """A wrong num_free_blocks is reported."""
        mgr.free_block_queue.num_free_blocks += 1
        with pytest.raises(AssertionError, match="num_free_blocks"):
            mgr.check_invariants()
