"""The tier stack over a real directory and a real redis-server: chain lookups,
write-behind that never waits, slow and failing tiers, KV events."""

from __future__ import annotations

import logging
import threading

import anyio
import mlx.core as mx
import pytest
from tier_blocks import assert_same_payload, chain_of, forge_start, kv_blocks, namespace_of

from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.tiers import (
    BlockRemoved,
    BlockStored,
    DiskTier,
    RedisTier,
    TierHealth,
    TierStack,
    encode_block,
    storage_key,
)

STACK_LOGGER = "mlxkv.cache.tiers.tier_stack"


class SlowTier:
    """A real tier behind injected latency: each call first sleeps."""

    def __init__(self, inner, *, get_delay=0.0, put_delay=0.0):
        self.inner = inner
        self.get_delay = get_delay
        self.put_delay = put_delay

    @property
    def name(self):
        return "slow+" + self.inner.name

    async def __aenter__(self):
        await self.inner.__aenter__()
        return self

    async def __aexit__(self, *exc_info):
        return await self.inner.__aexit__(*exc_info)

    async def contains_many(self, keys):
        await anyio.sleep(self.get_delay)
        return await self.inner.contains_many(keys)

    async def get_many(self, keys, *, starts=None):
        await anyio.sleep(self.get_delay)
        return await self.inner.get_many(keys, starts=starts)

    def count_loaded(self, num_values):
        self.inner.count_loaded(num_values)

    async def get(self, key):
        (value,) = await self.get_many([key])
        return value

    async def put(self, key, value):
        await anyio.sleep(self.put_delay)
        return await self.inner.put(key, value)

    async def delete(self, key):
        await self.inner.delete(key)

    def take_removals(self):
        return self.inner.take_removals()

    def statistics(self):
        return self.inner.statistics()


@pytest.fixture
def blocks():
    return kv_blocks(6)


@pytest.fixture
def chain():
    return chain_of(6)


@pytest.fixture
def namespace(blocks):
    return namespace_of(blocks[0])


@pytest.fixture
def disk(tmp_path):
    def make(namespace, **options):
        return DiskTier(tmp_path / "kv", namespace, **options)

    return make


@pytest.fixture
def redis(redis_server):
    """A Redis tier whose timeout a loaded machine's first connection cannot hit
    (the tests that need a stalled server make their own)."""

    def make(namespace):
        health = TierHealth(initial_delay=0.05, max_delay=0.2)
        return RedisTier(namespace, host="127.0.0.1", port=redis_server.port, timeout=5.0, health=health)

    return make


async def _stored_in_chunks_of_two(disk, namespace, blocks, chain, monkeypatch):
    """Every block written to a disk tier, read back two blocks a call; the
    tier to read them from, wrapped so a test can replace its get_many."""
    from mlxkv.cache.tiers import tier_stack

    monkeypatch.setattr(tier_stack, "GET_CHUNK", 2)
    async with TierStack([disk(namespace)], namespace) as stack:
        _offer_all(stack, chain, blocks)
    return SlowTier(disk(namespace))


def _offer_all(stack, chain, blocks):
    parents = [None, *chain[:-1]]
    return [stack.offer(h, b, parent_hash=p) for h, b, p in zip(chain, blocks, parents)]


async def _put(tier, namespace, chain_hash, block):
    key = storage_key(namespace, chain_hash)
    assert await tier.put(key, encode_block(block, key=key, namespace=namespace))


