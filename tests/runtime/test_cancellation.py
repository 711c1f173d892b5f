"""Cancellation at every await point of a call leaves nothing referenced.

Two sweeps per operation. The first cancels the call after the test task has
yielded to the scheduler k times, for k = 0, 1, 2, ... until the call
completes first: every interleaving of the call's awaits with the actors'
handling is cut once (deterministically on asyncio, shuffled on trio). The
second cancels it from inside the k-th actor handler, so that the reply is
ready exactly when the caller is cancelled: the caller must give it back.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel
import mlx.core as mx
import pytest

from mlxkv import CacheRuntime, UnknownRequest
from mlxkv.actors.actor import Message

BS = 4
PROMPT = list(range(1, 3 * BS + 2))
IDS = ("seed", "x", "y")


def kv(n: int) -> list:
    return [mx.full((1, BS), float(i)) for i in range(n)]


async def seed_held(rt: CacheRuntime) -> None:
    """A request "seed" holds the prompt's three blocks."""
    await rt.fetch("seed", PROMPT)
    await rt.store("seed", PROMPT, kv(3))


async def seed_cached(rt: CacheRuntime) -> None:
    """The prompt's blocks are cached but nobody holds them."""
    await seed_held(rt)
    await rt.release("seed")


async def hold_x(rt: CacheRuntime) -> None:
    """A request "x" has fetched the prompt (a miss)."""
    await rt.fetch("x", PROMPT)


async def nothing(rt: CacheRuntime) -> None:
    """No set-up."""


async def request_scope(rt: CacheRuntime) -> None:
    async with rt.request("x", PROMPT) as req:
        await req.store(PROMPT + [9, 9, 9], kv(4 - len(req.result.grants)))
        await req.fork("y")
        await rt.release("y")


#: name -> (set-up, the call to cancel)
OPERATIONS: dict[str, tuple[Callable[[CacheRuntime], Awaitable[None]], Callable]] = {
    "fetch-miss": (nothing, lambda rt: rt.fetch("x", PROMPT)),
    "fetch-hit-cached": (seed_cached, lambda rt: rt.fetch("x", PROMPT)),
    "fetch-hit-held": (seed_held, lambda rt: rt.fetch("x", PROMPT + [5])),
    "fetch-images": (nothing, lambda rt: rt.fetch("x", PROMPT, images=[b"img"], cache_salt="t")),
    "store": (hold_x, lambda rt: rt.store("x", PROMPT, kv(3))),
    "store-shared": (seed_held, lambda rt: _fetch_then_store(rt)),
    "fork": (seed_held, lambda rt: rt.fork("seed", "x")),
    "release": (seed_held, lambda rt: rt.release("seed")),
    "evict": (seed_cached, lambda rt: rt.evict(2)),
    "request-scope": (seed_cached, request_scope),
}


async def _fetch_then_store(rt: CacheRuntime) -> None:
    result = await rt.fetch("x", PROMPT + [1, 2, 3])
    await rt.store("x", PROMPT + [1, 2, 3], kv(4 - len(result.grants)))


async def assert_nothing_leaked(rt: CacheRuntime) -> None:
    """After releasing every request that may exist, no block is referenced."""
    for request_id in IDS:
        try:
            await rt.release(request_id)
        except UnknownRequest:
            pass
    assert await rt.check_invariants()
    stats = await rt.stats()
    assert stats.allocator.num_referenced == 0, stats.allocator
    assert stats.index.num_active_requests == 0, stats.index


async def cancel_after_yields(name: str, yields: int) -> bool:
    """Run one operation, cancelling it after ``yields`` scheduler turns.

    Returns:
        Whether the call completed before the cancellation.
    """
    setup, operation = OPERATIONS[name]
    async with CacheRuntime(block_size=BS, max_blocks=16) as rt:
        await setup(rt)
        completed = False

        async def call(scope: anyio.CancelScope) -> None:
            nonlocal completed
            with scope:
                await operation(rt)
                completed = True

        scope = anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            tg.start_soon(call, scope)
            for _ in range(yields):
                await anyio.lowlevel.checkpoint()
            scope.cancel()
        await assert_nothing_leaked(rt)
    return completed


async def cancel_in_handler(name: str, message_number: int) -> bool:
    """Run one operation, cancelling it while the actor handles its n-th message.

    Returns:
        Whether the operation sent fewer messages (it ran to completion).
    """
    setup, operation = OPERATIONS[name]
    seen = []
    scopes: list[anyio.CancelScope] = []

    def intercept(actor: str, message: Message) -> None:
        if scopes:
            seen.append(type(message).__name__)
            if len(seen) == message_number:
                scopes[0].cancel()

    async with CacheRuntime(block_size=BS, max_blocks=16, intercept=intercept) as rt:
        await setup(rt)
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            await operation(rt)
        scopes.clear()
        await assert_nothing_leaked(rt)
    completed = len(seen) < message_number
    # A cut that landed must have been felt: the call ended cancelled (a
    # release is shielded and completes, but still saw the cut message).
    assert completed or scope.cancel_called
    return completed


class TestCancellation:
    @pytest.mark.parametrize("name", OPERATIONS)
    async def test_cancel_at_every_scheduler_turn(self, name):
        """Cancelled after any number of scheduler turns, the call leaves nothing behind."""
        for yields in range(200):
            completed = await cancel_after_yields(name, yields)
            if completed:
                break
        else:
            pytest.fail(f"{name} never completed")
        # Releasing is shielded: it completes even when cancelled at once.
        assert yields > 0 or name == "release"

    @pytest.mark.parametrize("name", OPERATIONS)
    async def test_cancel_while_each_message_is_handled(self, name):
        """Cancelled while an actor handles any of its messages, the call gives back
        what the (late) reply granted."""
        for message_number in range(1, 100):
            if await cancel_in_handler(name, message_number):
                break
        else:
            pytest.fail(f"{name} never completed")
        # Every operation sends at least one message: at least one cut landed.
        assert message_number > 1

    async def test_late_acquire_reply_is_released(self):
        """A fetch cancelled while the allocator grants its blocks releases the grant
        it never saw, then closes its table."""
        seen: list[str] = []
        scopes: list[anyio.CancelScope] = []

        def intercept(actor: str, message: Message) -> None:
            if message.request_id == "x":
                seen.append(type(message).__name__)
                if type(message).__name__ == "Acquire":
                    scopes[0].cancel()

        async with CacheRuntime(block_size=BS, max_blocks=16, intercept=intercept) as rt:
            await seed_cached(rt)
            with anyio.CancelScope() as scope:
                scopes.append(scope)
                await rt.fetch("x", PROMPT)
            assert scope.cancelled_caught
            await rt.stats()  # the allocator has handled every Tell sent before
            # Two actors: their handling order may interleave either way.
            assert seen[:2] == ["Begin", "Acquire"] and sorted(seen[2:]) == ["Close", "Release"]
            await assert_nothing_leaked(rt)
