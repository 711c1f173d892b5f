"""BlockAwarePrefixCache: seed-compatible block-level prefix caching over the paged manager."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest
from budget import examples
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from mlxkv.cache import kv_state
from mlxkv.cache.block_prefix import BlockAwarePrefixCache, BlockCacheEntry, OpaquePayload
from mlxkv.cache.paged import BlockTable, PagedCacheManager

from device_arithmetic import LOGITS_ATOL

BLOCK = 16
HEADS, DIM = 2, 8
SYSTEM = list(range(100, 148))  # three full blocks
LOGGER = "mlxkv.cache.block_prefix"

SEED_STATS_KEYS = {
    "hits",
    "misses",
    "hit_rate",
    "tokens_saved",
    "active_requests",
    "block_size",
    "max_blocks",
    "allocated_blocks",
    "free_blocks",
    "shared_blocks",
    "total_tokens_cached",
    "utilization",
    "cache_hit_rate",
}


def kv(tokens, layers=2, as_dicts=False):
    """Synthetic per-layer KV whose value at position t encodes (layer, t, token)."""
    t = mx.array(tokens, dtype=mx.float32)[:, None]
    pos = mx.arange(len(tokens), dtype=mx.float32)[:, None]
    out = []
    for layer in range(layers):
        base = t + 1000 * pos + mx.arange(DIM, dtype=mx.float32)[None, :] / 10 + layer * 1e6
        keys = base[None, None] + mx.arange(HEADS, dtype=mx.float32)[None, :, None, None] / 4
        values = -keys
        if as_dicts:
            out.append({"state": (keys, values), "class_name": "KVCache"})
        else:
            cache = KVCache()
            cache.update_and_fetch(keys, values)
            out.append(cache)
    mx.eval([c["state"] if as_dicts else (c.keys, c.values) for c in out])
    return out


def keys_of(caches, layer=0):
    """A layer's keys, trimmed to its offset."""
    return caches[layer].keys[:, :, : caches[layer].offset]


@pytest.fixture
def paged():
    """A small paged manager: 64 blocks of 16 tokens."""
    return PagedCacheManager(block_size=BLOCK, max_blocks=64)


@pytest.fixture
def cache(paged):
    """A prefix cache over ``paged``, with no model attached."""
    return BlockAwarePrefixCache(None, paged)


def held_blocks(paged):
    """Ids of the blocks that are referenced, the null block aside."""
    return {b.block_id for b in paged.blocks if b.ref_count > 0 and not b.is_null}


class TestFetchCache:
    def test_miss(self, cache):
        """A prompt nobody stored misses: (None, tokens), counted once."""
        tokens = list(range(40))
        table, remaining = cache.fetch_cache("r", tokens)
        assert table is None and remaining == tokens
        assert cache.get_stats()["misses"] == 1 and len(cache) == 0

    def test_empty_tokens(self, cache):
        """Empty tokens return (None, tokens) without counting a query."""
        assert cache.fetch_cache("r", []) == (None, [])
        assert cache.get_stats()["misses"] == 0

    def test_shared_system_prompt(self, cache, paged):
        """B reuses the full blocks of A's system prompt and gets its own suffix back."""
        a_prompt = SYSTEM + list(range(10))
        b_prompt = SYSTEM + list(range(200, 220))
        a_table = cache.store_cache("a", a_prompt, kv(a_prompt))
        table, remaining = cache.fetch_cache("b", b_prompt)
        assert table.num_tokens == len(SYSTEM) and remaining == b_prompt[len(SYSTEM) :]
        assert table.block_ids == a_table.block_ids[:3]
        assert all(paged.blocks[i].ref_count == 2 for i in table.block_ids)
        stats = cache.get_stats()
        assert (stats["hits"], stats["misses"], stats["tokens_saved"]) == (1, 0, 48)
        assert stats["active_requests"] == 2
        cache.check_invariants()

    def test_partial_tail_never_shared(self, cache):
        """Only full blocks are found: a stored 40-token prompt serves 32 tokens."""
        prompt = list(range(40))
        cache.store_cache("a", prompt, kv(prompt))
        table, remaining = cache.fetch_cache("b", prompt + [7, 7])
        assert table.num_tokens == 32 and remaining == prompt[32:] + [7, 7]

    def test_whole_prompt_cached(self, cache):
        """When every token is cached the remaining tokens are empty."""
        cache.store_cache("a", SYSTEM, kv(SYSTEM))
        table, remaining = cache.fetch_cache("b", SYSTEM)
        assert table.num_tokens == len(SYSTEM) and remaining == []

    def test_position_matters(self, cache):
        """A block with equal content at another position is not a hit."""
        cache.store_cache("a", SYSTEM, kv(SYSTEM))
        shifted = SYSTEM[16:32] + SYSTEM[:16] + SYSTEM[32:]
        assert cache.fetch_cache("b", shifted)[0] is None

    def test_salts_do_not_share(self, cache, paged):
        """Blocks stored under one salt are invisible to other salts and to no salt."""
        a = cache.store_cache("a", SYSTEM, kv(SYSTEM), cache_salt="tenant-a")
        assert cache.fetch_cache("b", SYSTEM, cache_salt="tenant-b")[0] is None
        assert cache.fetch_cache("c", SYSTEM)[0] is None
        assert cache.fetch_cache("d", SYSTEM, extra_keys=("tenant-a",))[0] is None
        hit, _ = cache.fetch_cache("e", SYSTEM, cache_salt="tenant-a")
        assert hit.block_ids == a.block_ids
        other = cache.store_cache("f", SYSTEM, kv(SYSTEM), cache_salt="tenant-b")
        assert not set(other.block_ids) & set(a.block_ids)
        cache.check_invariants()

    def test_extra_keys_namespace(self, cache):
        """Extra keys (e.g. image hashes) must match for a hit."""
        cache.store_cache("a", SYSTEM, kv(SYSTEM), extra_keys=("img-1",))
        assert cache.fetch_cache("b", SYSTEM, extra_keys=("img-2",))[0] is None
        assert cache.fetch_cache("c", SYSTEM, extra_keys=("img-1",))[0].num_tokens == 48

    def test_images_namespace_from_their_first_token(self, cache):
        """Images key the blocks from the one holding their first token on: the text
        before is shared with any images, the rest only with the same ones in order."""
        cache.store_cache("a", SYSTEM, kv(SYSTEM), images=["img-1", "img-2"], images_start=20)
        hit, _ = cache.fetch_cache("b", SYSTEM, images=["img-2", "img-1"], images_start=20)
        assert hit.num_tokens == 16  # block 0 only: the image token is in block 1
        whole, _ = cache.fetch_cache("c", SYSTEM, images=["img-1", "img-2"], images_start=20)
        assert whole.num_tokens == 48
        assert cache.fetch_cache("d", SYSTEM, images=["img-1", "img-2"])[0] is None
        cache.check_invariants()

    @pytest.mark.parametrize("start", [-1, 48, 1.0])
    def test_images_start_must_index_a_token(self, cache, caplog, start):
        """An images_start that is no token index, or images_start without images, is logged and refused."""
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert cache.store_cache("a", SYSTEM, kv(SYSTEM), images=["i"], images_start=start) is None
            assert cache.fetch_cache("b", SYSTEM, images_start=3) == (None, SYSTEM)
        assert "images_start" in caplog.text

    def test_request_in_use(self, cache, caplog):
        """Fetching for a request that already holds blocks is logged and misses."""
        cache.store_cache("a", SYSTEM, kv(SYSTEM))
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert cache.fetch_cache("a", SYSTEM) == (None, SYSTEM)
        assert "already holds blocks" in caplog.text
        cache.check_invariants()

    def test_bad_token_ids(self, cache, paged):
        """Token ids outside [0, 2**32) are logged and treated as a miss."""
        assert cache.fetch_cache("r", [-1, 2]) == (None, [-1, 2])
        assert cache.store_cache("r", [-1] * 20, kv([1] * 20)) is None
        assert held_blocks(paged) == set()


