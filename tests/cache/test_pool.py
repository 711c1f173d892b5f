"""The block pool: the one place where a KV block is stored, found, evicted and released."""

from __future__ import annotations

import numpy as np
import pytest

from mlxkv.cache.block_hash import hash_block_chain
from mlxkv.cache.blocks import CacheBlock
from mlxkv.cache.errors import DoubleFree, InvalidInput, OutOfBlocks
from mlxkv.cache.pool import BlockPool

BS = 4


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(block_size=BS, max_blocks=9)


def commit_chain(pool: BlockPool, hashes, data=None) -> list[CacheBlock]:
    """Allocate and commit one full block per hash; the caller holds them."""
    blocks = pool.allocate(len(hashes))
    for block, block_hash in zip(blocks, hashes):
        pool.commit(block, block_hash, num_tokens=BS, cache_data=data)
    return blocks


def queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def snapshot(pool: BlockPool):
    return (
        [(b.ref_count, b.block_hash, b.token_count) for b in pool.blocks],
        queue_ids(pool),
        len(pool.cached_block_hash_to_block),
    )


class TestAllocate:
    def test_fresh_blocks(self, pool):
        """allocate returns distinct, referenced, unhashed, empty, non-null blocks."""
        blocks = pool.allocate(3)
        assert len({b.block_id for b in blocks}) == 3
        for block in blocks:
            assert block.ref_count == 1 and block.block_hash is None
            assert block.cache_data is None and block.token_count == 0 and not block.is_null
            assert pool.allocated_blocks[block.block_id] is block
        assert pool.free_block_queue.num_free_blocks == 5
        pool.check_invariants()

    def test_least_recently_freed_first(self, pool):
        """Blocks come back in the order they were freed."""
        a, b, c = pool.allocate(3)
        pool.release([c, a])
        rest = pool.allocate(7)
        assert rest[-2:] == [c, a]
        assert b not in rest

    def test_zero(self, pool):
        """allocate(0) returns no block and changes nothing."""
        before = snapshot(pool)
        assert pool.allocate(0) == []
        assert snapshot(pool) == before

    def test_all_or_nothing(self, pool):
        """Asking for more than is free raises OutOfBlocks and takes nothing."""
        pool.allocate(5)
        before = snapshot(pool)
        with pytest.raises(OutOfBlocks) as info:
            pool.allocate(4)
        assert (info.value.requested, info.value.available) == (4, 3)
        assert isinstance(info.value, ValueError)
        assert snapshot(pool) == before
        pool.check_invariants()

    @pytest.mark.parametrize("bad", [-1, 1.5, "2", True, None])
    def test_bad_count(self, pool, bad):
        """A count that is not a non-negative int is rejected with InvalidInput."""
        with pytest.raises(InvalidInput):
            pool.allocate(bad)
        assert pool.free_block_queue.num_free_blocks == 8
        pool.check_invariants()

    def test_numpy_count(self, pool):
        """An int-like count (NumPy) is accepted."""
        assert len(pool.allocate(np.int64(2))) == 2

    def test_evicts_cached_blocks_lazily(self, pool):
        """A free cached block keeps its hash until allocation takes it."""
        prompt = tokens(8)
        blocks = commit_chain(pool, hash_block_chain(prompt, BS))
        pool.release(blocks)
        assert pool.lookup(hash_block_chain(prompt, BS)) == 2
        pool.allocate(6)  # the never-used blocks go first
        assert pool.lookup(hash_block_chain(prompt, BS)) == 2
        assert pool.take_evicted() == []
        pool.allocate(1)
        assert pool.lookup(hash_block_chain(prompt, BS)) == 0
        assert pool.take_evicted() == hash_block_chain(prompt, BS)[:1]
        assert pool.statistics().num_evictions == 1
        pool.check_invariants()


