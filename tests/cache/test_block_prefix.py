"""BlockAwarePrefixCache: seed-compatible block-level prefix caching over the paged manager."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxkv.cache import kv_state
from mlxkv.cache.block_prefix import BlockAwarePrefixCache, BlockCacheEntry
from mlxkv.cache.paged import PagedCacheManager

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

    @pytest.mark.parametrize(
        "bad",
        [
            [],
            "not a cache",
            [object()],
            [{"state": (mx.zeros((1, 1, 4, 2)),)}],
            [{"state": (mx.zeros((2, 2)), mx.zeros((2, 2)))}],
        ],
    )
    def test_bad_cache_data(self, cache, paged, bad, caplog):
        """Malformed cache data is logged and nothing is stored."""
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert cache.store_cache("a", SYSTEM, bad) is None
        assert caplog.records and held_blocks(paged) == set() and len(cache) == 0
        assert cache.store_cache("a", [], kv(SYSTEM)) is None
        cache.check_invariants()


class TestEviction:
    def test_evicted_block_shortens_fetch(self, cache, paged):
        """Evicting the deepest cached block makes the next hit one block shorter, never wrong."""
        prompt = SYSTEM + list(range(16))
        cache.store_cache("a", prompt, kv(prompt))
        cache.release_cache("a")
        assert paged.evict(1) == 1
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
        """An empty table gives None; a table this cache does not hold is refused."""
        assert cache.reconstruct_cache(None) is None
        table = paged.create_block_table("elsewhere")
        assert cache.reconstruct_cache(table) is None
        (block,) = paged.allocate(1)
        table.add_block(block.block_id, 16)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert cache.reconstruct_cache(table) is None
        assert "not held" in caplog.text

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
        assert mx.allclose(logits[0, -1], cold_logits[0, -1], atol=1e-4).item()
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


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random store/fetch/fork/COW/release sequences on a small pool (evictions, shortages).

    Every hit must rebuild exactly the KV state of the tokens it covers, every
    operation must keep the invariants, and releasing everything must leave
    no block referenced.
    """

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.paged = PagedCacheManager(block_size=4, max_blocks=24)
        self.cache = BlockAwarePrefixCache(None, self.paged)
        self.prompts: dict[str, list[int]] = {}
        self.salts: dict[str, object] = {}
        self.counter = 0

    def _new_id(self) -> str:
        self.counter += 1
        return f"r{self.counter}"

    @staticmethod
    def _prompt(base: int, shared: int, tail: list[int]) -> list[int]:
        return [base * 50 + i for i in range(shared)] + tail

    @rule(
        target=requests,
        base=st.integers(0, 1),
        shared=st.integers(0, 14),
        tail=st.lists(st.integers(0, 9), max_size=6),
        salt=st.sampled_from([None, None, None, "s"]),
    )
    def store(self, base, shared, tail, salt):
        prompt = self._prompt(base, shared, tail)
        request_id = self._new_id()
        table = self.cache.store_cache(request_id, prompt, kv(prompt, layers=1), cache_salt=salt)
        if table is not None:
            assert table.num_tokens <= len(prompt)
            self.prompts[request_id] = prompt[: table.num_tokens]
            self.salts[request_id] = salt
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
        assert covered % 4 == 0 and prompt[covered:] == remaining
        rebuilt = self.cache.reconstruct_cache(table)
        expected = keys_of(kv(prompt, layers=1))[:, :, :covered]
        assert mx.array_equal(keys_of(rebuilt), expected).item()
        self.prompts[request_id] = prompt[:covered]
        self.salts[request_id] = salt
        return request_id

    @rule(target=requests, source=requests)
    def fork(self, source):
        request_id = self._new_id()
        table = self.cache.fork_cache(source, request_id)
        if table is not None:
            self.prompts[request_id] = self.prompts[source]
            self.salts[request_id] = self.salts[source]
        return request_id

    @rule(request_id=requests)
    def generate(self, request_id):
        caches, _ = self.cache.get_cache_for_generation(request_id)
        if request_id in self.cache._request_tables:
            covered = self.cache._request_tables[request_id].block_table.num_tokens
            expected = keys_of(kv(self.prompts[request_id], layers=1))[:, :, :covered]
            assert caches is not None and mx.array_equal(keys_of(caches), expected).item()
        else:
            assert caches is None

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
TestPrefixCacheMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
