"""The cache client (on checked arguments) and the gate its callers pass through."""

from __future__ import annotations

from array import array

import anyio
import mlx.core as mx
import pytest

from mlxkv import CacheRuntime, OutOfBlocks, RuntimeClosed
from mlxkv.actors.actor import ActorFailed
from mlxkv.actors.prefix_index import RequestId
from mlxkv.cache.block_hash import ChainKeys, hash_block_chain
from mlxkv.gate import Gate, Phase

BS = 4
PROMPT = array("I", range(1, 5 * BS + 3))  # 5 full blocks and 2 tokens


def kv(n: int, tag: float = 0.0) -> tuple:
    return tuple(mx.full((2, BS), tag + i) for i in range(n))


class TestCacheClient:
    async def test_a_leading_store_keeps_what_fits_and_the_rest_stays_known(self):
        """A store of the leading blocks that fit holds them, says what did not fit,
        and keeps the other blocks' tokens so that a later store adds them."""
        async with CacheRuntime(block_size=BS, max_blocks=3) as rt:
            client = rt.client
            rid = RequestId("r")
            await client.fetch(rid, PROMPT, ChainKeys())
            partial = await client.store(rid, PROMPT, kv(5), leading=True)
            assert (partial.num_blocks, partial.num_held_blocks) == (3, 3)
            assert isinstance(partial.refused, OutOfBlocks) and partial.refused.requested == 5
            assert await rt.check_invariants()
            # The pool is full of the request's own blocks: nothing more fits.
            again = await client.store(rid, PROMPT, kv(2, 10.0), leading=True)
            assert again.num_blocks == 0 and again.refused is not None
            with pytest.raises(OutOfBlocks):
                await client.store(rid, PROMPT, kv(2, 10.0))
            assert await client.release(rid) == 3
            # A reader gets the three blocks, under the chain's hashes.
            reader = await client.fetch(RequestId("reader"), PROMPT, ChainKeys())
            assert [g.block_hash for g in reader.grants] == hash_block_chain(PROMPT, BS)[:3]
            await client.release(RequestId("reader"))
            assert await rt.check_invariants()

    async def test_a_leading_store_that_fits_is_a_plain_store(self):
        """With room for every block, a leading store refuses nothing."""
        async with CacheRuntime(block_size=BS, max_blocks=8) as rt:
            rid = RequestId("r")
            await rt.client.fetch(rid, PROMPT, ChainKeys())
            result = await rt.client.store(rid, PROMPT, kv(5), leading=True)
            assert (result.num_blocks, result.refused) == (5, None)
            await rt.client.release(rid)

    async def test_abandon_releases_once_and_ignores_what_is_gone(self):
        """abandon gives back every reference a request holds, and is a no-op for a
        request that holds nothing (the way out of a failed generation)."""
        async with CacheRuntime(block_size=BS, max_blocks=8) as rt:
            rid = RequestId("r")
            await rt.fetch(rid, list(PROMPT))
            await rt.store(rid, list(PROMPT), list(kv(5)))
            await rt.client.abandon(rid)
            await rt.client.abandon(rid)
            assert (await rt.stats()).allocator.num_referenced == 0
            assert await rt.check_invariants()


class TestGate:
    def test_a_call_is_refused_unless_running(self):
        """Before open and after close, a call raises RuntimeClosed naming the phase."""
        gate = Gate()
        with pytest.raises(RuntimeClosed, match="not started"):
            with gate.call():
                pass
        gate.closed()
        assert gate.phase is Phase.CLOSED
        with pytest.raises(RuntimeClosed, match="is closed"):
            with gate.call():
                pass

    async def test_calls_in_flight_are_waited_for(self):
        """close refuses new calls; wait_drained returns once the last call ends."""
        gate = Gate()
        async with anyio.create_task_group() as tg:
            gate.open(tg)
            started, finish = anyio.Event(), anyio.Event()

            async def call() -> None:
                with gate.call():
                    started.set()
                    await finish.wait()

            tg.start_soon(call)
            await started.wait()
            assert gate.num_in_flight == 1
            gate.close()
            with pytest.raises(RuntimeClosed, match="closing"):
                with gate.call():
                    pass
            with anyio.move_on_after(0.05) as scope:
                await gate.wait_drained()
            assert scope.cancelled_caught
            finish.set()
            with anyio.fail_after(5):
                await gate.wait_drained()
        assert gate.num_in_flight == 0 and gate.num_calls == 1

    async def test_a_stopped_actor_is_reported_with_the_crash(self):
        """ActorFailed in a call becomes RuntimeClosed('failed') with the first crash as cause."""
        gate = Gate()
        crash = RuntimeError("boom")
        async with anyio.create_task_group() as tg:
            gate.open(tg)
            with pytest.raises(RuntimeClosed) as info:
                with gate.call():
                    raise ActorFailed("allocator", crash)
            assert info.value.reason == "failed" and info.value.cause is crash
            gate.fail(crash)
            gate.fail(RuntimeError("later"))
        assert gate.phase is Phase.FAILED and gate.failure is crash
        with pytest.raises(RuntimeClosed, match="crashed with RuntimeError: boom"):
            gate.start_soon(anyio.sleep, 0)