class TestCore:
    def chain(self, n_blocks: int, start: int = 0):
        return hash_block_chain(tokens(n_blocks * BS, start), BS)

    def test_commit_then_acquire(self, pool):
        """Committed blocks are acquired by their hash chain, with one more reference."""
        hashes = self.chain(3)
        blocks = commit_chain(pool, hashes, data=("kv",))
        got = pool.acquire(hashes)
        assert got == blocks
        assert [b.block_hash for b in got] == hashes
        assert all(b.ref_count == 2 and b.cache_data == ("kv",) for b in got)
        pool.check_invariants()

    def test_acquire_revives_free_cached_blocks(self, pool):
        """Acquiring a released cached block takes it out of the free queue."""
        hashes = self.chain(2)
        blocks = commit_chain(pool, hashes)
        pool.release(blocks)
        assert pool.free_block_queue.num_free_blocks == 8
        got = pool.acquire(hashes)
        assert got == blocks and all(b.ref_count == 1 for b in got)
        assert pool.free_block_queue.num_free_blocks == 6
        pool.check_invariants()

    def test_acquire_stops_at_first_miss(self, pool):
        """Only the leading cached run is acquired, even if later hashes are cached."""
        hashes = self.chain(3)
        blocks = commit_chain(pool, hashes)
        pool.release([blocks[1]])
        pool.allocate(6)  # every free block, so block 1 is evicted
        assert pool.lookup(hashes) == 1
        assert pool.acquire(hashes) == [blocks[0]]
        assert blocks[2].ref_count == 1

    def test_acquire_counts_hits_and_misses(self, pool):
        """acquire counts a hit per block and one miss when it stops early."""
        hashes = self.chain(3)
        commit_chain(pool, hashes[:2])
        pool.acquire(hashes)
        assert (pool.statistics().num_hits, pool.statistics().num_misses) == (2, 1)
        pool.acquire(hashes[:2])
        assert (pool.statistics().num_hits, pool.statistics().num_misses) == (4, 1)

    def test_lookup_has_no_side_effects(self, pool):
        """lookup changes no reference count, queue position or statistic."""
        hashes = self.chain(2)
        pool.release(commit_chain(pool, hashes))
        before = (snapshot(pool), pool.statistics().num_hits, pool.statistics().num_misses)
        assert pool.lookup(hashes + self.chain(1, start=100)) == 2
        assert pool.lookup([]) == 0
        assert (snapshot(pool), pool.statistics().num_hits, pool.statistics().num_misses) == before

    def test_commit_keeps_payload_when_none(self, pool):
        """commit without cache_data keeps the payload the block already has."""
        (block,) = pool.allocate(1)
        block.cache_data = ["mine"]
        pool.commit(block, self.chain(1)[0], num_tokens=2)
        assert block.cache_data == ["mine"] and block.token_count == 2

    def test_commit_duplicates_are_kept(self, pool):
        """Two blocks committed under one hash both stay; evicting one keeps the hash."""
        (h,) = self.chain(1)
        a, b = pool.allocate(2)
        pool.commit(a, h, num_tokens=BS)
        pool.commit(b, h, num_tokens=BS)
        assert pool.cached_block_hash_to_block.blocks(h) == [a, b]
        pool.release([a])
        pool.allocate(7)  # reuses a
        assert pool.lookup([h]) == 1 and pool.take_evicted() == []
        pool.check_invariants()

    @pytest.mark.parametrize(
        "problem",
        ["free", "null", "foreign", "committed", "hash", "tokens0", "tokens_big", "tokens_float"],
    )
    def test_commit_misuse(self, pool, problem):
        """Misusing commit raises InvalidInput and changes nothing."""
        (h,) = self.chain(1)
        block, done = pool.allocate(2)
        pool.commit(done, self.chain(1, start=50)[0], num_tokens=BS)
        kwargs = {"num_tokens": BS}
        if problem == "free":
            pool.release([block])
        elif problem == "null":
            block = pool.null_block
        elif problem == "foreign":
            block = CacheBlock(block_id=block.block_id, ref_count=1)
        elif problem == "committed":
            block = done
        elif problem == "hash":
            h = "not bytes"
        else:
            kwargs["num_tokens"] = {"tokens0": 0, "tokens_big": BS + 1, "tokens_float": 1.0}[
                problem
            ]
        before = snapshot(pool)
        with pytest.raises(InvalidInput):
            pool.commit(block, h, **kwargs)
        assert snapshot(pool) == before
        pool.check_invariants()

    def test_commit_without_caching(self):
        """With caching disabled, commit stores the payload but publishes nothing."""
        pool = BlockPool(block_size=BS, max_blocks=4, caching=False)
        (block,) = pool.allocate(1)
        pool.commit(block, self.chain(1)[0], num_tokens=BS, cache_data="kv")
        assert block.cache_data == "kv" and block.block_hash is None
        assert pool.lookup(self.chain(1)) == 0
        pool.check_invariants()

    def test_release_by_block_and_by_id(self, pool):
        """release accepts blocks and block ids alike."""
        a, b = pool.allocate(2)
        pool.release([a, b.block_id])
        assert a.ref_count == b.ref_count == 0 and pool.free_block_queue.num_free_blocks == 8
        pool.check_invariants()

    def test_release_order_is_eviction_order(self, pool):
        """Released blocks join the back of the queue in the order given."""
        a, b, c = pool.allocate(3)
        pool.release([c, a, b])
        assert queue_ids(pool)[-3:] == [c.block_id, a.block_id, b.block_id]

    def test_release_keeps_hash_and_data(self, pool):
        """A released committed block keeps its hash and payload."""
        (block,) = commit_chain(pool, self.chain(1), data="kv")
        pool.release([block])
        assert block.block_hash is not None and block.cache_data == "kv"

    def test_release_shared_block(self, pool):
        """Releasing a shared block drops one reference and keeps it out of the queue."""
        (block,) = pool.allocate(1)
        pool.hold([block])
        pool.release([block])
        assert block.ref_count == 1 and block.block_id not in queue_ids(pool)

    def test_double_free(self, pool):
        """Releasing an unreferenced block raises DoubleFree and changes nothing."""
        a, b = pool.allocate(2)
        pool.release([b])
        before = snapshot(pool)
        with pytest.raises(DoubleFree) as info:
            pool.release([a, b])
        assert info.value.block_id == b.block_id
        assert snapshot(pool) == before and a.ref_count == 1
        pool.check_invariants()

    def test_listed_twice_needs_two_references(self, pool):
        """A block listed twice is released twice, so it must hold two references."""
        a, b = pool.allocate(2)
        before = snapshot(pool)
        with pytest.raises(DoubleFree):
            pool.release([b, a, a])
        assert snapshot(pool) == before
        pool.hold([a])
        pool.release([a, a])
        assert a.ref_count == 0 and a.block_id in queue_ids(pool)
        pool.check_invariants()

    @pytest.mark.parametrize("bad", [0, -1, 9, 1.0, "1", None, "null", "foreign"])
    def test_release_bad_items(self, pool, bad):
        """Unknown ids, foreign blocks and the null block raise InvalidInput, nothing changes."""
        (a,) = pool.allocate(1)
        if bad == "null":
            bad = pool.null_block
        elif bad == "foreign":
            bad = CacheBlock(block_id=a.block_id, ref_count=1)
        before = snapshot(pool)
        with pytest.raises(InvalidInput):
            pool.release([a, bad])
        assert snapshot(pool) == before
        pool.check_invariants()

    def test_release_numpy_ids(self, pool):
        """Int-like ids (NumPy) are accepted; bools are not."""
        a, b = pool.allocate(2)
        with pytest.raises(InvalidInput):
            pool.release([True])
        pool.release([np.int64(a.block_id), np.int32(b.block_id)])
        assert a.ref_count == b.ref_count == 0

    def test_release_accepts_generators(self, pool):
        """release takes any iterable."""
        blocks = pool.allocate(3)
        pool.release(block for block in blocks)
        assert pool.free_block_queue.num_free_blocks == 8

    def test_take_evicted_drains(self, pool):
        """take_evicted reports each dropped hash once, then nothing."""
        hashes = self.chain(2)
        pool.release(commit_chain(pool, hashes))
        assert pool.evict(5) == 2
        assert pool.take_evicted() == hashes
        assert pool.take_evicted() == []

    def test_take_evicted_skips_recommitted_hashes(self, pool):
        """A hash committed again before the drain is not reported."""
        (h,) = self.chain(1)
        pool.release(commit_chain(pool, [h]))
        assert pool.evict(1) == 1
        commit_chain(pool, [h])
        assert pool.take_evicted() == []


    def test_undrained_evictions_are_bounded(self):
        """Evictions nobody drains are kept up to a bound, newest first kept."""
        pool = BlockPool(block_size=1, max_blocks=2)
        for token in range(3000):
            (block,) = pool.allocate(1)
            pool.commit(block, hash_block_chain([token], 1)[0], num_tokens=1)
            pool.release([block])
        evicted = pool.take_evicted()
        assert 0 < len(evicted) <= 4 * 2 + 1024
        assert evicted[-1] == hash_block_chain([2998], 1)[0]