class TestStoreCache:
    def test_blocks_and_tail(self, cache, paged):
        """A 40-token prompt gives two cached full blocks and one private tail."""
        prompt = list(range(40))
        table = cache.store_cache("a", prompt, kv(prompt))
        assert table.num_tokens == 40 and len(table) == 3
        blocks = [paged.blocks[i] for i in table.block_ids]
        assert [b.token_count for b in blocks] == [16, 16, 8]
        assert [b.block_hash is not None for b in blocks] == [True, True, False]
        assert all(isinstance(b.cache_data, kv_state.BlockPayload) for b in blocks)
        assert len(cache) == 1
        cache.check_invariants()

    def test_reuses_cached_blocks(self, cache, paged):
        """Storing a prompt whose full blocks are cached allocates only the new ones."""
        first = cache.store_cache("a", SYSTEM + [1, 2], kv(SYSTEM + [1, 2]))
        free = paged.free_blocks
        second = cache.store_cache("b", SYSTEM + [3] * 20, kv(SYSTEM + [3] * 20))
        assert second.block_ids[:3] == first.block_ids[:3]
        assert paged.free_blocks == free - 2  # one new full block, one tail
        cache.check_invariants()

    def test_fetch_then_store(self, cache, paged):
        """After a hit, store keeps the fetched blocks and adds only what follows."""
        cache.store_cache("a", SYSTEM, kv(SYSTEM))
        prompt = SYSTEM + list(range(500, 520))
        fetched, _ = cache.fetch_cache("b", prompt)
        fetched_ids = list(fetched.block_ids)
        table = cache.store_cache("b", prompt, kv(prompt))
        assert table is fetched and table.block_ids[:3] == fetched_ids
        assert table.num_tokens == len(prompt) and len(table) == 5
        rebuilt = cache.reconstruct_cache(table)
        assert mx.array_equal(keys_of(rebuilt), keys_of(kv(prompt))).item()
        cache.check_invariants()

    def test_extend_replaces_tail(self, cache, paged):
        """Storing more tokens for the same request replaces its partial tail."""
        prompt = list(range(60))
        table = cache.store_cache("a", prompt[:20], kv(prompt[:20]))
        tail_id = table.block_ids[-1]
        assert cache.store_cache("a", prompt, kv(prompt)) is table
        assert table.num_tokens == 60 and len(table) == 4
        assert tail_id not in table.block_ids
        assert paged.blocks[tail_id].ref_count == 0 and paged.blocks[tail_id].cache_data is None
        assert mx.array_equal(keys_of(cache.reconstruct_cache(table)), keys_of(kv(prompt))).item()
        cache.check_invariants()

    def test_nothing_new(self, cache):
        """Storing no more tokens than the request holds returns its table unchanged."""
        table = cache.store_cache("a", SYSTEM, kv(SYSTEM))
        ids = list(table.block_ids)
        assert cache.store_cache("a", SYSTEM[:20], kv(SYSTEM[:20])) is table
        assert table.block_ids == ids

    def test_other_tokens_refused(self, cache, caplog):
        """A request cannot store tokens that contradict the blocks it holds."""
        table = cache.store_cache("a", SYSTEM, kv(SYSTEM))
        other = list(range(64))
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert cache.store_cache("a", other, kv(other)) is None
            assert cache.store_cache("a", SYSTEM + [1], kv(SYSTEM + [1]), cache_salt="x") is None
        assert table.num_tokens == 48
        tail = cache.store_cache("t", list(range(20)), kv(list(range(20))))
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert cache.store_cache("t", list(range(18)) + [0, 0], kv([0] * 20)) is None
        assert tail.num_tokens == 20
        cache.check_invariants()

    def test_cache_shorter_than_tokens(self, cache):
        """Only the tokens the cache holds are stored."""
        prompt = list(range(41))
        table = cache.store_cache("a", prompt, kv(prompt[:40]))
        assert table.num_tokens == 40

    def test_seed_dicts_accepted(self, cache):
        """Seed-style {'state': (keys, values)} dicts store the same blocks as cache objects."""
        cache.store_cache("a", SYSTEM, kv(SYSTEM, as_dicts=True))
        table, _ = cache.fetch_cache("b", SYSTEM + [1])
        assert mx.array_equal(keys_of(cache.reconstruct_cache(table)), keys_of(kv(SYSTEM))).item()

    def test_out_of_blocks(self, caplog):
        """With too few blocks, the leading blocks that fit are stored."""
        paged = PagedCacheManager(block_size=BLOCK, max_blocks=3)
        cache = BlockAwarePrefixCache(None, paged)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            table = cache.store_cache("a", SYSTEM, kv(SYSTEM))
        assert table.num_tokens == 32 and "out of blocks" in caplog.text
        assert cache.store_cache("b", list(range(20)), kv(list(range(20)))) is None
        cache.check_invariants()


