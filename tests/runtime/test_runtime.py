"""CacheRuntime: lifecycle, the low-level API, the request scope, typed errors."""

from __future__ import annotations

import attrs
import anyio
import mlx.core as mx
import pytest

from mlxkv import (
    CacheRuntime,
    DuplicateRequest,
    InvalidInput,
    OutOfBlocks,
    RuntimeClosed,
    RuntimeConfig,
    UnknownRequest,
)
from mlxkv.actors.actor import Message

BS = 4
PROMPT = list(range(1, 3 * BS + 2))  # 3 full blocks and 1 token


def kv(n: int, tag: float = 0.0) -> list:
    """One small MLX array per block, standing for its KV slices."""
    return [mx.full((2, BS), tag + i) for i in range(n)]


def runtime(**overrides) -> CacheRuntime:
    return CacheRuntime(block_size=BS, max_blocks=overrides.pop("max_blocks", 32), **overrides)


async def assert_clean(rt: CacheRuntime) -> None:
    """Every invariant holds and, with no request left, nothing is referenced."""
    assert await rt.check_invariants()
    stats = await rt.stats()
    assert stats.allocator.num_referenced == 0
    assert stats.index.num_active_requests == 0


class TestRuntimeConfig:
    def test_defaults(self):
        """The defaults are those of the design."""
        config = RuntimeConfig()
        assert (config.block_size, config.trace) == (64, False)

    def test_overrides_replace_fields(self):
        """Keyword overrides apply on top of a given config."""
        rt = CacheRuntime(RuntimeConfig(block_size=8), max_blocks=10, trace=True)
        assert rt.config == attrs.evolve(RuntimeConfig(), block_size=8, max_blocks=10, trace=True)

    @pytest.mark.parametrize(
        "overrides",
        [{"block_size": 0}, {"max_blocks": 0}, {"mailbox_size": 1.5}, {"trace": 1}, {"keep_caches": 1}, {"transpose_weights": "on"},
         {"nope": 1}],
    )
    def test_bad_values_are_invalid_input(self, overrides):
        """A bad or unknown field is InvalidInput naming it."""
        with pytest.raises(InvalidInput, match=next(iter(overrides))):
            CacheRuntime(**overrides)

    def test_parts_are_given_and_read_by_name(self):
        """A part's field given by name builds that part; given beside the
        part, it changes the part; read by name, it is the part's."""
        from mlxkv.actors.compute_config import RunnerConfig, SchedulingConfig

        config = RuntimeConfig(prefill_chunk=32, kv_bits=8, block_size=16)
        assert config.scheduling == SchedulingConfig(prefill_chunk=32)
        assert config.runner == RunnerConfig(kv_bits=8)
        assert (config.prefill_chunk, config.kv_bits, config.block_size) == (32, 8, 16)
        beside = RuntimeConfig(scheduling=SchedulingConfig(decode_wait=2), prefill_chunk=32)
        assert beside.scheduling == SchedulingConfig(decode_wait=2, prefill_chunk=32)
        assert attrs.evolve(config, decode_wait=3).scheduling == SchedulingConfig(prefill_chunk=32, decode_wait=3)
        with pytest.raises(InvalidInput, match="scheduling"):
            RuntimeConfig(scheduling={"prefill_chunk": 32})
        with pytest.raises(AttributeError, match="no_such_field"):
            config.no_such_field

    def test_old_names_still_work(self):
        """``keep_last_cache`` is taken and read as ``keep_caches``, each time
        with a DeprecationWarning that names the new name; both at once is refused."""
        with pytest.warns(DeprecationWarning, match="keep_last_cache is the old name of keep_caches"):
            config = RuntimeConfig(keep_last_cache=False)
        assert config.keep_caches is False
        with pytest.warns(DeprecationWarning, match="keep_caches"):
            assert config.keep_last_cache is False
        with pytest.warns(DeprecationWarning, match="keep_caches"):
            assert CacheRuntime(keep_last_cache=False).config == config
        with pytest.raises(InvalidInput, match="keep_last_cache"):
            RuntimeConfig(keep_last_cache=False, keep_caches=True)

    def test_config_must_be_a_config(self):
        """Anything but a RuntimeConfig as config is refused."""
        with pytest.raises(InvalidInput, match="config"):
            CacheRuntime({"block_size": 4})  # type: ignore[arg-type]


