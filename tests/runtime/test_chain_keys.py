"""The seed API and the runtime key a prompt's blocks alike: one derivation of chain keys."""

from __future__ import annotations

import anyio
import numpy as np
from budget import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxkv import CacheRuntime
from mlxkv.cache.block_hash import ChainKeys, hash_block_chain
from mlxkv.cache.paged import PagedCacheManager
from mlxkv.cache.prefix import BlockAwarePrefixCache

BS = 4

#: Image sources both APIs key alike: a URL or another string, bytes that are
#: not an image file, an array that is not a uint8 picture. (A picture keys by
#: its pixels in the runtime and by its bytes in the seed API: see
#: docs/architecture.md, "Image keys".)
sources = st.one_of(
    st.sampled_from(["https://example.com/a.png", "video:clip.mp4:fps2:max8", "img-1", "img-2"]),
    st.binary(min_size=1, max_size=24).map(lambda data: b"\0not an image" + data),
    st.lists(st.floats(-4, 4, width=32), min_size=1, max_size=6).map(
        lambda values: np.array(values, dtype=np.float32)
    ),
)


@st.composite
def prompts(draw):
    """Tokens (at least one full block), a salt, images and where they start."""
    tokens = draw(st.lists(st.integers(0, 2**32 - 1), min_size=BS, max_size=6 * BS))
    salt = draw(st.none() | st.sampled_from(["tenant-a", "tenant-b", ""]))
    images = draw(st.none() | st.lists(sources, min_size=1, max_size=3))
    start = None
    if images is not None:
        start = draw(st.none() | st.integers(0, len(tokens) - 1))
    return tokens, salt, images, start


def seed_hashes(tokens, salt, images, start) -> list[bytes]:
    """The chain hashes BlockAwarePrefixCache stores the prompt's full blocks under."""
    paged = PagedCacheManager(block_size=BS, max_blocks=64)
    cache = BlockAwarePrefixCache(model=None, paged_cache_manager=paged)
    table = cache.store_cache(
        "seed", tokens, ["opaque"], cache_salt=salt, images=images, images_start=start
    )
    assert table is not None
    full = len(tokens) // BS
    return [paged.blocks[ident].block_hash for ident in table.block_ids[:full]]


async def runtime_hashes(tokens, salt, images, start) -> list[bytes]:
    """The chain hashes the runtime stores the prompt's full blocks under, read
    back by a second request that fetches the same prompt."""
    full = len(tokens) // BS
    async with CacheRuntime(block_size=BS, max_blocks=64) as rt:
        async with rt.request("writer", tokens, images=images, images_start=start, cache_salt=salt) as writer:
            await writer.store(tokens, [f"kv{i}" for i in range(full)])
            async with rt.request(
                "reader", tokens, images=images, images_start=start, cache_salt=salt
            ) as reader:
                assert reader.result is not None and len(reader.result.grants) == full
                return [grant.block_hash for grant in reader.result.grants]


class TestChainKeysAgree:
    @settings(
        max_examples=examples(40),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(prompt=prompts())
    def test_seed_api_and_runtime_derive_the_same_chain(self, prompt):
        """For any tokens, salt, images and first image token, BlockAwarePrefixCache and
        rt.fetch/rt.store key every full block with the same chain hash."""
        tokens, salt, images, start = prompt
        seed = seed_hashes(tokens, salt, images, start)
        assert seed == anyio.run(runtime_hashes, tokens, salt, images, start)
        # The plain chain exactly when no key reaches a full block.
        keyed = salt is not None or (
            images is not None and (start is None or start // BS < len(tokens) // BS)
        )
        assert (seed == hash_block_chain(tokens, BS)) == (not keyed)

    def test_images_enter_at_the_block_of_their_first_token(self):
        """Images starting in block 2 leave blocks 0-1 keyed by the salt alone, in both APIs."""
        tokens = list(range(6 * BS))
        images = ["img-1"]
        seed = seed_hashes(tokens, "t", images, 2 * BS + 1)
        salted = seed_hashes(tokens, "t", None, None)
        assert seed[:2] == salted[:2] and seed[2:] != salted[2:]
        assert seed == anyio.run(runtime_hashes, tokens, "t", images, 2 * BS + 1)

    def test_one_spelling_of_the_salt(self):
        """The salt is keyed once, as ChainKeys spells it, whatever API names it."""
        keys = ChainKeys.derive(cache_salt="t")
        tokens = list(range(2 * BS))
        assert seed_hashes(tokens, "t", None, None) == keys.hash_chain(tokens, BS)
        assert keys.first == (("salt", "t"),)