class TestEviction:
    def test_evicted_block_shortens_fetch(self, cache, paged):
        """Evicting the deepest cached block makes the next hit one block shorter, never wrong."""
        prompt = SYSTEM + list(range(16))
        cache.store_cache("a", prompt, kv(prompt))
        cache.release_cache("a")
        assert paged.pool.evict(1) == 1
        table, remaining = cache.fetch_cache("b", prompt + [1])
        assert table.num_tokens == 48 and remaining == prompt[48:] + [1]
        rebuilt = cache.reconstruct_cache(table)
        assert mx.array_equal(keys_of(rebuilt), keys_of(kv(prompt))[:, :, :48]).item()

    def test_eviction_by_allocation(self, cache, paged):
        """Allocation evicts the deepest cached blocks first; what is left still matches."""
        cache.store_cache("a", SYSTEM, kv(SYSTEM))
        cache.release_cache("a")
        filler = list(range(1000, 1000 + 16 * 62))  # all free blocks but one
        cache.store_cache("f", filler, kv(filler))
        table, _ = cache.fetch_cache("b", SYSTEM + [1])
        assert table.num_tokens == 16
        rebuilt = cache.reconstruct_cache(table)
        assert mx.array_equal(keys_of(rebuilt), keys_of(kv(SYSTEM))[:, :, :16]).item()
        cache.release_cache("b")
        cache.store_cache("g", [1] * 16, kv([1] * 16))  # takes the last one
        assert cache.fetch_cache("c", SYSTEM + [1])[0] is None
        cache.check_invariants()


    def test_eviction_frees_memory(self, cache, paged):
        """Once the source cache is dropped and the blocks evicted, their memory is freed."""
        import gc

        prompt = list(range(1000))
        source = kv(prompt)
        stored = sum(c.keys[:, :, :1000].nbytes + c.values[:, :, :1000].nbytes for c in source)
        cache.store_cache("a", prompt, source)
        cache.release_cache("a")
        del source
        gc.collect()
        before = mx.get_active_memory()
        assert paged.evict_lru_blocks(paged.max_blocks) == paged.free_blocks == 63
        gc.collect()
        assert before - mx.get_active_memory() >= stored * 62 * 16 / 1000


class TestReleaseCache:
    def test_every_reference_returned(self, cache, paged):
        """After stores, fetches, forks and copy-on-write, releasing all leaves no reference."""
        cache.store_cache("a", SYSTEM + [1, 2], kv(SYSTEM + [1, 2]))
        cache.fetch_cache("b", SYSTEM + [9])
        cache.fork_cache("b", "c")
        cache.get_cache_for_generation("c")
        cache.store_cache("d", SYSTEM + [5] * 30, kv(SYSTEM + [5] * 30))
        cache.check_invariants()
        for request_id in "abcd":
            cache.release_cache(request_id)
        cache.check_invariants()
        assert held_blocks(paged) == set() and paged.request_tables == {} and len(cache) == 0
        assert paged.free_blocks == paged.max_blocks - 1
        assert cache.fetch_cache("e", SYSTEM + [1])[0].num_tokens == 48

    def test_private_payload_dropped(self, cache, paged):
        """A released request's unhashed tail block keeps no KV state."""
        table = cache.store_cache("a", SYSTEM + [1, 2], kv(SYSTEM + [1, 2]))
        tail = paged.blocks[table.block_ids[-1]]
        cache.release_cache("a")
        assert tail.cache_data is None
        assert paged.blocks[table.block_ids[0]].cache_data is not None  # still cached

    def test_unknown_and_double_release(self, cache, paged, caplog):
        """Releasing an unknown or already released request is a logged no-op."""
        cache.store_cache("a", SYSTEM, kv(SYSTEM))
        cache.release_cache("a")
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            cache.release_cache("a")
            cache.release_cache("never-seen")
        assert caplog.text.count("unknown request") == 2
        cache.check_invariants()
        assert held_blocks(paged) == set()


class TestForkCache:
    def test_fork_shares_blocks(self, cache, paged):
        """A fork lists the same blocks, each with one more reference."""
        source = cache.store_cache("a", SYSTEM + [1], kv(SYSTEM + [1]))
        forked = cache.fork_cache("a", "b")
        assert forked.block_ids == source.block_ids and forked.request_id == "b"
        assert all(paged.blocks[i].ref_count == 2 for i in forked.block_ids)
        assert mx.array_equal(
            keys_of(cache.reconstruct_cache(forked)), keys_of(kv(SYSTEM + [1]))
        ).item()
        cache.check_invariants()

    def test_fork_failures(self, cache, caplog):
        """Forking an unknown request, or onto a busy id, returns None and is logged."""
        cache.store_cache("a", SYSTEM, kv(SYSTEM))
        cache.store_cache("b", SYSTEM, kv(SYSTEM))
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert cache.fork_cache("nope", "c") is None
            assert cache.fork_cache("a", "b") is None
        assert len(caplog.records) == 2
        cache.check_invariants()


