"""The block allocator actor: grants validated where the blocks live."""

from __future__ import annotations

import mlx.core as mx
import pytest
from structlog.testing import capture_logs

from mlxkv.actors.allocator import (
    Acquire,
    BlockAllocatorActor,
    BlockAllocatorHandle,
    Eviction,
    Grants,
    Release,
    StoreBlocks,
)
from mlxkv.cache.block_hash import hash_block_chain
from mlxkv.cache.errors import InvalidInput, OutOfBlocks

BS = 4


def chain(n: int, start: int = 0) -> tuple:
    return tuple(hash_block_chain(list(range(start, start + n * BS)), BS))


def payloads(n: int) -> tuple:
    return tuple(mx.full((2, BS), float(i)) for i in range(n))


@pytest.fixture
def allocator() -> BlockAllocatorActor:
    return BlockAllocatorActor(block_size=BS, max_blocks=9)


class TestStoreAndAcquire:
    async def test_stored_blocks_are_acquired_with_their_payloads(self, allocator, running):
        """Blocks stored under a chain are granted back, in order, payloads by reference."""
        hashes, data = chain(3), payloads(3)
        async with running(allocator) as ref:
            handle = BlockAllocatorHandle(ref)
            stored = await handle.store_blocks(hashes, data)
            assert stored.num_reused == 0
            assert [g.block_hash for g in stored.grants] == list(hashes)
            got = await handle.acquire(hashes)
            assert got.block_ids == stored.block_ids
            assert all(g.payload is p for g, p in zip(got.grants, data))
            assert all(g.num_tokens == BS for g in got.grants)
            stats = await handle.statistics()
        assert stats.num_referenced == 3 and stats.num_hits == 3 and stats.num_stored == 3

    async def test_acquire_stops_at_the_first_uncached_block(self, allocator, running):
        """Only the longest cached leading run is granted; the rest is a miss."""
        async with running(allocator) as ref:
            handle = BlockAllocatorHandle(ref)
            await handle.store_blocks(chain(2), payloads(2))
            got = await handle.acquire(chain(4))
            assert len(got.grants) == 2
            assert (await handle.acquire(chain(2, start=100))).grants == ()
            stats = await handle.statistics()
        assert stats.num_misses == 2

    async def test_store_reuses_cached_blocks(self, allocator, running):
        """A hash already cached is shared, and the new payload dropped."""
        first, second = payloads(2), payloads(2)
        async with running(allocator) as ref:
            handle = BlockAllocatorHandle(ref)
            a = await handle.store_blocks(chain(2), first)
            b = await handle.store_blocks(chain(2), second)
        assert b.num_reused == 2 and b.block_ids == a.block_ids
        assert all(g.payload is p for g, p in zip(b.grants, first))

    async def test_store_is_all_or_nothing(self, allocator, running):
        """OutOfBlocks says what was asked and what is free, and changes nothing."""
        async with running(allocator) as ref:
            handle = BlockAllocatorHandle(ref)
            await handle.store_blocks(chain(5), payloads(5))
            before = await handle.statistics()
            with pytest.raises(OutOfBlocks) as caught:
                await handle.store_blocks(chain(4, start=50), payloads(4))
            assert (caught.value.requested, caught.value.available) == (4, 3)
            assert await handle.statistics() == before

    async def test_reused_free_blocks_do_not_count_as_room(self, allocator, running):
        """Reviving a free cached block takes it out of the room for fresh blocks."""
        async with running(allocator) as ref:
            handle = BlockAllocatorHandle(ref)
            cached = await handle.store_blocks(chain(2), payloads(2))
            await handle.release(cached.block_ids)
            await handle.store_blocks(chain(5, start=50), payloads(5))  # 1 free left + 2 cached
            before = await handle.statistics()
            with pytest.raises(OutOfBlocks):
                await handle.store_blocks(chain(4), payloads(4))  # 2 reused + 2 fresh > 1
            assert await handle.statistics() == before

    async def test_wrong_payload_count_is_rejected(self, allocator, running):
        """Not one payload per hash is InvalidInput, before anything changes."""
        async with running(allocator) as ref:
            handle = BlockAllocatorHandle(ref)
            with pytest.raises(InvalidInput, match="payloads"):
                await handle.store_blocks(chain(2), payloads(1))
            assert (await handle.statistics()).num_referenced == 0


