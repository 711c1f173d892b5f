"""The image cache actor: vision embeddings per (salt, ordered images)."""

from __future__ import annotations


import mlx.core as mx
import pytest

from mlxkv.actors.image_cache import ImageCacheActor, ImageCacheHandle
from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.mllm import images_digest

AB = images_digest([b"image-a", b"image-b"])
BA = images_digest([b"image-b", b"image-a"])


class TestImageCache:
    async def test_stored_embeddings_are_found(self, running):
        """A lookup after a store returns a copy of the embeddings and the token count."""
        embeddings = mx.ones((3, 8))
        async with running(ImageCacheActor()) as ref:
            handle = ImageCacheHandle(ref)
            assert await handle.lookup(AB) is None
            await handle.store(AB, embeddings, num_image_tokens=3)
            entry = await handle.lookup(AB)
            stats = await handle.statistics()
        assert entry is not None and entry.num_image_tokens == 3
        assert mx.array_equal(entry.vision_embeddings, embeddings).item()
        assert (stats.num_entries, stats.num_hits, stats.num_misses) == (1, 1, 1)
        assert stats.num_bytes == embeddings.nbytes

    async def test_order_and_salt_separate_entries(self, running):
        """[A, B] is not [B, A], and another tenant's salt sees nothing."""
        async with running(ImageCacheActor()) as ref:
            handle = ImageCacheHandle(ref)
            await handle.store(AB, mx.ones((1,)), cache_salt="tenant-1")
            assert await handle.lookup(BA, cache_salt="tenant-1") is None
            assert await handle.lookup(AB, cache_salt="tenant-2") is None
            assert await handle.lookup(AB) is None
            assert await handle.lookup(AB, cache_salt="tenant-1") is not None

    async def test_memory_budget_evicts_lru(self, running):
        """Entries beyond the byte budget evict the least recently used."""
        async with running(ImageCacheActor(max_bytes=1000)) as ref:
            handle = ImageCacheHandle(ref)
            await handle.store(AB, mx.ones((100,)))  # 400 bytes
            await handle.store(BA, mx.ones((200,)))  # 800 bytes: AB must go
            assert await handle.lookup(AB) is None
            stats = await handle.statistics()
            assert await handle.check_invariants() == ()
        assert (stats.num_entries, stats.num_evictions) == (1, 1)

    async def test_bad_input_changes_nothing(self, running):
        """A malformed key, salt or count is refused before anything is stored."""
        async with running(ImageCacheActor()) as ref:
            handle = ImageCacheHandle(ref)
            with pytest.raises(InvalidInput, match="images_key"):
                await handle.store("abc", mx.ones((1,)))
            with pytest.raises(InvalidInput, match="num_image_tokens"):
                await handle.store(AB, mx.ones((1,)), num_image_tokens=-1)
            with pytest.raises(InvalidInput, match="cache_salt"):
                await handle.store(AB, mx.ones((1,)), cache_salt=3)  # type: ignore[arg-type]
            assert (await handle.statistics()).num_entries == 0

    async def test_broken_invariants_are_reported(self, running):
        """CheckInvariants replies with the manager's violation, naming the actor."""
        actor = ImageCacheActor()
        async with running(actor) as ref:
            handle = ImageCacheHandle(ref)
            await handle.store(AB, mx.ones((4,)))
            assert await handle.check_invariants() == ()
            actor._cache._current_memory += 1
            (violation,) = await handle.check_invariants()
        assert violation.startswith("image_cache: byte count")

    def test_violations_are_reported_under_python_o(self, run_optimized):
        """With asserts stripped (python -O) the actor still reports a broken invariant."""
        script = (
            "import anyio\n"
            "import mlx.core as mx\n"
            "from mlxkv.actors.image_cache import ImageCacheActor, ImageCacheHandle\n"
            "from mlxkv.cache.mllm import images_digest\n"
            "assert False, 'asserts must be stripped'\n"
            "async def main():\n"
            "    actor = ImageCacheActor()\n"
            "    async with anyio.create_task_group() as tg:\n"
            "        ref = actor.ref()\n"
            "        actor.close()\n"
            "        await tg.start(actor.run)\n"
            "        handle = ImageCacheHandle(ref)\n"
            "        await handle.store(images_digest([b'a']), mx.ones((4,)))\n"
            "        actor._cache._by_images.clear()\n"
            "        print(await handle.check_invariants())\n"
            "        ref.close()\n"
            "anyio.run(main)\n"
        )
        done = run_optimized(script)
        assert "image_cache: image index out of step" in done.stdout