class TestGetCacheForGeneration:
    def test_unknown(self, cache):
        """An unknown request gets (None, False)."""
        assert cache.get_cache_for_generation("nope") == (None, False)

    def test_copy_on_write(self, cache, paged):
        """Shared blocks are replaced by real private copies before generation."""
        cache.store_cache("a", SYSTEM, kv(SYSTEM))
        table, _ = cache.fetch_cache("b", SYSTEM + [1])
        shared = list(table.block_ids)
        caches, copied = cache.get_cache_for_generation("b")
        assert copied and not set(table.block_ids) & set(shared)
        for old, new in zip(shared, table.block_ids):
            before = paged.blocks[old].cache_data.arrays[0][0]
            after = paged.blocks[new].cache_data.arrays[0][0]
            assert after is not before and mx.array_equal(after, before).item()
            assert paged.blocks[old].ref_count == 1
        assert caches[0].offset == 48
        assert mx.array_equal(keys_of(caches), keys_of(kv(SYSTEM))).item()
        cache.check_invariants()

    def test_private_blocks_not_copied(self, cache):
        """A request that shares nothing gets its cache without copies."""
        cache.store_cache("a", SYSTEM + [1], kv(SYSTEM + [1]))
        caches, copied = cache.get_cache_for_generation("a", extra_tokens=300)
        assert not copied and caches[0].offset == 49
        assert caches[0].keys.shape[2] == kv_state.capacity_for(49, 300)


class TestReconstructCache:
    def test_room_for_suffix(self, cache):
        """The rebuilt buffers have room for the fetched request's remaining tokens."""
        cache.store_cache("a", SYSTEM, kv(SYSTEM))
        table, remaining = cache.fetch_cache("b", SYSTEM + list(range(300)))
        caches = cache.reconstruct_cache(table)
        assert caches[0].offset == 48
        assert caches[0].keys.shape[2] == kv_state.capacity_for(48, len(remaining)) == 512
        assert cache.reconstruct_cache(table, extra_tokens=0)[0].keys.shape[2] == 256

    def test_empty_and_foreign_tables(self, cache, paged, caplog):
        """An empty table gives None; a table no one holds is refused; data-less blocks are not
        rebuilt."""
        assert cache.reconstruct_cache(None) is None
        table = paged.create_block_table("elsewhere")
        assert cache.reconstruct_cache(table) is None
        (block,) = paged.pool.allocate(1)
        table.add_block(block.block_id, 16)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert cache.reconstruct_cache(table) is None
        assert "cannot rebuild 'elsewhere'" in caplog.text
        caplog.clear()
        stored = cache.store_cache("a", SYSTEM, kv(SYSTEM))
        unrelated = BlockTable("a", [stored.block_ids[1], stored.block_ids[0]], 32)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert cache.reconstruct_cache(unrelated) is None
            assert cache.reconstruct_cache(BlockTable("x", [block.block_id, 5])) is None
        assert caplog.text.count("not held") == 2
        cache.check_invariants()

    def test_leading_part_of_a_table(self, cache):
        """A table built from the first ids of a stored table rebuilds exactly those blocks."""
        prompt = SYSTEM + list(range(9))
        table = cache.store_cache("a", prompt, kv(prompt))
        for count in (1, 2, 3):
            part = BlockTable("a", table.block_ids[:count])
            rebuilt = cache.reconstruct_cache(part)
            expected = keys_of(kv(prompt))[:, :, : count * BLOCK]
            assert rebuilt[0].offset == count * BLOCK
            assert mx.array_equal(keys_of(rebuilt), expected).item()
        other = cache.reconstruct_cache(BlockTable("someone-else", table.block_ids[:2], 32))
        assert mx.array_equal(keys_of(other), keys_of(kv(prompt))[:, :, :32]).item()

    def test_leading_part_of_3d_seed_dicts(self, cache):
        """3-D (heads, tokens, dim) seed dicts: a hand-built leading table rebuilds its prefix."""
        prompt = SYSTEM + list(range(9))
        three_d = [
            {"state": (layer["state"][0][0], layer["state"][1][0]), "class_name": "KVCache"}
            for layer in kv(prompt, as_dicts=True)
        ]
        assert three_d[0]["state"][0].ndim == 3
        table = cache.store_cache("a", prompt, three_d)
        part = BlockTable("a", table.block_ids[:2])
        rebuilt = cache.reconstruct_cache(part, extra_tokens=0)
        assert rebuilt[1].offset == 32 and rebuilt[1].keys.shape[2] == kv_state.STEP
        for layer in (0, 1):
            expected = keys_of(kv(prompt), layer)[:, :, :32]
            assert mx.array_equal(keys_of(rebuilt, layer), expected).item()
        full = cache.reconstruct_cache(table)
        assert mx.array_equal(keys_of(full), keys_of(kv(prompt))).item()

    def test_hybrid_without_snapshot_refused(self, cache, hybrid_model, caplog):
        """Hybrid blocks without the recurrent snapshot are neither served nor rebuilt."""
        model = hybrid_model[0]
        prompt = [(i * 7) % 256 for i in range(40)]
        full = make_prompt_cache(model)
        mx.eval(model(mx.array([prompt]), cache=full))
        # The cache holds 40 tokens but only 32 are stored: no snapshot fits.
        table = cache.store_cache("a", prompt[:32], full)
        assert table.num_tokens == 32
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert cache.reconstruct_cache(table) is None
        assert "cannot rebuild" in caplog.text
        assert cache.fetch_cache("b", prompt)[0] is None


