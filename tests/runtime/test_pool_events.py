"""The block pool's KV events: what a prefix-aware router folds into its view
of this runtime's cache.

Real runtimes on the tiny Llama. A subscriber folds the pool's events (a
``BlockStored`` adds a hash, a ``BlockRemoved`` takes one away); at every
quiet point the fold must be exactly the pool's cached hashes, whatever
stored, evicted, forked or released them.
"""

from __future__ import annotations

import random
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxkv import CacheRuntime
from mlxkv.cache.kv_events import POOL, BlockRemoved, BlockStored, KVEventSubscription
from mlxkv.default_model import TINY_LLAMA, ensure_model

from budget import examples
from parity import BS, assert_clean, run

pytestmark = pytest.mark.anyio


@pytest.fixture
def llama(model_dir: Any) -> str:
    return str(ensure_model(TINY_LLAMA, model_dir))


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(length)]


def _drain(events: KVEventSubscription) -> list[Any]:
    taken = []
    while True:
        try:
            taken.append(events.receive_nowait())
        except anyio.WouldBlock:
            return taken


class _Fold:
    """A router's view of the pool: the hashes announced stored and not removed."""

    def __init__(self) -> None:
        self.cached: set[bytes] = set()

    def apply(self, events: list[Any]) -> None:
        for event in events:
            assert event.tier == POOL
            if isinstance(event, BlockStored):
                assert event.block_hash not in self.cached, "stored twice without a removal"
                self.cached.add(event.block_hash)
            else:
                assert isinstance(event, BlockRemoved) and event.reason == "evicted"
                assert event.block_hash in self.cached, "removed what was never announced"
                self.cached.remove(event.block_hash)


class TestPoolEvents:
    async def test_each_stored_block_is_announced_with_its_tokens(self, llama):
        prompt = _prompt(1, 6 * BS + 5)
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            with rt.kv_events() as events:
                await run(rt, prompt)
                stored = _drain(events)
        blocks = [tuple(prompt[i : i + BS]) for i in range(0, 6 * BS, BS)]
        assert [event.token_ids for event in stored][:6] == blocks
        assert all(isinstance(event, BlockStored) and event.tier == POOL for event in stored)
        assert stored[0].parent_hash is None
        for parent, child in zip(stored, stored[1:]):
            assert child.parent_hash == parent.block_hash
        assert all(event.extra_keys is None and not event.salted for event in stored)
        assert all(event.block_size == BS and event.key is None for event in stored)

    async def test_a_tenants_chain_is_marked_salted(self, llama):
        """The salt enters the first block's hash: that block carries it as
        its extra keys, every block of the chain says it is salted."""
        prompt = _prompt(2, 3 * BS)
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            with rt.kv_events() as events:
                await run(rt, prompt, cache_salt="tenant-a", max_tokens=1)
                stored = _drain(events)
        assert len(stored) == 3
        assert all(event.salted for event in stored)
        assert stored[0].extra_keys == (("salt", "tenant-a"),)
        assert [event.extra_keys for event in stored[1:]] == [None, None]

    async def test_a_block_already_cached_is_not_announced_again(self, llama):
        prompt = _prompt(3, 4 * BS)
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            with rt.kv_events() as events:
                await run(rt, prompt, max_tokens=1)
                first = _drain(events)
                await run(rt, prompt + [7] * BS, max_tokens=1)
                second = _drain(events)
        assert len(first) == 4
        assert [event.token_ids for event in second] == [(7,) * BS]
        assert second[0].parent_hash == first[-1].block_hash

    @settings(
        max_examples=examples(10),
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    @given(
        steps=st.lists(
            st.tuples(st.sampled_from(["run", "fork", "evict"]), st.integers(0, 5), st.integers(1, 7)),
            min_size=1,
            max_size=8,
        )
    )
    async def test_the_fold_is_the_pools_cache(self, llama, steps):
        """Whatever runs, forks and evictions happen on a pool small enough to
        evict, the fold of the events equals the pool's cached hashes."""
        fold = _Fold()
        async with CacheRuntime(model=llama, block_size=BS, max_blocks=12) as rt:
            with rt.kv_events(buffer=1 << 16) as events:
                for number, (step, seed, blocks) in enumerate(steps):
                    prompt = _prompt(seed, blocks * BS + 3)
                    if step == "run":
                        await run(rt, prompt, max_tokens=2)
                    elif step == "fork":
                        await rt.fetch(f"source{number}", prompt)
                        await rt.fork(f"source{number}", f"fork{number}")
                        await rt.release(f"source{number}")
                        await rt.release(f"fork{number}")
                    else:
                        await rt.evict(blocks)
                    fold.apply(_drain(events))
                    assert len(fold.cached) == (await rt.stats()).allocator.num_cached
                assert events.num_lost == 0
            await assert_clean(rt)