class TestLifecycle:
    async def test_calls_outside_the_context_are_refused(self):
        """Before enter and after exit, calls raise RuntimeClosed."""
        rt = runtime()
        with pytest.raises(RuntimeClosed, match="not started"):
            await rt.fetch("r1", PROMPT)
        async with rt:
            assert not rt.closed
        assert rt.closed
        with pytest.raises(RuntimeClosed, match="closed"):
            await rt.stats()
        with pytest.raises(RuntimeClosed):
            async with rt:
                pass

    async def test_entered_once(self):
        """Entering a running runtime again is refused; it keeps running."""
        async with runtime() as rt:
            with pytest.raises(InvalidInput, match="enter it once"):
                await rt.__aenter__()
            assert (await rt.fetch("r1", PROMPT)).num_cached_tokens == 0

    async def test_exit_drains_calls_in_flight(self):
        """Calls started before exit complete; calls after it are refused.

        Whether a call is still in flight at the exit is up to the scheduler
        (trio's order is random): a run where every call ended first proves
        nothing, so it runs again, up to five times."""
        in_flight_at_exit = 0
        for _ in range(5):
            rt = runtime()
            started, results = [], []

            async def client(i: int) -> None:
                started.append(i)
                results.append(await rt.fetch(f"r{i}", PROMPT))

            async with anyio.create_task_group() as outside:
                async with rt:
                    for i in range(20):
                        outside.start_soon(client, i)
                    while len(started) < 20:
                        await anyio.sleep(0)
                    in_flight_at_exit = 20 - len(results)
            assert len(results) == 20, f"{in_flight_at_exit} calls in flight at the exit did not all end"
            if in_flight_at_exit:
                break
        assert in_flight_at_exit, "every call ended before the exit, five times: none was in flight"

    async def test_actor_crash_fails_callers_and_exits_with_the_cause(self):
        """A crashing handler fails pending callers with RuntimeClosed; the block
        exits with the crash itself."""
        ready = []

        def intercept(actor: str, message: Message) -> None:
            if type(message).__name__ == "Acquire" and len(ready) >= 10:
                raise RuntimeError("allocator bug")

        outcomes: list[BaseException] = []

        async def client(rt: CacheRuntime, i: int) -> None:
            ready.append(i)
            try:
                await rt.fetch(f"r{i}", PROMPT)
            except RuntimeClosed as error:
                outcomes.append(error)

        async with anyio.create_task_group() as outside:
            with pytest.raises(RuntimeError, match="allocator bug"):
                async with runtime(intercept=intercept, mailbox_size=2) as rt:
                    await rt.fetch("seed", PROMPT)
                    await rt.store("seed", PROMPT, kv(3))
                    for i in range(10):
                        outside.start_soon(client, rt, i)
                    await anyio.sleep_forever()
        assert len(outcomes) == 10
        assert all(error.reason == "failed" for error in outcomes)
        assert all(isinstance(error.cause, RuntimeError) for error in outcomes)
        with pytest.raises(RuntimeClosed, match="allocator bug"):
            await rt.stats()

    async def test_body_error_propagates_unwrapped(self):
        """An exception in the block leaves as itself, not in an exception group."""
        with pytest.raises(KeyError):
            async with runtime():
                raise KeyError("mine")

    async def test_outer_cancellation_stops_the_runtime(self):
        """A runtime inside a cancelled scope stops and leaves the scope quietly."""
        with anyio.move_on_after(0.05) as scope:
            async with runtime() as rt:
                await anyio.sleep_forever()
        assert scope.cancelled_caught and rt.closed