class TestLookupChain:
    async def test_offered_blocks_come_back_from_every_tier(self, disk, redis, namespace, blocks, chain):
        """Offered blocks are written behind to disk and Redis, and a chain lookup
        returns them all, equal to what was offered."""
        async with TierStack([disk(namespace), redis(namespace)], namespace) as stack:
            assert _offer_all(stack, chain, blocks) == [True] * 6
            await stack.wait_written()
            for tier in stack.tiers:
                assert await tier.contains_many([storage_key(namespace, h) for h in chain]) == [True] * 6
            assert stack.statistics().lookup_seconds == 0
            found = await stack.lookup_chain(chain)
            stats = stack.statistics()
        assert stats.num_lookups == 1 and stats.lookup_seconds > 0  # the lookup's own time
        assert len(found) == 6
        for payload, block in zip(found, blocks):
            assert_same_payload(payload, block)
        assert (stats.num_offered, stats.num_queued, stats.num_pending, stats.num_blocks_found) == (6, 6, 0, 6)
        assert [t.num_written for t in stats.tiers] == [6, 6]

    async def test_the_chain_continues_across_tiers_and_stops_at_a_gap(
        self, disk, redis, namespace, blocks, chain
    ):
        """Blocks 0-1 on disk and 2 in Redis make a hit of three; block 3 missing
        everywhere ends it, though block 4 is on disk."""
        disk_tier, redis_tier = disk(namespace), redis(namespace)
        async with TierStack([disk_tier, redis_tier], namespace) as stack:
            for i in (0, 1, 4):
                await _put(disk_tier, namespace, chain[i], blocks[i])
            await _put(redis_tier, namespace, chain[2], blocks[2])
            found = await stack.lookup_chain(chain)
            assert [p.start for p in found] == [0, 4, 8]
            for payload, block in zip(found, blocks):
                assert_same_payload(payload, block)
            assert await stack.lookup_chain(chain[3:]) == []
            assert await stack.lookup_chain([]) == []

    async def test_a_corrupt_copy_falls_back_to_the_next_tier(
        self, tmp_path, disk, redis, namespace, blocks, chain
    ):
        """A block whose disk file is corrupt is read from Redis instead; the file
        is counted, deleted and announced as removed."""
        async with TierStack([disk(namespace), redis(namespace)], namespace) as stack:
            _offer_all(stack, chain[:2], blocks[:2])
            await stack.wait_written()
            path = tmp_path / "kv" / storage_key(namespace, chain[1]).hex()
            damaged = bytearray(path.read_bytes())
            damaged[100] ^= 0x01
            path.write_bytes(bytes(damaged))
            with stack.subscribe() as events:
                found = await stack.lookup_chain(chain[:2])
                removed = events.receive_nowait()
            stats = stack.statistics()
        assert_same_payload(found[1], blocks[1])
        assert not path.exists()
        assert stats.tiers[0].num_corrupt == 1 and stats.tiers[1].num_loaded == 1
        assert isinstance(removed, BlockRemoved) and removed.reason == "corrupt"
        assert removed.key == storage_key(namespace, chain[1])

    @pytest.mark.parametrize(
        "other",
        [
            pytest.param(lambda block: namespace_of(block, model="sha256:model-b"), id="model"),
            pytest.param(lambda block: namespace_of(kv_blocks(1, block_size=8)[0]), id="block-size"),
            pytest.param(lambda block: namespace_of(kv_blocks(1, dtype=mx.bfloat16)[0]), id="dtype"),
        ],
    )
    async def test_another_namespace_never_hits(self, disk, redis, namespace, blocks, chain, other):
        """Blocks of one model, block size or dtype are never a hit for another,
        on the same directory and server, for the same chain hashes."""
        async with TierStack([disk(namespace), redis(namespace)], namespace) as stack:
            _offer_all(stack, chain, blocks)
        theirs = other(blocks[0])
        async with TierStack([disk(theirs), redis(theirs)], theirs) as stack:
            assert await stack.lookup_chain(chain) == []

    async def test_warm_restart_from_disk(self, disk, namespace, blocks, chain):
        """Leaving the stack writes what is queued; a new stack on the same
        directory (a restarted process) finds every block."""
        async with TierStack([disk(namespace)], namespace) as stack:
            _offer_all(stack, chain, blocks)
        async with TierStack([disk(namespace)], namespace) as stack:
            found = await stack.lookup_chain(chain)
        assert [p.start for p in found] == [0, 4, 8, 12, 16, 20]

    async def test_decoding_runs_on_a_worker_thread(
        self, disk, namespace, blocks, chain, monkeypatch
    ):
        """Decoding (MLX work) runs on a worker thread, off the event loop's."""
        from mlxkv.cache.tiers import tier_stack

        threads = []
        decode = tier_stack.decode_payloads

        def traced(values):
            threads.append(threading.get_ident())
            return decode(values)

        monkeypatch.setattr(tier_stack, "decode_payloads", traced)
        async with TierStack([disk(namespace)], namespace) as stack:
            _offer_all(stack, chain[:3], blocks[:3])
            await stack.wait_written()
            found = await stack.lookup_chain(chain)
        assert len(found) == 3
        assert len(threads) == 1 and threads[0] != threading.get_ident()

    async def test_each_chunk_is_decoded_before_the_next_is_read(
        self, disk, namespace, blocks, chain, monkeypatch
    ):
        """A lookup reads a chunk, decodes it, then reads the next: it never
        holds more than one chunk's raw bytes of a tier, and the payloads still
        come back whole and in chain order."""
        reading = await _stored_in_chunks_of_two(disk, namespace, blocks, chain, monkeypatch)
        steps = []
        inner_get_many = reading.get_many

        async def get_many(keys, *, starts=None):
            steps.append(("read", len(keys)))
            return await inner_get_many(keys, starts=starts)

        from mlxkv.cache.tiers import tier_stack

        decode = tier_stack.decode_payloads

        def traced(values):
            steps.append(("decode", len(values)))
            return decode(values)

        monkeypatch.setattr(tier_stack, "decode_payloads", traced)
        reading.get_many = get_many
        async with TierStack([reading], namespace) as stack:
            found = await stack.lookup_chain(chain)
        assert steps == [("read", 2), ("decode", 2)] * 3
        assert [p.start for p in found] == [0, 4, 8, 12, 16, 20]
        for payload, block in zip(found, blocks):
            assert_same_payload(payload, block)

    async def test_one_tier_is_read_until_a_block_is_missing(self, disk, namespace, blocks, chain, monkeypatch):
        """A lone tier is not probed first: its chunks are read in order, and the
        chunk that lacks a block ends the run (no later chunk is read)."""
        reading = await _stored_in_chunks_of_two(disk, namespace, blocks, chain, monkeypatch)
        async with reading:
            await reading.delete(storage_key(namespace, chain[3]))
        calls = []
        inner_get_many = reading.get_many

        async def contains_many(keys):
            calls.append(("probe", len(keys)))

        async def get_many(keys, *, starts=None):
            calls.append(("read", len(keys)))
            return await inner_get_many(keys, starts=starts)

        reading.contains_many = contains_many
        reading.get_many = get_many
        async with TierStack([reading], namespace) as stack:
            found = await stack.lookup_chain(chain)
            stats = stack.statistics()
        assert calls == [("read", 2), ("read", 2)]
        assert [p.start for p in found] == [0, 4, 8]
        assert stats.num_blocks_found == 3 and stats.tiers[0].num_missed == 1


