"""Hundreds of concurrent requests over shared prefixes keep every invariant."""

from __future__ import annotations

import random

import anyio
import mlx.core as mx
import pytest

from mlxkv import CacheRuntime, OutOfBlocks

BS = 4
PREFIXES = [[p * 1000 + t for t in range(1, 4 * BS + 1)] for p in range(5)]


async def client(
    rt: CacheRuntime, number: int, seed: int, cancel: bool, refused: list[int] | None = None
) -> None:
    """Fetch a shared prefix, store the rest, fork, release; maybe cancelled midway.

    A store refused for lack of blocks is counted in ``refused``.
    """
    rng = random.Random(seed * 7919 + number)
    prompt = rng.choice(PREFIXES) + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 2 * BS))]
    with anyio.CancelScope() as scope:
        if cancel and rng.random() < 0.3:
            scope.deadline = anyio.current_time() + rng.uniform(0, 0.002)
        async with rt.request(f"r{number}", prompt) as req:
            held = len(req.result.grants)
            try:
                await req.store(prompt, [mx.array([i]) for i in range(held, len(prompt) // BS)])
            except OutOfBlocks:
                if refused is not None:
                    refused.append(number)
                return
            if rng.random() < 0.5:
                async with rt.request(f"r{number}-probe", prompt) as probe:
                    assert probe.result.num_cached_tokens >= (len(prompt) // BS) * BS
            if rng.random() < 0.5:
                await req.fork(f"r{number}-fork")
                await anyio.sleep(0)
                await rt.release(f"r{number}-fork")


class TestConcurrency:
    @pytest.mark.parametrize(
        ("max_blocks", "cancel"), [(4096, False), (4096, True), (40, True)], ids=["roomy", "cancelled", "tiny-pool"]
    )
    async def test_hundreds_of_requests(self, max_blocks, cancel):
        """300 concurrent requests (some cancelled, some refused for lack of blocks)
        leave every invariant intact and no block referenced."""
        refused: list[int] = []
        async with CacheRuntime(block_size=BS, max_blocks=max_blocks, mailbox_size=16) as rt:
            async with anyio.create_task_group() as tg:
                for number in range(300):
                    tg.start_soon(client, rt, number, max_blocks, cancel, refused)
            assert await rt.check_invariants()
            stats = await rt.stats()
        # The tiny pool really refused requests; the roomy one never did.
        assert (len(refused) > 0) is (max_blocks < 100)
        assert stats.allocator.num_referenced == 0
        assert stats.index.num_active_requests == 0
        assert stats.allocator.num_hits > 0
        for actor in stats.actors:
            assert actor.mailbox.current_buffer_used == 0
            assert actor.mailbox.max_buffer_size == 16

    async def test_invariants_hold_mid_flight(self):
        """Per-actor invariants can be checked while calls are in flight; the
        cross-actor check is skipped then, not wrong."""
        async with CacheRuntime(block_size=BS, max_blocks=512) as rt:
            exact = []
            async with anyio.create_task_group() as tg:
                for number in range(100):
                    tg.start_soon(client, rt, number, 1, False)
                for _ in range(10):
                    exact.append(await rt.check_invariants())
                    await anyio.sleep(0)
            assert await rt.check_invariants()
        assert False in exact