class TestFetchAndStore:
    async def test_miss_store_hit(self):
        """A stored prefix is served to the next request, payloads by reference."""
        payloads = kv(3)
        async with runtime() as rt:
            miss = await rt.fetch("r1", PROMPT)
            assert (miss.num_cached_tokens, miss.remaining) == (0, tuple(PROMPT))
            stored = await rt.store("r1", PROMPT, payloads)
            assert (stored.num_blocks, stored.num_reused, stored.num_held_blocks) == (3, 0, 3)
            hit = await rt.fetch("r2", PROMPT + [77])
            assert hit.num_cached_tokens == 3 * BS
            assert hit.remaining == (PROMPT[-1], 77)
            assert all(a is b for a, b in zip(hit.payloads, payloads))
            assert await rt.release("r1") == 3
            assert await rt.release("r2") == 3
            await assert_clean(rt)

    async def test_partial_prefix_hit(self):
        """A prompt that diverges in block 2 gets block 1 only."""
        async with runtime() as rt:
            async with rt.request("r1", PROMPT) as req:
                await req.store(PROMPT, kv(3))
                other = PROMPT[:BS] + [999] * (2 * BS)
                async with rt.request("r2", other) as second:
                    assert second.result.num_cached_tokens == BS
            await assert_clean(rt)

    async def test_store_shares_blocks_computed_twice(self):
        """Two requests storing the same prefix end up sharing its blocks."""
        async with runtime() as rt:
            await rt.fetch("a", PROMPT)
            await rt.fetch("b", PROMPT)
            first = await rt.store("a", PROMPT, kv(3))
            second = await rt.store("b", PROMPT, kv(3, tag=9))
            assert (first.num_reused, second.num_reused) == (0, 3)
            assert (await rt.stats()).allocator.num_referenced == 3
            await rt.release("a")
            await rt.release("b")
            await assert_clean(rt)

    async def test_incremental_stores(self):
        """Storing in steps (prefill chunks, then decode) extends the request."""
        async with runtime() as rt:
            await rt.fetch("r1", PROMPT)
            assert (await rt.store("r1", PROMPT[: 2 * BS], kv(2))).num_held_blocks == 2
            assert (await rt.store("r1", PROMPT[: 2 * BS + 1], [])).num_blocks == 0
            longer = PROMPT + [5, 6, 7, 8]
            assert (await rt.store("r1", longer, kv(2))).num_held_blocks == 4
            hit = await rt.fetch("r2", longer)
            assert hit.num_cached_tokens == 4 * BS
            await rt.release("r1")
            await rt.release("r2")
            await assert_clean(rt)

    async def test_salt_isolates_tenants(self):
        """Requests with different salts never share blocks."""
        async with runtime() as rt:
            await rt.fetch("a", PROMPT, cache_salt="tenant-1")
            await rt.store("a", PROMPT, kv(3))
            assert (await rt.fetch("b", PROMPT, cache_salt="tenant-2")).num_cached_tokens == 0
            assert (await rt.fetch("c", PROMPT)).num_cached_tokens == 0
            assert (await rt.fetch("d", PROMPT, cache_salt="tenant-1")).num_cached_tokens == 3 * BS
            for request_id in "abcd":
                await rt.release(request_id)
            await assert_clean(rt)

    async def test_image_order_matters(self):
        """[A, B] and [B, A] with the same tokens share nothing."""
        a, b = b"image-a", b"image-b"
        async with runtime() as rt:
            await rt.fetch("ab", PROMPT, images=[a, b])
            await rt.store("ab", PROMPT, kv(3))
            assert (await rt.fetch("ba", PROMPT, images=[b, a])).num_cached_tokens == 0
            assert (await rt.fetch("ab2", PROMPT, images=[a, b])).num_cached_tokens == 3 * BS
            for request_id in ("ab", "ba", "ab2"):
                await rt.release(request_id)
            await assert_clean(rt)

    async def test_images_from_their_first_token(self):
        """With ``images_start``, the blocks before the one holding the first image
        token are shared across images (and with text); those from it on are not."""
        a, b = b"image-a", b"image-b"
        async with runtime() as rt:
            await rt.fetch("a", PROMPT, images=[a], images_start=2 * BS + 1)
            await rt.store("a", PROMPT, kv(3))
            other = await rt.fetch("b", PROMPT, images=[b], images_start=2 * BS + 1)
            text = await rt.fetch("t", PROMPT)
            same = await rt.fetch("a2", PROMPT, images=[a], images_start=2 * BS + 1)
            whole = await rt.fetch("w", PROMPT, images=[b])
            assert (other.num_cached_tokens, text.num_cached_tokens) == (2 * BS, 2 * BS)
            assert (same.num_cached_tokens, whole.num_cached_tokens) == (3 * BS, 0)
            for request_id in ("a", "b", "t", "a2", "w"):
                await rt.release(request_id)
            for bad, reason in [(True, "int"), (len(PROMPT), "index"), (-1, "index")]:
                with pytest.raises(InvalidInput, match=reason):
                    await rt.fetch("x", PROMPT, images=[a], images_start=bad)
            with pytest.raises(InvalidInput, match="without images"):
                await rt.fetch("x", PROMPT, images_start=0)
            await assert_clean(rt)

    async def test_image_embeddings_are_cached(self, tmp_path):
        """Vision embeddings stored for images (files read off the loop) come back with fetch."""
        picture = tmp_path / "cat.png"
        picture.write_bytes(b"not really a png")
        embeddings = mx.ones((4, 8))
        async with runtime() as rt:
            assert (await rt.fetch("r1", PROMPT, images=[str(picture)])).vision_embeddings is None
            await rt.store_images([picture], embeddings, num_image_tokens=4)
            hit = await rt.fetch("r2", PROMPT, images=[str(picture)])
            assert mx.array_equal(hit.vision_embeddings, embeddings).item()
            same = await rt.fetch("r3", PROMPT, images=[picture.read_bytes()])
            assert same.vision_embeddings is not None  # a file keys as its bytes
            for request_id in ("r1", "r2", "r3"):
                await rt.release(request_id)
            await assert_clean(rt)

    async def test_unreadable_image_sources_are_keyed_by_string(self):
        """A URL, a video spec or a missing path keys blocks and embeddings by its string."""
        sources = ["https://images.invalid/a.png", "video:/v.mp4:fps1.0:max8", "/no/such/file.png"]
        async with runtime() as rt:
            await rt.fetch("a", PROMPT, images=sources)
            await rt.store("a", PROMPT, kv(3))
            await rt.store_images(sources, mx.ones((2, 4)), num_image_tokens=2)
            hit = await rt.fetch("b", PROMPT, images=sources)
            assert hit.num_cached_tokens == 3 * BS and hit.vision_embeddings is not None
            other = await rt.fetch("c", PROMPT, images=["/no/such/other.png"])
            assert other.num_cached_tokens == 0 and other.vision_embeddings is None
            for request_id in "abc":
                await rt.release(request_id)
            await assert_clean(rt)

    async def test_tiny_pool_evicts_and_refuses(self):
        """With few blocks, old prefixes are evicted (a miss, never a wrong block) and a
        store that cannot fit is refused whole."""
        async with runtime(max_blocks=4) as rt:  # 4 usable blocks (the null block on top)
            await rt.fetch("a", PROMPT)
            await rt.store("a", PROMPT, kv(3))
            await rt.release("a")
            other = [500 + t for t in PROMPT]
            await rt.fetch("b", other)
            await rt.store("b", other, kv(3))  # evicts a's last 2 blocks (released tail first)
            again = await rt.fetch("c", PROMPT)
            assert again.num_cached_tokens == BS  # a's first block survives: a shorter hit
            with pytest.raises(OutOfBlocks) as caught:
                await rt.store("c", PROMPT, kv(2))
            # b holds 3 blocks and c holds 1: 2 fresh needed, none free
            assert (caught.value.requested, caught.value.available) == (2, 0)
            stats = await rt.stats()
            assert stats.allocator.num_evictions >= 2 and stats.allocator.num_referenced == 4
            await rt.release("b")
            await rt.release("c")
            assert await rt.evict(10) >= 1
            await assert_clean(rt)