class TestPositions:
    """A value must be the block of its position in the chain, and a tier counts
    as loaded only the blocks a lookup returned."""

    @staticmethod
    def _forge(tmp_path, namespace, chain_hash, start):
        path = tmp_path / "kv" / storage_key(namespace, chain_hash).hex()
        path.write_bytes(forge_start(path.read_bytes(), start))
        return path

    @pytest.mark.parametrize("first_block", [0, None], ids=["position-given", "position-from-first-value"])
    async def test_a_forged_start_is_corrupt_and_ends_the_run(
        self, tmp_path, disk, namespace, blocks, chain, first_block
    ):
        """Block 2's value with its start changed and its checksum recomputed is
        counted corrupt and deleted; the lookup returns blocks 0-1, and loaded
        counts those two, not the six values that verified."""
        async with TierStack([disk(namespace)], namespace) as stack:
            _offer_all(stack, chain, blocks)
        forged = self._forge(tmp_path, namespace, chain[2], 16)
        async with TierStack([disk(namespace)], namespace) as stack:
            found = await stack.lookup_chain(chain, first_block=first_block)
            stats = stack.statistics()
        assert [p.start for p in found] == [0, 4]
        (tier,) = stats.tiers
        assert (tier.num_loaded, tier.num_corrupt, stats.num_blocks_found) == (2, 1, 2)
        assert not forged.exists()

    async def test_a_forged_first_block_is_caught_at_its_position(self, tmp_path, disk, namespace, blocks, chain):
        """Given where the chain begins, a forged first block is corrupt: nothing
        is loaded; a chain that begins after it still loads."""
        async with TierStack([disk(namespace)], namespace) as stack:
            _offer_all(stack, chain, blocks)
        self._forge(tmp_path, namespace, chain[0], 4)
        async with TierStack([disk(namespace)], namespace) as stack:
            assert await stack.lookup_chain(chain, first_block=0) == []
            assert [p.start for p in await stack.lookup_chain(chain[1:], first_block=1)] == [4, 8, 12, 16, 20]
            (tier,) = stack.statistics().tiers
        assert (tier.num_loaded, tier.num_corrupt) == (5, 1)

    @pytest.mark.parametrize("first_block", [0, None], ids=["position-given", "position-from-first-value"])
    async def test_a_forged_copy_falls_back_to_the_next_tier(
        self, tmp_path, disk, redis, namespace, blocks, chain, first_block
    ):
        """A block forged on disk is read from Redis instead; each tier counts as
        loaded the blocks it served, which add up to the lookup's."""
        async with TierStack([disk(namespace), redis(namespace)], namespace) as stack:
            _offer_all(stack, chain, blocks)
        self._forge(tmp_path, namespace, chain[1], 8)
        async with TierStack([disk(namespace), redis(namespace)], namespace) as stack:
            found = await stack.lookup_chain(chain, first_block=first_block)
            stats = stack.statistics()
        for payload, block in zip(found, blocks):
            assert_same_payload(payload, block)
        on_disk, in_redis = stats.tiers
        assert (on_disk.num_loaded, on_disk.num_corrupt, in_redis.num_loaded) == (5, 1, 1)
        assert stats.num_blocks_found == 6

    async def test_values_read_past_the_end_are_not_loaded(self, disk, namespace, blocks, chain):
        """A lone tier read a chunk at a time reads blocks 4 and 5 with the chunk
        in which block 3 is missing; the run ends at 3 and they are not loaded."""
        tier = disk(namespace)
        async with TierStack([tier], namespace) as stack:
            for i in (0, 1, 2, 4, 5):
                await _put(tier, namespace, chain[i], blocks[i])
            found = await stack.lookup_chain(chain, first_block=0)
            stats = stack.statistics()
        assert len(found) == 3
        assert (stats.tiers[0].num_loaded, stats.tiers[0].num_missed, stats.num_blocks_found) == (3, 1, 3)

    async def test_the_position_must_be_a_block_index(self, disk, namespace, chain):
        """``first_block`` is an int >= 0 or None."""
        async with TierStack([disk(namespace)], namespace) as stack:
            for bad in (-1, 1.0, "0"):
                with pytest.raises(InvalidInput, match="first_block"):
                    await stack.lookup_chain(chain, first_block=bad)