class TestEviction:
    async def test_allocation_evictions_are_announced_once(self, allocator, running):
        """Hashes evicted by allocation come back in the next reply, and only there."""
        old = chain(4)
        async with running(allocator) as ref:
            handle = BlockAllocatorHandle(ref)
            stored = await handle.store_blocks(old, payloads(4))
            await handle.release(stored.block_ids)
            fresh = await handle.store_blocks(chain(6, start=50), payloads(6))
            assert set(fresh.evicted) == set(old[:2])
            assert (await handle.acquire(old)).evicted == ()

    async def test_evict_drops_free_cached_blocks(self, allocator, running):
        """Evict forgets LRU free blocks and announces their hashes."""
        hashes = chain(3)
        async with running(allocator) as ref:
            handle = BlockAllocatorHandle(ref)
            stored = await handle.store_blocks(hashes, payloads(3))
            await handle.release(stored.block_ids)
            eviction = await handle.evict(2)
            assert eviction == Eviction(num_evicted=2, evicted=hashes[:2])
            assert (await handle.acquire(hashes)).grants == ()
            with pytest.raises(InvalidInput):
                await handle.evict(-1)

    async def test_referenced_blocks_are_never_evicted(self, allocator, running):
        """A held block keeps its hash whatever is evicted."""
        hashes = chain(3)
        async with running(allocator) as ref:
            handle = BlockAllocatorHandle(ref)
            await handle.store_blocks(hashes, payloads(3))
            assert (await handle.evict(8)).num_evicted == 0
            assert len((await handle.acquire(hashes)).grants) == 3


class TestRetainAndRelease:
    async def test_retain_checks_the_hash(self, allocator, running):
        """Retain refs a block only if it still holds the expected hash."""
        hashes = chain(2)
        async with running(allocator) as ref:
            handle = BlockAllocatorHandle(ref)
            stored = await handle.store_blocks(hashes, payloads(2))
            pairs = tuple(zip(stored.block_ids, hashes))
            retained = await handle.retain(pairs)
            assert retained.block_ids == stored.block_ids
            await handle.release(stored.block_ids + retained.block_ids)
            await handle.evict(8)
            before = await handle.statistics()
            with pytest.raises(InvalidInput, match="no longer holds"):
                await handle.retain(pairs)
            with pytest.raises(InvalidInput, match="not a block id"):
                await handle.retain(((0, hashes[0]),))
            assert await handle.statistics() == before

    async def test_double_free_changes_nothing_and_is_logged(self, allocator, running):
        """Releasing an unreferenced block is refused with a warning; state is unchanged."""
        async with running(allocator) as ref:
            handle = BlockAllocatorHandle(ref)
            stored = await handle.store_blocks(chain(1), payloads(1))
            with capture_logs() as logs:
                await handle.release(stored.block_ids * 2)
                before = await handle.statistics()
            assert before.num_referenced == 1
            assert [log["error"].split(":")[0] for log in logs] == ["DoubleFree"]

    def test_undo_releases_and_reannounces(self, allocator):
        """The undo of a grant reply releases its blocks and hands back its announcements."""
        grants = Grants(evicted=(b"h" * 32,))
        message = Acquire(hashes=(), reply=None, request_id="r1")
        assert allocator.undo(message, grants) == Release(
            block_ids=(), reannounce=(b"h" * 32,), request_id="r1"
        )
        assert allocator.undo(message, Eviction(num_evicted=0)) is None
        allocator.discard()

    async def test_reannounced_hashes_come_back(self, allocator, running):
        """Announcements handed back by an undo are announced by the next reply."""
        hashes = chain(2)
        async with running(allocator) as ref:
            handle = BlockAllocatorHandle(ref)
            stored = await handle.store_blocks(hashes, payloads(2))
            await handle.release(stored.block_ids)
            eviction = await handle.evict(2)
            await handle.release((), reannounce=eviction.evicted)
            assert (await handle.acquire(chain(1, start=70))).evicted == hashes


class TestCheckInvariants:
    async def test_reports_reference_mismatches(self, allocator, running):
        """Expected references that differ from the counts are reported, pool checks pass."""
        async with running(allocator) as ref:
            handle = BlockAllocatorHandle(ref)
            stored = await handle.store_blocks(chain(2), payloads(2))
            good = await handle.check_invariants({b: 1 for b in stored.block_ids})
            bad = await handle.check_invariants({stored.block_ids[0]: 1})
        assert good.violations == () and good.reference_mismatches == ()
        assert len(bad.reference_mismatches) == 1 and "its holders list 0" in bad.reference_mismatches[0]


class TestMessages:
    def test_messages_are_frozen_records(self):
        """Messages convert sequences to tuples and cannot be changed."""
        message = StoreBlocks(hashes=[b"a"], payloads=[1], reply=None)
        assert message.hashes == (b"a",) and message.payloads == (1,)
        with pytest.raises(AttributeError):
            message.hashes = ()  # type: ignore[misc]