class TestStats:
    def test_seed_keys_and_reset(self, cache):
        """get_stats has the seed's keys; reset_stats zeroes the counters."""
        cache.store_cache("a", SYSTEM, kv(SYSTEM))
        cache.fetch_cache("b", SYSTEM + [1])
        cache.fetch_cache("c", list(range(30)))
        stats = cache.get_stats()
        assert set(stats) >= SEED_STATS_KEYS
        assert (stats["hits"], stats["misses"], stats["hit_rate"]) == (1, 1, 0.5)
        cache.reset_stats()
        stats = cache.get_stats()
        assert (stats["hits"], stats["misses"], stats["tokens_saved"], stats["hit_rate"]) == (
            0,
            0,
            0,
            0,
        )
        assert stats["active_requests"] == 2

    def test_clear(self, cache, paged):
        """clear forgets every request and every cached block."""
        cache.store_cache("a", SYSTEM, kv(SYSTEM))
        cache.clear()
        assert len(cache) == 0 and paged.request_tables == {}
        assert cache.fetch_cache("b", SYSTEM + [1])[0] is None
        cache.check_invariants()

    def test_entry_and_helpers(self, cache):
        """Entries expose the blocks' payloads; the seed's seq-axis helper is kept."""
        table = cache.store_cache("a", SYSTEM, kv(SYSTEM))
        entry = cache._request_tables["a"]
        assert isinstance(entry, BlockCacheEntry) and entry.block_table is table
        assert [p.start for p in entry.cache_data] == [0, 16, 32]
        keys = mx.zeros((1, 2, 3, 4))
        assert cache._cache_state_seq_axis((keys, keys)) == 2
        assert cache._cache_state_seq_axis((keys[0], keys[0])) == 1


def wrapped_rotating(tokens):
    """A one-layer RotatingKVCache that has wrapped: it cannot be sliced exactly."""
    layer = RotatingKVCache(max_size=8)
    for token in tokens:
        layer.update_and_fetch(
            mx.full((1, HEADS, 1, DIM), float(token)), mx.full((1, HEADS, 1, DIM), -float(token))
        )
    mx.eval(layer.keys, layer.values)
    return [layer]


PLACEHOLDERS = [
    pytest.param(None, id="none"),
    pytest.param([], id="empty-list"),
    pytest.param("placeholder", id="string"),
    pytest.param([None, None], id="none-per-layer"),
    pytest.param([object()], id="object"),
    pytest.param([{"state": (mx.zeros((1, 1, 4, 2)),)}], id="keys-without-values"),
    pytest.param([{"state": (mx.zeros((2, 2)), mx.zeros((2, 2)))}], id="2d-arrays"),
    pytest.param([KVCache(), KVCache()], id="empty-caches"),
]


class TestOpaqueCacheData:
    @pytest.mark.parametrize("data", PLACEHOLDERS)
    def test_bookkeeping_as_for_kv(self, cache, paged, data, caplog):
        """Data that cannot be sliced still gets blocks, hashes, a table, a count and hits."""
        prompt = SYSTEM + [1, 2]
        table = cache.store_cache("a", prompt, data)
        assert table.num_tokens == len(prompt) and len(table) == 4 and len(cache) == 1
        blocks = [paged.blocks[i] for i in table.block_ids]
        assert [b.token_count for b in blocks] == [16, 16, 16, 2]
        assert [b.block_hash is not None for b in blocks] == [True, True, True, False]
        assert [b.cache_data for b in blocks] == [
            OpaquePayload(start=0, num_tokens=16),
            OpaquePayload(start=16, num_tokens=16),
            OpaquePayload(start=32, num_tokens=16),
            OpaquePayload(start=48, num_tokens=2),
        ]
        hit, remaining = cache.fetch_cache("b", SYSTEM + [9])
        assert hit.block_ids == table.block_ids[:3] and remaining == [9]
        assert cache.get_stats()["hits"] == 1 and len(cache) == 2
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert cache.reconstruct_cache(hit) is None
            assert cache.reconstruct_cache(table) is None
        assert caplog.text.count("cannot rebuild") == 2
        cache.check_invariants()

    def test_generation_returns_the_stored_data(self, cache):
        """The storer gets its data back: the object itself, or a deep copy after copy-on-write."""
        data = [{"slot": 3}, ["placeholder"]]
        cache.store_cache("a", SYSTEM + [1], data)
        caches, copied = cache.get_cache_for_generation("a")
        assert caches is data and not copied
        cache.fetch_cache("b", SYSTEM + [2])
        caches, copied = cache.get_cache_for_generation("a")
        assert copied and caches == data and caches is not data and caches[0] is not data[0]
        assert cache.get_cache_for_generation("b") == (None, False)  # nothing stored by b
        cache.check_invariants()

    def test_fork_release_and_clear(self, cache, paged):
        """A fork shares the blocks and the data; releases give every reference back; clear
        forgets them."""
        data = ["placeholder"]
        source = cache.store_cache("a", SYSTEM + [1], data)
        forked = cache.fork_cache("a", "c")
        assert forked.block_ids == source.block_ids
        assert all(paged.blocks[i].ref_count == 2 for i in forked.block_ids)
        caches, copied = cache.get_cache_for_generation("c")
        assert copied and caches == data
        cache.release_cache("a")
        cache.release_cache("c")
        assert held_blocks(paged) == set() and len(cache) == 0
        assert cache.fetch_cache("d", SYSTEM)[0].num_tokens == 48
        cache.clear()
        assert len(cache) == 0 and cache.fetch_cache("e", SYSTEM)[0] is None
        cache.check_invariants()

    def test_caches_that_cannot_be_rebuilt_are_kept_whole(self, cache):
        """A wrapped sliding window is stored for bookkeeping, never sliced into wrong blocks."""
        prompt = list(range(40))
        data = wrapped_rotating(prompt)
        table = cache.store_cache("a", prompt, data)
        assert table.num_tokens == 40
        assert cache.reconstruct_cache(table) is None
        assert cache.get_cache_for_generation("a") == (data, False)

    def test_kv_runs_are_preferred_and_never_mixed(self, cache):
        """A hit is either rebuildable KV or opaque blocks, never a run mixing the two."""
        cache.store_cache("kv", SYSTEM, kv(SYSTEM))
        prompt = SYSTEM + list(range(300, 332))
        opaque = cache.store_cache("opaque", prompt, ["placeholder"])
        assert opaque.block_ids[:3] == cache._request_tables["kv"].block_table.block_ids
        table, _ = cache.fetch_cache("f", prompt + [1])
        assert table.num_tokens == 48
        assert mx.array_equal(keys_of(cache.reconstruct_cache(table)), keys_of(kv(SYSTEM))).item()
        cache.check_invariants()

    def test_kv_store_after_opaque_store(self, cache):
        """A request that stored opaque data and then KV state gets no cache it cannot rebuild."""
        cache.store_cache("a", SYSTEM[:32], ["placeholder"])
        cache.store_cache("a", SYSTEM + [1], kv(SYSTEM + [1]))
        entry = cache._request_tables["a"]
        assert not entry.opaque and entry.opaque_data is None
        assert cache.get_cache_for_generation("a") == (None, False)
        table, _ = cache.fetch_cache("b", SYSTEM + [2])
        assert table.num_tokens == 32  # the opaque run
        cache.check_invariants()