class TestLifecycle:
    def test_made_outside_an_event_loop(self, tmp_path, namespace, blocks, chain):
        """A stack (and its tiers) can be made in sync code and entered later."""
        stack = TierStack.from_urls([f"file://{tmp_path}"], namespace)

        async def use():
            async with stack:
                assert stack.offer(chain[0], blocks[0])
                await stack.wait_written()
                return await stack.lookup_chain(chain)

        assert len(anyio.run(use)) == 1

    async def test_a_cancelled_lookup_leaves_the_stack_usable(self, disk, namespace, blocks, chain):
        """A lookup cancelled while a tier is slow returns at once; the stack
        serves the next lookup."""
        slow = SlowTier(disk(namespace), get_delay=10.0)
        async with TierStack([slow], namespace, timeout=5.0) as stack:
            stack.offer(chain[0], blocks[0])
            await stack.wait_written()
            with anyio.move_on_after(0.05) as scope:
                await stack.lookup_chain(chain)
            assert scope.cancelled_caught
            slow.get_delay = 0.0
            assert len(await stack.lookup_chain(chain)) == 1

    async def test_leaving_under_cancellation_is_prompt(self, disk, namespace, blocks, chain):
        """A stack left because its caller was cancelled does not wait for its
        queue to drain."""
        slow = SlowTier(disk(namespace), put_delay=10.0)
        start = anyio.current_time()
        with anyio.move_on_after(0.1):
            async with TierStack([slow], namespace, drain_timeout=5.0) as stack:
                _offer_all(stack, chain, blocks)
                await anyio.sleep_forever()
        assert anyio.current_time() - start < 1.0

    async def test_entered_once(self, disk, namespace):
        """A stack that was entered cannot be entered again."""
        stack = TierStack([disk(namespace)], namespace)
        async with stack:
            pass
        with pytest.raises(RuntimeError, match="entered once"):
            await stack.__aenter__()