class TestStatistics:
    """What ``stats()`` counts and how its summary reads."""

    async def test_the_pool_holds_max_blocks_usable_blocks(self):
        """``max_blocks=8`` is 8 blocks of KV: 8 store, a 9th does not fit."""
        prompt = list(range(1, 9 * BS + 1))
        async with runtime(max_blocks=8) as rt:
            assert (await rt.stats()).allocator.num_blocks == 8
            await rt.fetch("r1", prompt[: 8 * BS])
            await rt.store("r1", prompt[: 8 * BS], kv(8))
            with pytest.raises(OutOfBlocks, match="asked for 1 block, only 0 available"):
                await rt.store("r1", prompt, kv(1))
            await rt.release("r1")
            await assert_clean(rt)

    async def test_held_cached_and_empty_blocks_add_up(self):
        """Every block is held by requests, cached (unreferenced, reusable) or empty,
        and the summary says which, without counting a cached block as free."""
        async with runtime(max_blocks=8) as rt:
            await rt.fetch("r1", PROMPT)
            await rt.store("r1", PROMPT, kv(3))
            other = [100 + t for t in PROMPT]
            await rt.fetch("r2", other)
            await rt.store("r2", other, kv(3))
            await rt.release("r1")
            pool = (await rt.stats()).allocator
            assert (pool.num_referenced, pool.num_reusable, pool.num_empty) == (3, 3, 2)
            assert pool.num_free == pool.num_reusable + pool.num_empty
            assert str(await rt.stats()).splitlines()[0] == (
                "blocks         8 x 4 tokens: 3 held by requests, 3 cached (reusable), 2 empty"
            )
            await rt.release("r2")

    async def test_the_traffic_line_says_what_each_count_is(self):
        """A hit is a block a fetch took from the cache; a store of a block that is
        cached already counts as found stored, not as a new block."""
        async with runtime() as rt:
            await rt.fetch("r1", PROMPT)
            await rt.store("r1", PROMPT, kv(3))
            await rt.fetch("r2", PROMPT[: BS - 1])  # no full block to take: a miss
            await rt.store("r2", PROMPT, kv(3))  # r1 stored them: found, shared
            await rt.fetch("r3", PROMPT)  # takes r1's three blocks
            stats = await rt.stats()
            assert (stats.allocator.num_hits, stats.allocator.num_stored, stats.allocator.num_reused) == (3, 3, 3)
            lines = dict(line.split("  ", 1) for line in str(stats).splitlines())
            assert lines["block traffic"].strip() == (
                "3 taken from the cache, 3 stored new, 3 found stored already, 0 evicted"
            )
            assert lines["lookups"].strip() == "3 (1 hit, 2 missed), 3 requests open"
            for request in ("r1", "r2", "r3"):
                await rt.release(request)

    async def test_no_summary_line_ends_in_a_space(self):
        """Summary lines are aligned, not padded at their end."""
        async with runtime() as rt:
            assert all(line == line.rstrip() for line in str(await rt.stats()).splitlines())