class TestFill:
    def test_private_block_takes_payload_and_count(self, pool):
        """An uncommitted held block takes any payload and token count."""
        (block,) = pool.allocate(1)
        pool.fill(block, "tail kv", num_tokens=3)
        assert (block.cache_data, block.token_count) == ("tail kv", 3)
        pool.check_invariants()

    def test_committed_block_keeps_its_count(self, pool):
        """A committed block's payload may be replaced, its token count may not."""
        (block,) = pool.allocate(1)
        pool.commit(block, hash_block_chain(tokens(4), BS)[0], num_tokens=BS, cache_data="kv")
        pool.fill(block, "kv + snapshot")
        assert block.cache_data == "kv + snapshot"
        with pytest.raises(InvalidInput):
            pool.fill(block, "other", num_tokens=BS - 1)
        assert (block.cache_data, block.token_count) == ("kv + snapshot", BS)

    @pytest.mark.parametrize("num_tokens", [0, BS + 1, 1.5])
    def test_bad_count_changes_nothing(self, pool, num_tokens):
        """A token count outside 1..block_size is refused before any change."""
        (block,) = pool.allocate(1)
        with pytest.raises(InvalidInput):
            pool.fill(block, "kv", num_tokens=num_tokens)
        assert (block.cache_data, block.token_count) == (None, 0)

    def test_free_block_is_refused(self, pool):
        """Only a holder may fill a block."""
        (block,) = pool.allocate(1)
        pool.release([block])
        with pytest.raises(InvalidInput):
            pool.fill(block, "kv")
        with pytest.raises(InvalidInput):
            pool.fill(pool.null_block, "kv")