class TestWriteBehind:
    async def test_offer_never_waits_on_a_slow_tier(self, disk, namespace, blocks, chain):
        """With a tier that takes seconds per write, offers return at once; what
        the full queue cannot hold is dropped and counted."""
        slow = SlowTier(disk(namespace), put_delay=10.0)
        async with TierStack([slow], namespace, queue_size=2, timeout=5.0, drain_timeout=0.1) as stack:
            start = anyio.current_time()
            accepted = [stack.offer(h, b) for h, b in zip(chain * 3, blocks * 3)]
            assert anyio.current_time() - start < 0.05
            stats = stack.statistics()
        assert accepted[:2] == [True, True] and accepted.count(True) <= 3
        assert stats.num_queue_dropped == accepted.count(False)
        assert stats.num_offered == stats.num_queued + stats.num_queue_dropped + stats.num_refused

    async def test_a_slow_write_is_cut_off_and_the_queue_moves_on(self, disk, redis, namespace, blocks, chain, caplog):
        """A tier slower than the timeout drops that write (one warning); the
        other tiers get every block. (The timeout is a second, not less: on a
        loaded machine Redis's first connection must not be the call that times out.)"""
        slow = SlowTier(disk(namespace), put_delay=30.0)
        async with TierStack([slow, redis(namespace)], namespace, timeout=1.0) as stack:
            _offer_all(stack, chain[:3], blocks[:3])
            with anyio.fail_after(15):
                await stack.wait_written()
            stats = stack.statistics()
        assert stats.num_timeouts == 3 and stats.tiers[0].num_written == 0 and stats.tiers[1].num_written == 3
        assert len([r for r in caplog.records if r.name == STACK_LOGGER]) == 1

    async def test_what_is_not_a_block_of_the_namespace_is_refused(self, disk, namespace, blocks, chain, caplog):
        """Offers that are not full blocks of the namespace are refused, counted and
        logged once; offer never raises."""
        import attrs

        async with TierStack([disk(namespace)], namespace) as stack:
            assert not stack.offer(chain[0], kv_blocks(1, dtype=mx.float32)[0])
            assert not stack.offer(chain[0], attrs.evolve(blocks[0], num_tokens=2))
            assert not stack.offer(chain[0], "not a payload")
            assert not stack.offer("not a hash", blocks[0])
            assert not stack.offer(b"", blocks[0])
            stats = stack.statistics()
        assert stats.num_refused == 5 and stats.num_queued == 0
        assert len([r for r in caplog.records if r.name == STACK_LOGGER]) == 1
        assert not stack.offer(chain[0], blocks[0])  # not running any more

    async def test_events_say_what_each_tier_stored_and_evicted(self, disk, namespace, blocks, chain):
        """Each write is a BlockStored (with its parent), each eviction a BlockRemoved."""
        value_size = len(encode_block(blocks[0], key=storage_key(namespace, chain[0]), namespace=namespace))
        tier = disk(namespace, max_bytes=2 * value_size + 10)
        async with TierStack([tier], namespace) as stack:
            with stack.subscribe() as events:
                _offer_all(stack, chain[:3], blocks[:3])
                await stack.wait_written()
                received = [events.receive_nowait() for _ in range(4)]
        stored = [e for e in received if isinstance(e, BlockStored)]
        removed = [e for e in received if isinstance(e, BlockRemoved)]
        assert [e.block_hash for e in stored] == chain[:3]
        assert [e.parent_hash for e in stored] == [None, chain[0], chain[1]]
        assert {e.tier for e in stored} == {tier.name} and {e.block_size for e in stored} == {4}
        assert [(e.key, e.reason) for e in removed] == [(storage_key(namespace, chain[0]), "evicted")]
        assert sorted(e.seq for e in received) == [0, 1, 2, 3]