class TestFork:
    async def test_fork_shares_blocks_and_tokens(self):
        """The fork holds the source's blocks and continues from its tokens."""
        async with runtime() as rt:
            await rt.fetch("src", PROMPT)
            await rt.store("src", PROMPT, kv(3))
            forked = await rt.fork("src", "dst")
            assert forked.block_ids == (await rt.fetch("probe", PROMPT)).block_ids
            assert forked.remaining == (PROMPT[-1],)
            await rt.release("src")
            longer = PROMPT + [1, 2, 3]
            assert (await rt.store("dst", longer, kv(1))).num_held_blocks == 4
            for request_id in ("dst", "probe"):
                await rt.release(request_id)
            await assert_clean(rt)

    async def test_fork_errors(self):
        """Forking an unknown source or onto an active id changes nothing."""
        async with runtime() as rt:
            await rt.fetch("a", PROMPT)
            await rt.store("a", PROMPT, kv(3))
            await rt.fetch("b", PROMPT)
            with pytest.raises(UnknownRequest):
                await rt.fork("nobody", "c")
            with pytest.raises(DuplicateRequest):
                await rt.fork("a", "b")
            assert await rt.check_invariants()
            await rt.release("a")
            await rt.release("b")
            await assert_clean(rt)


class TestRequestScope:
    async def test_released_on_normal_exit(self):
        """Leaving the block releases everything the request held."""
        async with runtime() as rt:
            async with rt.request("r1", PROMPT) as req:
                await req.store(PROMPT, kv(3))
                fork = await req.fork("r2")
                assert fork.num_cached_tokens == 3 * BS
            await rt.release("r2")
            await assert_clean(rt)

    async def test_released_on_error(self):
        """An exception in the block still releases the request."""
        async with runtime() as rt:
            with pytest.raises(ZeroDivisionError):
                async with rt.request("r1", PROMPT) as req:
                    await req.store(PROMPT, kv(3))
                    1 / 0
            await assert_clean(rt)

    async def test_released_on_cancellation(self):
        """A cancelled block still releases the request (shielded)."""
        async with runtime() as rt:
            with anyio.CancelScope() as scope:
                async with rt.request("r1", PROMPT) as req:
                    await req.store(PROMPT, kv(3))
                    scope.cancel()
                    await anyio.sleep_forever()
            await assert_clean(rt)

    async def test_explicit_release_inside_is_fine(self):
        """Releasing inside the block leaves nothing for the exit to do."""
        async with runtime() as rt:
            async with rt.request("r1", PROMPT):
                await rt.release("r1")
            await assert_clean(rt)


