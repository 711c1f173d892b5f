"""The Redis tier against a real redis-server: killed, frozen, full, corrupted, shared."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import anyio
import mlx.core as mx
import pytest
from tier_blocks import assert_same_payload, chain_of, kv_blocks, namespace_of, peak_rss_script

from mlxkv.cache.tiers import (
    RedisTier,
    TierHealth,
    decode_payload,
    encode_block,
    max_value_size,
    storage_key,
)
from mlxkv.cache.tiers.redis_tier import KEY_PREFIX

LOGGER = "mlxkv.cache.tiers.redis_tier"
TIMEOUT = 0.25


@pytest.fixture
def blocks():
    return kv_blocks(3)


@pytest.fixture
def namespace(blocks):
    return namespace_of(blocks[0])


@pytest.fixture
def keys(namespace):
    return [storage_key(namespace, h) for h in chain_of(3)]


@pytest.fixture
def values(blocks, keys, namespace):
    return [encode_block(b, key=k, namespace=namespace) for b, k in zip(blocks, keys)]


@pytest.fixture
def make_tier(redis_server):
    def make(namespace, **options):
        # Generous by default, so a loaded machine's first connection cannot time
        # out; the frozen-server tests pass the short TIMEOUT they measure.
        options.setdefault("timeout", 5.0)
        options.setdefault("health", TierHealth(initial_delay=0.05, max_delay=0.2))
        return RedisTier(namespace, host="127.0.0.1", port=redis_server.port, **options)

    return make


def _records(caplog, level):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == level]


def _redis_key(key):
    return KEY_PREFIX + key.hex().encode()


async def _wait_for_probe(tier, health_delay=0.25):
    # Sleep past the back-off so the next call probes the server.
    await anyio.sleep(health_delay)


class TestRedisTier:
    async def test_put_then_get_round_trips(self, make_tier, redis_server, namespace, blocks, keys, values):
        """A block stored with one SET comes back verified and decodes to the same KV;
        the server holds one string per block, named by the storage key only."""
        async with make_tier(namespace) as tier:
            for key, value in zip(keys, values):
                assert await tier.put(key, value)
            got = await tier.get_many(keys)
            for value, block in zip(got, blocks):
                assert_same_payload(decode_payload(value), block)
            assert await tier.contains_many([keys[0], storage_key(namespace, b"other")]) == [True, False]
            assert tier.statistics().num_loaded == 0  # read, not yet used
            tier.count_loaded(2)
            stats = tier.statistics()
        assert (stats.num_written, stats.num_loaded, stats.num_missed) == (3, 2, 1)
        assert stats.available and stats.name == f"redis://127.0.0.1:{redis_server.port}/0"
        assert sorted(redis_server.command("KEYS", "*")) == sorted(_redis_key(k) for k in keys)
        assert redis_server.command("PTTL", _redis_key(keys[0])) == ":-1"

    async def test_ttl_is_set_on_every_value(self, make_tier, redis_server, namespace, keys, values):
        """With a TTL, each value expires on its own."""
        async with make_tier(namespace, ttl=60) as tier:
            await tier.put(keys[0], values[0])
        assert 0 < int(redis_server.command("PTTL", _redis_key(keys[0]))[1:]) <= 60_000

    async def test_killed_then_restarted(self, make_tier, redis_server, namespace, keys, values, caplog):
        """A server killed mid-run costs misses and dropped writes with one warning,
        never an error; once it is back, the tier reconnects and hits again."""
        caplog.set_level(logging.INFO, logger=LOGGER)
        async with make_tier(namespace) as tier:
            await tier.put(keys[0], values[0])
            redis_server.kill()
            start = anyio.current_time()
            for _ in range(5):
                assert await tier.get_many(keys) == [None] * 3
                assert await tier.contains_many(keys) == [False] * 3
                assert not await tier.put(keys[1], values[1])
            assert anyio.current_time() - start < 2 * TIMEOUT
            assert not tier.statistics().available
            assert len(_records(caplog, logging.WARNING)) == 1

            redis_server.start()  # empty: persistence is off
            await _wait_for_probe(tier)
            assert await tier.put(keys[1], values[1])
            assert await tier.get(keys[1]) is not None
            stats = tier.statistics()
        assert stats.available and stats.num_dropped == 5
        assert len(_records(caplog, logging.WARNING)) == 1
        assert [r.getMessage() for r in _records(caplog, logging.INFO)] == [
            f"redis tier {tier.name} available again"
        ]

    async def test_down_from_the_start(self, make_tier, redis_server, namespace, keys, values, caplog):
        """A tier whose server is down when it starts just misses, with one warning."""
        redis_server.kill()
        async with make_tier(namespace) as tier:
            assert await tier.get(keys[0]) is None
            assert not await tier.put(keys[0], values[0])
        assert len(_records(caplog, logging.WARNING)) == 1

    async def test_a_frozen_server_times_out_into_misses(self, make_tier, redis_server, namespace, keys, values):
        """A server that accepts but never answers costs one timeout; later calls
        miss at once (back-off), and hits resume when it answers again."""
        async with make_tier(namespace, timeout=TIMEOUT) as tier:
            await tier.put(keys[0], values[0])
            redis_server.pause()
            try:
                start = anyio.current_time()
                assert await tier.get(keys[0]) is None
                first = anyio.current_time() - start
                start = anyio.current_time()
                for _ in range(10):
                    assert await tier.get(keys[0]) is None
                later = anyio.current_time() - start
            finally:
                redis_server.resume()
            assert TIMEOUT * 0.9 <= first < TIMEOUT * 3
            assert later < TIMEOUT
            await _wait_for_probe(tier)
            assert await tier.get(keys[0]) is not None

    async def test_a_full_server_drops_writes_and_still_reads(
        self, make_tier, redis_server, namespace, keys, values, caplog
    ):
        """A server out of memory refuses writes (dropped, one warning) while its
        reads still hit; writes resume when it has room."""
        async with make_tier(namespace) as tier:
            await tier.put(keys[0], values[0])
            redis_server.command("CONFIG", "SET", "maxmemory", "1")
            try:
                assert not await tier.put(keys[1], values[1])
                assert not await tier.put(keys[2], values[2])
                assert await tier.get(keys[0]) is not None
            finally:
                redis_server.command("CONFIG", "SET", "maxmemory", "0")
            assert await tier.put(keys[1], values[1])
            stats = tier.statistics()
        assert stats.num_dropped == 2 and stats.available
        warnings = _records(caplog, logging.WARNING)
        assert len(warnings) == 1 and "OOM" in warnings[0].getMessage()

    async def test_corrupt_values_are_counted_misses_and_deleted(
        self, make_tier, redis_server, namespace, keys, values, caplog
    ):
        """A value with flipped bytes, or another key's value, is a miss: counted
        corrupt, deleted from the server, logged once."""
        async with make_tier(namespace) as tier:
            flipped = bytearray(values[0])
            flipped[-40] ^= 0x10
            redis_server.command("SET", _redis_key(keys[0]), bytes(flipped))
            redis_server.command("SET", _redis_key(keys[1]), values[2])
            assert await tier.get_many(keys[:2]) == [None, None]
            assert tier.statistics().num_corrupt == 2
            assert [r.reason for r in tier.take_removals()] == ["corrupt", "corrupt"]
        assert redis_server.command("EXISTS", _redis_key(keys[0]), _redis_key(keys[1])) == ":0"
        assert len(_records(caplog, logging.WARNING)) == 1

    @pytest.mark.parametrize(
        "other",
        [
            pytest.param(lambda block: namespace_of(block, model="sha256:model-b"), id="model"),
            pytest.param(lambda block: namespace_of(kv_blocks(1, block_size=8)[0]), id="block-size"),
            pytest.param(lambda block: namespace_of(kv_blocks(1, dtype=mx.float32)[0]), id="dtype"),
        ],
    )
    async def test_another_namespace_is_never_a_hit(self, make_tier, redis_server, blocks, keys, values, other):
        """Another namespace on the same server finds nothing, even a value copied
        under its own key."""
        async with make_tier(namespace_of(blocks[0])) as tier:
            await tier.put(keys[0], values[0])
        namespace = other(blocks[0])
        other_key = storage_key(namespace, chain_of(1)[0])
        async with make_tier(namespace) as tier:
            assert await tier.get(other_key) is None
            redis_server.command("SET", _redis_key(other_key), values[0])
            assert await tier.get(other_key) is None
            assert tier.statistics().num_corrupt == 1

    async def test_shared_by_two_clients(self, make_tier, namespace, blocks, keys, values):
        """What one client (another process, another host) stores, another reads."""
        async with make_tier(namespace) as writer, make_tier(namespace) as reader:
            await writer.put(keys[2], values[2])
            assert_same_payload(decode_payload(await reader.get(keys[2])), blocks[2])


def _net_output_bytes(server) -> int:
    """Bytes the server has sent to its clients so far."""
    info = server.command("INFO", "stats").decode()
    return int(next(line for line in info.splitlines() if line.startswith("total_net_output_bytes:")).split(":")[1])


class TestUntrustedValues:
    """Whatever is stored under a block's key is read no further than a value
    can be, and what is not a value is counted corrupt and deleted."""

    async def test_a_64_mib_value_is_not_transferred(self, make_tier, redis_server, namespace, keys):
        """64 MiB of garbage under a block's key is refused after reading one
        byte more than the largest value: the server sends a few KB, not 64 MiB;
        the key is counted corrupt and deleted."""
        redis_server.command("SETRANGE", _redis_key(keys[0]), 64 * 2**20 - 1, "x")
        async with make_tier(namespace) as tier:
            assert await tier.contains_many([keys[0]]) == [True]
            before = _net_output_bytes(redis_server)
            assert await tier.get(keys[0]) is None
            sent = _net_output_bytes(redis_server) - before
            stats = tier.statistics()
        assert sent < max_value_size(namespace) + 4096
        assert (stats.num_corrupt, stats.num_missed) == (1, 0)
        assert redis_server.command("EXISTS", _redis_key(keys[0])) == ":0"

    @pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak RSS from /proc")
    def test_a_64_mib_value_does_not_grow_the_process(self, redis_server, namespace, keys):
        """In a fresh process, refusing a 64 MiB value raises the peak RSS by less
        than 16 MiB (reading it whole took over 64 MiB)."""
        redis_server.command("SETRANGE", _redis_key(keys[0]), 64 * 2**20 - 1, "x")
        script = peak_rss_script(_PEAK_RSS_MAIN, port=redis_server.port)
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        growth_kib, missed, corrupt = done.stdout.split()
        assert (missed, corrupt) == ("True", "1")
        assert int(growth_kib) < 16 * 1024

    @pytest.mark.parametrize(
        "plant",
        [
            pytest.param(("RPUSH", "a", "b"), id="list"),
            pytest.param(("HSET", "field", "value"), id="hash"),
            pytest.param(("SET", ""), id="empty-string"),
        ],
    )
    async def test_what_is_not_a_value_is_corrupt_and_deleted(
        self, make_tier, redis_server, namespace, keys, values, plant
    ):
        """A list, a hash or an empty string at a block's key is counted corrupt
        (not a miss) and deleted, like a string that does not verify; the keys
        around it still read."""
        command, *arguments = plant
        redis_server.command(command, _redis_key(keys[1]), *arguments)
        async with make_tier(namespace) as tier:
            await tier.put(keys[0], values[0])
            await tier.put(keys[2], values[2])
            got = await tier.get_many(keys)
            stats = tier.statistics()
            assert [r.reason for r in tier.take_removals()] == ["corrupt"]
        assert [value is not None for value in got] == [True, False, True]
        assert (stats.num_corrupt, stats.num_missed) == (1, 0)
        assert redis_server.command("EXISTS", _redis_key(keys[1])) == ":0"

    async def test_a_value_of_another_position_is_corrupt(self, make_tier, redis_server, namespace, keys, values):
        """Read for the position it must hold, a block's value of another
        position (its key and checksum fine) is counted corrupt and deleted."""
        async with make_tier(namespace) as tier:
            await tier.put(keys[1], values[1])  # block 1: start 4
            assert await tier.get_many([keys[1]], starts=[8]) == [None]
            assert tier.statistics().num_corrupt == 1
        assert redis_server.command("EXISTS", _redis_key(keys[1])) == ":0"


_PEAK_RSS_MAIN = """
from mlxkv.cache.tiers import RedisTier, storage_key

async def main():
    namespace = namespace_of(kv_blocks(3)[0])
    key = storage_key(namespace, chain_of(1)[0])
    async with RedisTier(namespace, host="127.0.0.1", port={port}, timeout=5.0) as tier:
        await tier.get(storage_key(namespace, b"connect first"))
        before = peak_kib()
        value = await tier.get(key)
        after = peak_kib()
        print(after - before, value is None, tier.statistics().num_corrupt)
"""