class TestFaults:
    async def test_lookups_time_out_into_misses(self, disk, redis_server, namespace, blocks, chain):
        """A tier that does not answer within the timeout is a miss; the next tier
        serves the chain, and the slow tier costs the caller one timeout, not its
        10 s. (Redis gets a generous timeout of its own here: on a loaded machine
        its first connection must not be the tier that times out.)"""

        def redis():
            return RedisTier(namespace, host="127.0.0.1", port=redis_server.port, timeout=5.0)

        async with TierStack([disk(namespace), redis()], namespace) as stack:
            _offer_all(stack, chain, blocks)
        slow = SlowTier(disk(namespace), get_delay=10.0)
        async with TierStack([slow, redis()], namespace, timeout=1.0) as stack:
            start = anyio.current_time()
            found = await stack.lookup_chain(chain)
            elapsed = anyio.current_time() - start
            stats = stack.statistics()
        assert len(found) == 6 and 1.0 <= elapsed < 4.0
        assert stats.num_timeouts == 1 and stats.tiers[1].num_loaded == 6

    async def test_reads_go_in_chunks_and_a_chunk_that_times_out_ends_the_hit(
        self, disk, namespace, blocks, chain, monkeypatch
    ):
        """A tier's values are read a chunk at a time, in chain order, each chunk
        bounded by the timeout on its own: a tier that stalls on its second chunk
        still serves the first, and the caller waits one timeout, not more."""
        stalling = await _stored_in_chunks_of_two(disk, namespace, blocks, chain, monkeypatch)
        reads = []
        inner_get_many = stalling.get_many

        async def get_many(keys, *, starts=None):
            reads.append(len(keys))
            stalling.get_delay = 10.0 if len(reads) == 2 else 0.0
            return await inner_get_many(keys, starts=starts)

        stalling.get_many = get_many
        async with TierStack([stalling], namespace, timeout=0.5) as stack:
            start = anyio.current_time()
            found = await stack.lookup_chain(chain)
            elapsed = anyio.current_time() - start
            stats = stack.statistics()
        assert reads == [2, 2]  # the third chunk is not asked for: the hit ended
        assert len(found) == 2
        for payload, block in zip(found, blocks):
            assert_same_payload(payload, block)
        assert stats.num_timeouts == 1 and 0.5 <= elapsed < 2.0

    async def test_redis_down_costs_only_its_misses(self, disk, redis, redis_server, namespace, blocks, chain, caplog):
        """With Redis killed, offers still go through, disk still serves, and Redis
        logs one warning; nothing raises."""
        async with TierStack([disk(namespace), redis(namespace)], namespace) as stack:
            redis_server.kill()
            _offer_all(stack, chain, blocks)
            await stack.wait_written()
            assert len(await stack.lookup_chain(chain)) == 6
            stats = stack.statistics()
        assert stats.tiers[0].num_written == 6 and stats.tiers[1].num_dropped == 6
        assert not stats.tiers[1].available
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and warnings[0].name == "mlxkv.cache.tiers.redis_tier"