def chain(n_blocks: int, start: int = 0):
    return hash_block_chain(tokens(n_blocks * BS, start), BS)


class TestStore:
    def test_fresh_blocks_are_committed_with_their_payloads(self, pool):
        """Every hash not cached gets a fresh, held block committed with its payload."""
        hashes = chain(3)
        stored = pool.store(hashes, ["a", "b", "c"])
        assert [b.block_hash for b in stored.blocks] == hashes
        assert [b.cache_data for b in stored.blocks] == ["a", "b", "c"]
        assert stored.fresh == stored.blocks and stored.num_reused == 0 and stored.refused is None
        assert all(b.ref_count == 1 and b.token_count == BS for b in stored.blocks)
        assert pool.statistics().num_stored == 3
        pool.check_invariants()

    def test_cached_hashes_are_shared_and_their_payload_dropped(self, pool):
        """A hash cached already gains a reference; the payload given for it is not kept."""
        hashes = chain(2)
        (first,) = pool.store(hashes[:1], ["old"]).blocks
        pool.release([first])
        stored = pool.store(hashes, ["new", "b"])
        assert stored.blocks[0] is first and first.cache_data == "old" and first.ref_count == 1
        assert stored.fresh == stored.blocks[1:] and stored.num_reused == 1
        assert pool.statistics().num_reused == 1
        pool.check_invariants()

    def test_all_or_nothing(self, pool):
        """Without leading, a store that does not fit raises OutOfBlocks and changes nothing."""
        pool.allocate(6)
        before = snapshot(pool)
        with pytest.raises(OutOfBlocks) as info:
            pool.store(chain(3), [1, 2, 3])
        assert (info.value.requested, info.value.available) == (3, 2)
        assert snapshot(pool) == before

    def test_revived_free_blocks_do_not_count_as_room(self, pool):
        """Reviving a free cached block takes it from the free queue, so it is no room."""
        hashes = chain(3)
        pool.release(pool.store(hashes[:1], ["a"]).blocks)
        pool.allocate(6)  # one block left free besides the cached one
        before = snapshot(pool)
        with pytest.raises(OutOfBlocks) as info:
            pool.store(hashes, [1, 2, 3])
        assert (info.value.requested, info.value.available) == (2, 1)
        assert snapshot(pool) == before

    def test_leading_keeps_the_run_that_fits(self, pool):
        """With leading, the longest leading run that fits is stored, and the refusal said."""
        pool.allocate(6)
        hashes = chain(4)
        stored = pool.store(hashes, [1, 2, 3, 4], leading=True)
        assert [b.block_hash for b in stored.blocks] == hashes[:2]
        assert isinstance(stored.refused, OutOfBlocks)
        assert (stored.refused.requested, stored.refused.available) == (4, 2)
        assert pool.free_block_queue.num_free_blocks == 0
        pool.check_invariants()

    def test_leading_counts_shared_blocks_as_free(self, pool):
        """Blocks found referenced cost no room, so a leading store keeps more than the free count."""
        hashes = chain(4)
        held = pool.store(hashes[:2], ["a", "b"]).blocks
        pool.allocate(pool.free_block_queue.num_free_blocks - 1)
        stored = pool.store(hashes, [1, 2, 3, 4], leading=True)
        assert list(stored.blocks[:2]) == list(held) and len(stored.blocks) == 3
        assert stored.refused is not None and stored.refused.requested == 2
        pool.check_invariants()

    def test_leading_stops_at_a_revived_block_without_room(self, pool):
        """A cached free block revived takes its free slot, so no fresh block fits after it."""
        hashes = chain(3)
        (cached,) = pool.store(hashes[:1], ["a"]).blocks
        pool.release([cached])
        pool.allocate(7)  # the cached block is the only one left free
        stored = pool.store(hashes, [1, 2, 3], leading=True)
        assert stored.blocks == (cached,) and stored.fresh == ()
        assert (stored.refused.requested, stored.refused.available) == (2, 0)
        pool.check_invariants()

    def test_leading_that_fits_is_a_plain_store(self, pool):
        """A leading store with room for all stores all and refuses nothing."""
        stored = pool.store(chain(2), [1, 2], leading=True)
        assert len(stored.blocks) == 2 and stored.refused is None

    @pytest.mark.parametrize("problem", ["count", "hash"])
    def test_bad_input_changes_nothing(self, pool, problem):
        """Not one payload per hash, or a hash that is not bytes, is InvalidInput."""
        hashes = chain(2)
        payloads = [1, 2]
        if problem == "count":
            payloads = [1]
        else:
            hashes = [hashes[0], "no"]
        before = snapshot(pool)
        with pytest.raises(InvalidInput):
            pool.store(hashes, payloads)
        assert snapshot(pool) == before

    def test_allocation_does_not_evict_the_blocks_it_shares(self, pool):
        """References are taken before fresh blocks are allocated, so a shared free block survives."""
        hashes = chain(2)
        (first,) = pool.store(hashes[:1], ["a"]).blocks
        pool.release([first])
        pool.allocate(6)  # first is now at the front of the free queue, one other behind it
        stored = pool.store(hashes, [0, "b"])
        assert stored.blocks[0] is first and first.block_hash == hashes[0]
        pool.check_invariants()