class TestBlockCacheDataShape:
    def test_payload_is_a_per_layer_sequence(self, cache, paged):
        """A stored block's cache_data has one entry per layer: that layer's (keys, values)."""
        table = cache.store_cache("a", SYSTEM, kv(SYSTEM, layers=3))
        expected = kv(SYSTEM, layers=3)
        for position, ident in enumerate(table.block_ids):
            data = paged.blocks[ident].cache_data
            assert len(data) == 3 and data
            for layer in range(3):
                keys, values = data[layer]
                assert keys.shape == (1, HEADS, BLOCK, DIM)
                assert mx.array_equal(keys, expected[layer].keys[:, :, span(position)]).item()
                assert mx.array_equal(values, expected[layer].values[:, :, span(position)]).item()

    def test_recurrent_layer_is_none_before_the_last_block(self, cache, paged, hybrid_model):
        """A hybrid's recurrent layer is None in every block but the one ending the cache."""
        model = hybrid_model[0]
        prompt = [(i * 7) % 256 for i in range(48)]
        full = make_prompt_cache(model)
        mx.eval(model(mx.array([prompt]), cache=full))
        table = cache.store_cache("a", prompt, full)
        recurrent = [i for i, layer in enumerate(full) if not isinstance(layer, KVCache)]
        assert recurrent
        payloads = [paged.blocks[i].cache_data for i in table.block_ids]
        assert len(payloads) == 3
        for layer in recurrent:
            assert [p[layer] is None for p in payloads] == [True, True, False]


def seed_written(paged, prompt, block_data):
    """Publish ``prompt``'s full blocks the vLLM way, each block's cache_data set by the caller.

    ``block_data(layers, i)`` gives block ``i``'s cache_data from the prompt's
    true per-layer KV. The blocks are freed afterwards: cached, not held.
    """
    count = len(prompt) // BLOCK
    blocks = paged.get_new_blocks(count)
    layers = kv(prompt)
    for i, block in enumerate(blocks):
        block.cache_data = block_data(layers, i)
    paged.cache_full_blocks(blocks, prompt, 0, count)
    paged.free_block_batch(blocks)
    return blocks


def span(i, stop=None):
    """The token slice of block ``i`` (or up to ``stop`` within it)."""
    return slice(i * BLOCK, i * BLOCK + (BLOCK if stop is None else stop))


EXACT = [
    pytest.param(
        lambda layers, i: [(c.keys[:, :, span(i)], c.values[:, :, span(i)]) for c in layers],
        id="4d-pairs",
    ),
    pytest.param(
        lambda layers, i: [(c.keys[0, :, span(i)], c.values[0, :, span(i)]) for c in layers],
        id="3d-pairs",
    ),
    pytest.param(
        lambda layers, i: [
            {"state": (c.keys[:, :, span(i)], c.values[:, :, span(i)])} for c in layers
        ],
        id="seed-dicts",
    ),
]

INEXACT = [
    pytest.param(lambda layers, i: None, id="no-data"),
    pytest.param(lambda layers, i: "kv", id="string"),
    pytest.param(
        lambda layers, i: [(c.keys[:, :, span(i, 8)], c.values[:, :, span(i, 8)]) for c in layers],
        id="too-few-tokens",
    ),
    pytest.param(
        lambda layers, i: [(layers[0].keys[:, :, span(i)], layers[0].values[:, :, span(i)]), None],
        id="layer-without-data",
    ),
    pytest.param(lambda layers, i: [(c.keys[:, :, span(i)],) for c in layers], id="keys-only"),
    pytest.param(
        lambda layers, i: [(c.keys[:, :, span(i)], c.values) for c in layers],
        id="values-of-the-whole-prompt",
    ),
]


