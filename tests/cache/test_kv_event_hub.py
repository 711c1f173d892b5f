"""KV events: every subscriber sees events in order; a slow one loses events, never blocks."""

from __future__ import annotations

import math

import anyio
import pytest

from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.kv_events import BlockRemoved, BlockStored, KVEventHub
from mlxkv.cache.tiers import StorageKey

KEY = StorageKey(b"k" * 32)


def _store(hub: KVEventHub, n: int) -> None:
    for i in range(n):
        hub.stored(tier="file:///kv", key=KEY, block_hash=bytes([i]), parent_hash=None)


class TestKVEventHub:
    async def test_subscribers_see_every_event_in_order(self):
        """Each subscriber gets stores and removals numbered in publication order."""
        hub = KVEventHub(block_size=16)
        with hub.subscribe() as first, hub.subscribe() as second:
            hub.stored(tier="redis://h:1/0", key=KEY, block_hash=b"h", parent_hash=b"p")
            hub.removed(tier="file:///kv", key=KEY, reason="evicted")
            hub.close()
            for subscription in (first, second):
                events = [event async for event in subscription]
                assert events == [
                    BlockStored(seq=0, tier="redis://h:1/0", key=KEY, block_hash=b"h", parent_hash=b"p", block_size=16),
                    BlockRemoved(seq=1, tier="file:///kv", key=KEY, reason="evicted", block_size=16),
                ]

    async def test_a_slow_subscriber_loses_events_and_counts_them(self):
        """A full buffer drops that subscriber's events (counted; seq shows the gap)
        while publishing never waits and other subscribers get everything."""
        hub = KVEventHub(block_size=4)
        with hub.subscribe(buffer=2) as slow, hub.subscribe(buffer=math.inf) as fast:
            with anyio.fail_after(1):
                _store(hub, 5)
            assert slow.num_lost == 3
            assert [slow.receive_nowait().seq for _ in range(2)] == [0, 1]
            _store(hub, 1)
            assert slow.receive_nowait().seq == 5
            assert [fast.receive_nowait().seq for _ in range(6)] == list(range(6))
            stats = hub.statistics()
            hub.close()
        assert (stats.num_published, stats.num_subscribers, stats.num_lost) == (6, 2, 3)

    async def test_a_closed_subscriber_is_dropped(self):
        """Unsubscribing removes the subscriber; publishing goes on."""
        hub = KVEventHub(block_size=4)
        subscription = hub.subscribe()
        subscription.close()
        _store(hub, 2)
        assert hub.statistics().num_subscribers == 0
        hub.close()

    async def test_subscribing_after_close_ends_at_once(self):
        """A subscription made after the hub closed has no events."""
        hub = KVEventHub(block_size=4)
        hub.close()
        with hub.subscribe() as subscription:
            assert [event async for event in subscription] == []

    def test_bad_buffer_refused(self):
        """A buffer must hold at least one event."""
        with pytest.raises(InvalidInput):
            KVEventHub(block_size=4).subscribe(buffer=0)