class TestRetain:
    def test_adds_a_reference_to_blocks_holding_their_hash(self, pool):
        """retain takes one more reference to each named block that still holds the hash."""
        (block,) = pool.store(chain(1), ["a"]).blocks
        assert pool.retain([(block.block_id, block.block_hash)]) == [block]
        assert block.ref_count == 2 and pool.statistics().num_retained == 1

    def test_a_block_that_lost_its_hash_is_refused(self, pool):
        """A block evicted or reused since it was seen is refused, nothing changed."""
        (block,) = pool.store(chain(1), ["a"]).blocks
        seen = (block.block_id, block.block_hash)
        pool.release([block])
        pool.evict(1)
        before = snapshot(pool)
        with pytest.raises(InvalidInput, match="no longer holds"):
            pool.retain([seen])
        assert snapshot(pool) == before

    @pytest.mark.parametrize("bad", [(0, b"x"), (99, b"x"), ("1", b"x"), 7])
    def test_bad_pairs(self, pool, bad):
        """The null block, unknown ids and non-pairs are InvalidInput."""
        with pytest.raises(InvalidInput):
            pool.retain([bad])


class TestHoldAndForget:
    def test_hold_revives_a_free_block(self, pool):
        """hold adds a reference, taking a free block out of the queue."""
        (block,) = pool.allocate(1)
        pool.release([block])
        pool.hold([block])
        assert block.ref_count == 1 and block.block_id not in queue_ids(pool)

    def test_hold_skips_the_null_block_only_when_asked(self, pool):
        """The null block is refused unless skip_null is given."""
        with pytest.raises(InvalidInput):
            pool.hold([pool.null_block])
        pool.hold([pool.null_block], skip_null=True)
        assert pool.null_block.ref_count == 1

    def test_forget_clears_free_blocks_in_place(self, pool):
        """forget drops what free blocks hold; they keep their place in the queue."""
        hashes = chain(2)
        blocks = pool.store(hashes, ["a", "b"]).blocks
        pool.release(blocks)
        order = queue_ids(pool)
        pool.forget(blocks)
        assert queue_ids(pool) == order and pool.lookup(hashes) == 0
        assert all(b.cache_data is None for b in blocks)
        assert pool.take_evicted() == hashes
        pool.check_invariants()

    def test_forget_refuses_a_held_block(self, pool):
        """A referenced block cannot be forgotten; nothing changes."""
        (block,) = pool.store(chain(1), ["a"]).blocks
        before = snapshot(pool)
        with pytest.raises(InvalidInput, match="referenced"):
            pool.forget([block])
        assert snapshot(pool) == before