class TestPagedApiPayloads:
    @pytest.mark.parametrize("block_data", EXACT)
    def test_exact_seed_format_is_served(self, cache, paged, block_data):
        """Blocks written as the seed declares cache_data are a hit that rebuilds exactly."""
        seed_written(paged, SYSTEM, block_data)
        table, remaining = cache.fetch_cache("b", SYSTEM + [1])
        assert table.num_tokens == 48 and remaining == [1]
        rebuilt = cache.reconstruct_cache(table)
        for layer in (0, 1):
            assert mx.array_equal(keys_of(rebuilt, layer), keys_of(kv(SYSTEM), layer)).item()
        caches, _ = cache.get_cache_for_generation("b")
        assert mx.array_equal(keys_of(caches), keys_of(kv(SYSTEM))).item()
        cache.check_invariants()

    @pytest.mark.parametrize("block_data", INEXACT)
    def test_inexact_payloads_are_a_miss(self, cache, paged, block_data):
        """Anything else in a published block is a miss, never an exception or a wrong cache."""
        seed_written(paged, SYSTEM, block_data)
        assert cache.fetch_cache("b", SYSTEM + [1]) == (None, SYSTEM + [1])
        assert cache.get_stats()["misses"] == 1
        cache.store_cache("s", SYSTEM, kv(SYSTEM))
        table, _ = cache.fetch_cache("c", SYSTEM + [1])
        assert mx.array_equal(keys_of(cache.reconstruct_cache(table)), keys_of(kv(SYSTEM))).item()
        cache.check_invariants()

    def test_hit_stops_at_the_first_inexact_block(self, cache, paged):
        """A chain whose second block is not exactly KV state is served up to its first block."""

        def block_data(layers, i):
            stop = None if i == 0 else 8
            return [(c.keys[:, :, span(i, stop)], c.values[:, :, span(i, stop)]) for c in layers]

        seed_written(paged, SYSTEM, block_data)
        table, remaining = cache.fetch_cache("b", SYSTEM + [1])
        assert table.num_tokens == 16 and remaining == SYSTEM[16:] + [1]
        rebuilt = cache.reconstruct_cache(table)
        assert mx.array_equal(keys_of(rebuilt), keys_of(kv(SYSTEM))[:, :, :16]).item()


def greedy(model, caches, logits, steps=8):
    """Greedy tokens continued from the last position of ``logits``."""
    out = []
    for _ in range(steps):
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache=caches)
    return out


class TestParity:
    @pytest.mark.parametrize("fixture", ["tiny_llama", "sliding_llama", "hybrid_model"])
    def test_fetch_reconstruct_matches_cold(self, fixture, request):
        """B continued from A's cached prefix generates exactly what a cold B generates."""
        model = request.getfixturevalue(fixture)[0]
        paged = PagedCacheManager(block_size=32, max_blocks=32)
        cache = BlockAwarePrefixCache(model, paged)
        shared = [(i * 37 + 11) % 256 for i in range(128)]
        b_prompt = shared + [(i * 13 + 5) % 256 for i in range(70)]

        a_cache = make_prompt_cache(model)
        mx.eval(model(mx.array([shared]), cache=a_cache))
        cache.store_cache("a", shared, a_cache)
        del a_cache

        cold = make_prompt_cache(model)
        cold_logits = model(mx.array([b_prompt]), cache=cold)
        cold_tokens = greedy(model, cold, cold_logits)

        table, remaining = cache.fetch_cache("b", b_prompt)
        assert table.num_tokens == 128 and remaining == b_prompt[128:]
        caches = cache.reconstruct_cache(table)
        logits = model(mx.array([remaining]), cache=caches)
        assert mx.allclose(logits[0, -1], cold_logits[0, -1], atol=LOGITS_ATOL).item()
        assert greedy(model, caches, logits) == cold_tokens
        cache.release_cache("b")
        cache.release_cache("a")
        cache.check_invariants()

    def test_hybrid_hit_needs_snapshot(self, hybrid_model):
        """A hybrid prompt stored off a block boundary shares nothing; on one, it does."""
        model = hybrid_model[0]
        cache = BlockAwarePrefixCache(model, PagedCacheManager(block_size=32, max_blocks=32))
        prompt = [(i * 37 + 11) % 256 for i in range(100)]
        for request_id, length in (("off", 100), ("on", 64)):
            prefill = make_prompt_cache(model)
            mx.eval(model(mx.array([prompt[:length]]), cache=prefill))
            cache.store_cache(request_id, prompt[:length], prefill)
            if request_id == "off":
                assert cache.fetch_cache("probe", prompt + [1])[0] is None
        table, _ = cache.fetch_cache("probe", prompt + [1])
        assert table.num_tokens == 64


MACHINE_BLOCK = 4
#: How a paged-API user may fill a block (see seed_block_data); exact is likelier.
SEED_BLOCK_KINDS = ["exact", "exact", "exact-3d", "short", "layer-without-data", "no-data"]