class TestBadInput:
    @pytest.mark.parametrize(
        "call",
        [
            lambda rt: rt.fetch("", PROMPT),
            lambda rt: rt.fetch(7, PROMPT),
            lambda rt: rt.fetch("x", "hello"),
            lambda rt: rt.fetch("x", [1, -2]),
            lambda rt: rt.fetch("x", [1.5]),
            lambda rt: rt.fetch("x", [2**32]),
            lambda rt: rt.fetch("x", PROMPT, cache_salt=5),
            lambda rt: rt.fetch("x", PROMPT, images="cat.png"),
            lambda rt: rt.fetch("x", PROMPT, images=[object()]),
            lambda rt: rt.store("held", PROMPT, kv(1)),
            lambda rt: rt.store("held", PROMPT, "payloads"),
            lambda rt: rt.store("held", [9] + PROMPT[1:], kv(3)),
            lambda rt: rt.store("held", PROMPT[:2], []),
            lambda rt: rt.fork("held", ""),
            lambda rt: rt.release(None),
            lambda rt: rt.evict(-1),
            lambda rt: rt.store_images([], mx.ones((1,))),
            lambda rt: rt.store_images([b"a"], mx.ones((1,)), num_image_tokens=-3),
        ],
    )
    async def test_bad_input_changes_nothing(self, call):
        """A bad argument is InvalidInput and leaves every statistic as it was."""
        async with runtime() as rt:
            await rt.fetch("held", PROMPT[:BS])
            await rt.store("held", PROMPT[:BS], kv(1))
            before = await rt.stats()
            with pytest.raises(InvalidInput):
                await call(rt)
            after = await rt.stats()
            assert (after.allocator, after.index, after.images) == (
                before.allocator,
                before.index,
                before.images,
            )
            assert await rt.check_invariants()
            await rt.release("held")

    async def test_unknown_and_duplicate_requests(self):
        """Unknown and duplicate request ids are typed errors."""
        async with runtime() as rt:
            with pytest.raises(UnknownRequest):
                await rt.release("nobody")
            with pytest.raises(UnknownRequest):
                await rt.store("nobody", PROMPT, kv(3))
            await rt.fetch("r1", PROMPT)
            with pytest.raises(DuplicateRequest):
                await rt.fetch("r1", PROMPT)
            await rt.release("r1")
            await assert_clean(rt)