class TestPublish:
    def test_publishes_blocks_whatever_holds_them(self, pool):
        """publish hashes full blocks, held or free, keeping their payload."""
        a, b = pool.allocate(2)
        a.cache_data = "kv"
        pool.release([b])
        pool.publish([a, b], chain(2))
        assert pool.lookup(chain(2)) == 2 and a.cache_data == "kv" and b.token_count == BS
        pool.check_invariants()

    def test_refuses_a_hashed_block(self, pool):
        """A block that holds a hash already is refused before any is published."""
        (a,) = pool.store(chain(1), ["a"]).blocks
        (b,) = pool.allocate(1)
        with pytest.raises(InvalidInput):
            pool.publish([b, a], chain(2, start=40))
        assert b.block_hash is None

    def test_nothing_without_caching(self):
        """A pool without caching publishes nothing."""
        pool = BlockPool(block_size=BS, max_blocks=4, caching=False)
        (a,) = pool.allocate(1)
        pool.publish([a], chain(1))
        assert pool.lookup(chain(1)) == 0


class TestReading:
    def test_statistics(self, pool):
        """statistics counts blocks by state and the operations' outcomes."""
        hashes = chain(3)
        stored = pool.store(hashes[:2], ["a", "b"])
        pool.release(stored.blocks[1:])
        pool.acquire(hashes)
        stats = pool.statistics()
        assert (stats.block_size, stats.num_blocks, stats.num_free, stats.num_referenced) == (BS, 8, 6, 2)
        assert (stats.num_cached, stats.num_reusable, stats.num_empty) == (2, 0, 6)
        assert (stats.num_hits, stats.num_misses, stats.num_stored) == (2, 1, 2)

    def test_check_references(self, pool):
        """check_references names each block whose count differs from its holders'."""
        a, b = pool.allocate(2)
        assert pool.check_references({a.block_id: 1, b.block_id: 1}) == []
        (line,) = pool.check_references({a.block_id: 1})
        assert f"block {b.block_id} has ref_count 1" in line

    def test_reset_reports_the_dropped_hashes(self, pool):
        """reset starts over with new blocks and reports what was cached."""
        hashes = chain(2)
        old = pool.store(hashes, ["a", "b"]).blocks
        pool.reset()
        assert pool.free_block_queue.num_free_blocks == 8 and old[0] not in pool.blocks
        assert sorted(pool.take_evicted()) == sorted(hashes)
        pool.check_invariants()

    def test_is_cached(self, pool):
        """is_cached says whether a block is cached under a hash now."""
        (h,) = chain(1)
        assert not pool.is_cached(h)
        pool.store([h], ["a"])
        assert pool.is_cached(h)