def seed_block_data(prompt, index, kind):
    """Block ``index`` of ``prompt`` as a paged-API user might write its cache_data.

    ``exact`` and ``exact-3d`` are the prompt's true one-layer KV state in the
    seed's declared format; the other kinds are not exactly KV state.
    """
    layer = kv(prompt, layers=1)[0]
    start = index * MACHINE_BLOCK
    keys = layer.keys[:, :, start : start + MACHINE_BLOCK]
    values = layer.values[:, :, start : start + MACHINE_BLOCK]
    return {
        "exact": [(keys, values)],
        "exact-3d": [(keys[0], values[0])],
        "short": [(keys[:, :, :2], values[:, :, :2])],
        "layer-without-data": [None],
        "no-data": None,
    }[kind]


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random store/fetch/fork/COW/release sequences on a small pool (evictions, shortages),
    mixed with opaque stores and with blocks written and published through the paged API.

    A hit is either a run of blocks that rebuilds exactly the KV state of the
    tokens it covers, or a run of opaque blocks that rebuilds to None; no
    operation raises anything else or breaks an invariant; a request that
    stored opaque data gets that data back; releasing everything leaves no
    block referenced.
    """

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.paged = PagedCacheManager(block_size=MACHINE_BLOCK, max_blocks=24)
        self.cache = BlockAwarePrefixCache(None, self.paged)
        self.prompts: dict[str, list[int]] = {}
        self.salts: dict[str, object] = {}
        self.opaque_data: dict[str, object] = {}
        self.counter = 0

    def _new_id(self) -> str:
        self.counter += 1
        return f"r{self.counter}"

    @staticmethod
    def _prompt(base: int, shared: int, tail: list[int]) -> list[int]:
        return [base * 50 + i for i in range(shared)] + tail

    def _expected(self, request_id: str, covered: int):
        return keys_of(kv(self.prompts[request_id], layers=1))[:, :, :covered]

    def _check_rebuilt(self, request_id: str, blocks, rebuilt) -> None:
        """A rebuilt cache holds exactly the KV of the blocks' tokens.

        Blocks that are all ours must rebuild; a block stored from opaque
        data never does; blocks a paged-API user wrote may go either way.
        """
        payloads = [b.cache_data for b in blocks]
        if any(isinstance(p, OpaquePayload) for p in payloads):
            assert rebuilt is None
            return
        if all(isinstance(p, kv_state.BlockPayload) for p in payloads):
            assert rebuilt is not None
        if rebuilt is not None:
            covered = sum(b.token_count for b in blocks)
            assert rebuilt[0].offset == covered
            assert mx.array_equal(keys_of(rebuilt), self._expected(request_id, covered)).item()

    @rule(
        target=requests,
        base=st.integers(0, 1),
        shared=st.integers(0, 14),
        tail=st.lists(st.integers(0, 9), max_size=6),
        salt=st.sampled_from([None, None, None, "s"]),
        opaque=st.booleans(),
    )
    def store(self, base, shared, tail, salt, opaque):
        prompt = self._prompt(base, shared, tail)
        request_id = self._new_id()
        data = ["placeholder", request_id] if opaque else kv(prompt, layers=1)
        table = self.cache.store_cache(request_id, prompt, data, cache_salt=salt)
        if table is not None:
            assert table.num_tokens <= len(prompt)
            self.prompts[request_id] = prompt[: table.num_tokens]
            self.salts[request_id] = salt
            if opaque:
                self.opaque_data[request_id] = data
        return request_id

    @rule(request_id=requests, more=st.lists(st.integers(0, 9), min_size=1, max_size=9))
    def extend(self, request_id, more):
        if request_id not in self.cache._request_tables:
            return
        prompt = self.prompts[request_id] + more
        salt = self.salts[request_id]
        table = self.cache.store_cache(request_id, prompt, kv(prompt, layers=1), cache_salt=salt)
        assert table is not None and table.num_tokens >= len(self.prompts[request_id])
        self.prompts[request_id] = prompt[: table.num_tokens]

    @rule(
        base=st.integers(0, 1),
        shared=st.integers(4, 14),
        kinds=st.lists(st.sampled_from(SEED_BLOCK_KINDS), min_size=1, max_size=3),
    )
    def paged_write(self, base, shared, kinds):
        """A paged-API user allocates blocks, writes their cache_data, publishes and frees them."""
        prompt = self._prompt(base, shared, [])
        count = min(len(kinds), len(prompt) // MACHINE_BLOCK)
        try:
            blocks = self.paged.get_new_blocks(count)
        except ValueError:
            return
        for index, (block, kind) in enumerate(zip(blocks, kinds)):
            block.cache_data = seed_block_data(prompt, index, kind)
        self.paged.cache_full_blocks(blocks, prompt, 0, count)
        self.paged.free_block_batch(blocks)

    @rule(
        target=requests,
        base=st.integers(0, 1),
        shared=st.integers(1, 14),
        tail=st.lists(st.integers(0, 9), max_size=6),
        salt=st.sampled_from([None, None, None, "s"]),
    )
    def fetch(self, base, shared, tail, salt):
        prompt = self._prompt(base, shared, tail)
        request_id = self._new_id()
        table, remaining = self.cache.fetch_cache(request_id, prompt, cache_salt=salt)
        if table is None:
            assert remaining == prompt
            return request_id
        covered = table.num_tokens
        assert covered % MACHINE_BLOCK == 0 and prompt[covered:] == remaining
        self.prompts[request_id] = prompt[:covered]
        self.salts[request_id] = salt
        blocks = [self.paged.blocks[i] for i in table.block_ids]
        kinds = {isinstance(b.cache_data, OpaquePayload) for b in blocks}
        assert len(kinds) == 1  # all opaque or all KV state, never mixed
        self._check_rebuilt(request_id, blocks, self.cache.reconstruct_cache(table))
        return request_id

    @rule(request_id=requests, data=st.data())
    def reconstruct_leading_part(self, request_id, data):
        """A table built by hand from a request's first block ids rebuilds those blocks."""
        entry = self.cache._request_tables.get(request_id)
        if entry is None:
            return
        count = data.draw(st.integers(1, len(entry.blocks)), label="blocks")
        part = BlockTable(request_id, entry.block_table.block_ids[:count])
        self._check_rebuilt(request_id, entry.blocks[:count], self.cache.reconstruct_cache(part))

    @rule(target=requests, source=requests)
    def fork(self, source):
        request_id = self._new_id()
        table = self.cache.fork_cache(source, request_id)
        if table is not None:
            self.prompts[request_id] = self.prompts[source]
            self.salts[request_id] = self.salts[source]
            if source in self.opaque_data:
                self.opaque_data[request_id] = self.opaque_data[source]
        return request_id

    @rule(request_id=requests)
    def generate(self, request_id):
        caches, copied = self.cache.get_cache_for_generation(request_id)
        entry = self.cache._request_tables.get(request_id)
        if entry is None:
            assert (caches, copied) == (None, False)
        elif entry.opaque:
            stored = self.opaque_data[request_id]
            assert caches == stored and (caches is stored) == (not copied)
        else:
            self._check_rebuilt(request_id, entry.blocks, caches)

    @rule(request_id=consumes(requests))
    def release(self, request_id):
        self.cache.release_cache(request_id)
        assert request_id not in self.cache._request_tables

    @invariant()
    def consistent(self):
        self.cache.check_invariants()

    def teardown(self):
        for request_id in list(self.cache._request_tables):
            self.cache.release_cache(request_id)
        self.cache.check_invariants()
        assert held_blocks(self.paged) == set()


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=examples(60), stateful_step_count=30, deadline=None)
