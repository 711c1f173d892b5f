"""PrefixCacheManager: trie lookups, LRU, trimming, copies, and a reference model."""

from __future__ import annotations


import mlx.core as mx
import pytest
from budget import examples
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from mlxkv.cache.errors import InvalidInput, InvariantViolation
from mlxkv.cache.prefix import CacheEntry, PrefixCacheManager, PrefixCacheStats

from device_arithmetic import LOGITS_ATOL


class _Layer:
    """A stand-in cache layer: remembers which sequence it was stored for."""

    def __init__(self, tag: tuple, offset: int, trimmable: bool = True) -> None:
        self.tag = tag
        self.offset = offset
        self.trimmable = trimmable

    def is_trimmable(self) -> bool:
        return self.trimmable

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n


def _cache(tokens, trimmable: bool = True) -> list:
    return [_Layer(tuple(tokens), len(tokens), trimmable)]


class TestPrefixCacheStats:
    def test_hit_rate_before_queries(self):
        """The hit rate is 0.0 when nothing was asked."""
        assert PrefixCacheStats().hit_rate == 0.0

    def test_to_dict_has_seed_keys(self):
        """to_dict reports exactly the seed's keys and the derived hit rate."""
        stats = PrefixCacheStats(hits=3, misses=1, tokens_saved=9, total_queries=4, evictions=2)
        assert stats.to_dict() == {
            "hits": 3, "misses": 1, "hit_rate": 0.75, "tokens_saved": 9,
            "total_queries": 4, "evictions": 2,
        }


class TestConstruction:
    def test_seed_attributes(self):
        """The constructor keeps the model, the size bound and fresh stats."""
        model = object()
        mgr = PrefixCacheManager(model, max_entries=7)
        assert mgr.model is model
        assert mgr.max_size == 7
        assert mgr.stats == PrefixCacheStats()
        assert len(mgr) == 0
        assert PrefixCacheManager(model).max_size == 100

    @pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3", None])
    def test_bad_max_entries(self, bad):
        """A size bound that is not a positive int is refused."""
        with pytest.raises(InvalidInput):
            PrefixCacheManager(None, max_entries=bad)


class TestFetch:
    def _mgr(self, *stored, max_entries=10, trimmable=True):
        mgr = PrefixCacheManager(None, max_entries=max_entries)
        for tokens in stored:
            mgr.store_cache(list(tokens), _cache(tokens, trimmable))
        return mgr

    def test_exact_match(self):
        """An exact match returns the stored cache and no remaining tokens."""
        mgr = self._mgr([1, 2, 3])
        cache, remaining = mgr.fetch_cache([1, 2, 3])
        assert cache[0].tag == (1, 2, 3) and cache[0].offset == 3
        assert remaining == []
        assert mgr.get_stats()["tokens_saved"] == 3

    def test_shorter_match_returns_tail(self):
        """A stored prefix is returned with the tokens it does not cover."""
        mgr = self._mgr([1, 2])
        cache, remaining = mgr.fetch_cache([1, 2, 3, 4])
        assert cache[0].tag == (1, 2)
        assert remaining == [3, 4]
        assert mgr.stats.tokens_saved == 2

    def test_shorter_match_is_the_longest_stored_prefix(self):
        """The deepest stored prefix wins, even where the walk goes past it first."""
        mgr = self._mgr([1], [1, 2], [1, 2, 3, 4])
        cache, remaining = mgr.fetch_cache([1, 2, 3, 9])
        assert cache[0].tag == (1, 2)
        assert remaining == [3, 9]

    def test_longer_match_is_trimmed(self):
        """A stored extension is trimmed to the query and covers all of it."""
        mgr = self._mgr([1, 2, 3, 4, 5])
        cache, remaining = mgr.fetch_cache([1, 2, 3])
        assert cache[0].tag == (1, 2, 3, 4, 5)
        assert cache[0].offset == 3
        assert remaining == []
        assert mgr.stats.tokens_saved == 3

    def test_longer_match_prefers_least_trimming(self):
        """Among stored extensions, the shortest one is used."""
        mgr = self._mgr([1, 2, 3, 4, 5, 6], [1, 2, 7, 8], [1, 2, 3, 9, 9, 9, 9])
        cache, _ = mgr.fetch_cache([1, 2])
        assert cache[0].tag == (1, 2, 7, 8)

    def test_longer_beats_shorter(self):
        """A trimmable extension covers more than a stored prefix, so it wins."""
        mgr = self._mgr([1], [1, 2, 3])
        cache, remaining = mgr.fetch_cache([1, 2])
        assert cache[0].tag == (1, 2, 3) and cache[0].offset == 2
        assert remaining == []

    def test_untrimmable_longer_falls_back_to_shorter(self):
        """An extension that cannot be trimmed gives way to a stored prefix."""
        mgr = PrefixCacheManager(None)
        mgr.store_cache([1], _cache([1]))
        mgr.store_cache([1, 2, 3], _cache([1, 2, 3], trimmable=False))
        cache, remaining = mgr.fetch_cache([1, 2])
        assert cache[0].tag == (1,)
        assert remaining == [2]

    def test_untrimmable_longer_alone_is_a_miss(self):
        """An untrimmable extension with no prefix to fall back on is a miss."""
        mgr = self._mgr([1, 2, 3], trimmable=False)
        cache, remaining = mgr.fetch_cache([1, 2])
        assert cache is None and remaining == [1, 2]
        assert mgr.stats.misses == 1 and mgr.stats.hits == 0

    def test_miss_returns_all_tokens(self):
        """A miss returns None and every token, as a new list."""
        mgr = self._mgr([5, 6])
        tokens = [1, 2]
        cache, remaining = mgr.fetch_cache(tokens)
        assert cache is None
        assert remaining == tokens and remaining is not tokens

    def test_scripted_stats(self):
        """Hits, misses, tokens saved and queries add up over a sequence."""
        mgr = self._mgr([1, 2, 3], [4, 5])
        mgr.fetch_cache([1, 2, 3])  # exact: 3
        mgr.fetch_cache([4, 5, 6])  # shorter: 2
        mgr.fetch_cache([1, 2])  # longer: 2
        mgr.fetch_cache([9])  # miss
        assert mgr.get_stats() == {
            "hits": 3, "misses": 1, "hit_rate": 0.75, "tokens_saved": 7,
            "total_queries": 4, "evictions": 0,
        }

    @pytest.mark.parametrize("bad", [[], [1, "a"], [1.5], [-1], [2**32], "abc", 7, None])
    def test_bad_tokens_are_refused_uncounted(self, bad):
        """Empty or non-integer token lists raise InvalidInput and count nothing."""
        mgr = self._mgr([1, 2])
        with pytest.raises(InvalidInput):
            mgr.fetch_cache(bad)
        assert mgr.stats == PrefixCacheStats()

    def test_numpy_style_ints_are_accepted(self):
        """Token ids that are int-like (``__index__``) behave as their int values."""
        np = pytest.importorskip("numpy")
        mgr = self._mgr([1, 2, 3])
        cache, remaining = mgr.fetch_cache(list(np.array([1, 2, 3, 4])))
        assert cache[0].tag == (1, 2, 3) and remaining == [4]
        assert all(type(t) is int for t in remaining)


class TestOwnership:
    def test_fetched_cache_is_not_the_stored_object(self):
        """Each fetch hands out a new list of new layer objects."""
        mgr = PrefixCacheManager(None)
        mgr.store_cache([1, 2], _cache([1, 2]))
        stored = mgr._get_cache_entry([1, 2]).prompt_cache
        first, _ = mgr.fetch_cache([1, 2])
        second, _ = mgr.fetch_cache([1, 2])
        assert first is not stored and first[0] is not stored[0]
        assert first is not second and first[0] is not second[0]

    def test_changing_a_fetched_cache_leaves_the_entry(self):
        """Trimming or changing what was fetched does not reach the entry."""
        mgr = PrefixCacheManager(None)
        mgr.store_cache([1, 2, 3], _cache([1, 2, 3]))
        cache, _ = mgr.fetch_cache([1, 2, 3])
        cache[0].trim(3)
        cache.append("junk")
        again, _ = mgr.fetch_cache([1, 2, 3])
        assert len(again) == 1 and again[0].offset == 3

    def test_store_takes_a_snapshot(self):
        """A caller that keeps changing its cache after storing does not change the entry."""
        mgr = PrefixCacheManager(None)
        mine = _cache([1, 2, 3])
        mgr.store_cache([1, 2, 3], mine)
        mine[0].trim(2)
        mine.append("junk")
        cache, _ = mgr.fetch_cache([1, 2, 3])
        assert len(cache) == 1 and cache[0].offset == 3

    def test_longer_match_does_not_trim_the_entry(self):
        """Serving a trimmed copy leaves the stored extension at full length."""
        mgr = PrefixCacheManager(None)
        mgr.store_cache([1, 2, 3, 4], _cache([1, 2, 3, 4]))
        mgr.fetch_cache([1, 2])
        assert mgr._get_cache_entry([1, 2, 3, 4]).prompt_cache[0].offset == 4

    def test_real_kv_buffers_are_not_shared_for_writes(self):
        """Writing into a fetched KVCache leaves the stored KVCache's keys intact."""
        layer = KVCache()
        layer.update_and_fetch(mx.zeros((1, 1, 8, 4)), mx.zeros((1, 1, 8, 4)))
        mgr = PrefixCacheManager(None)
        mgr.store_cache(list(range(8)), [layer])
        cache, _ = mgr.fetch_cache(list(range(4)))
        cache[0].update_and_fetch(mx.ones((1, 1, 4, 4)), mx.ones((1, 1, 4, 4)))
        stored = mgr._get_cache_entry(list(range(8))).prompt_cache[0]
        assert stored.offset == 8
        assert mx.array_equal(stored.keys[..., :8, :], mx.zeros((1, 1, 8, 4))).item()
        assert mx.array_equal(layer.keys[..., :8, :], mx.zeros((1, 1, 8, 4))).item()


class TestStoreAndLru:
    def test_restore_counts_and_keeps_first_cache(self):
        """Storing a stored sequence again bumps its count and keeps the first cache."""
        mgr = PrefixCacheManager(None)
        mgr.store_cache([1, 2], [_Layer(("first",), 2)])
        mgr.store_cache([1, 2], [_Layer(("second",), 2)])
        entry = mgr._get_cache_entry([1, 2])
        assert isinstance(entry, CacheEntry)
        assert entry.count == 2 and entry.prompt_cache[0].tag == ("first",)
        assert len(mgr) == 1

    def test_empty_tokens_store_nothing(self):
        """Storing an empty token list is the seed's silent no-op."""
        mgr = PrefixCacheManager(None)
        mgr.store_cache([], _cache([]))
        assert len(mgr) == 0

    def test_store_rejects_non_list_cache(self):
        """A prompt cache that is not a list or tuple is refused before any change."""
        mgr = PrefixCacheManager(None)
        with pytest.raises(InvalidInput):
            mgr.store_cache([1], KVCache())
        assert len(mgr) == 0
        mgr.check_invariants()

    def test_evicts_least_recently_used(self):
        """Past max_entries the least recently used sequence goes, and is counted."""
        mgr = PrefixCacheManager(None, max_entries=2)
        mgr.store_cache([1], _cache([1]))
        mgr.store_cache([2], _cache([2]))
        mgr.fetch_cache([1])  # [2] is now the oldest
        mgr.store_cache([3], _cache([3]))
        assert mgr._get_cache_entry([2]) is None
        assert mgr._get_cache_entry([1]) is not None and mgr._get_cache_entry([3]) is not None
        assert len(mgr) == 2 and mgr.stats.evictions == 1
        mgr.check_invariants()

    def test_every_hit_kind_refreshes_recency(self):
        """Shorter and longer hits mark the entry they used most recently used."""
        mgr = PrefixCacheManager(None, max_entries=3)
        for tokens in ([1, 2, 3], [5], [7, 8]):
            mgr.store_cache(tokens, _cache(tokens))
        mgr.fetch_cache([1, 2])  # longer hit on [1, 2, 3]
        mgr.fetch_cache([5, 6])  # shorter hit on [5]
        mgr.store_cache([9], _cache([9]))
        assert mgr._get_cache_entry([7, 8]) is None
        assert len(mgr) == 3

    def test_restore_refreshes_recency(self):
        """Storing an existing sequence again makes it most recently used."""
        mgr = PrefixCacheManager(None, max_entries=2)
        mgr.store_cache([1], _cache([1]))
        mgr.store_cache([2], _cache([2]))
        mgr.store_cache([1], _cache([1]))
        mgr.store_cache([3], _cache([3]))
        assert mgr._get_cache_entry([2]) is None and mgr._get_cache_entry([1]) is not None

    def test_eviction_prunes_dead_branches(self):
        """Evicting a long sequence removes its now-empty trie path."""
        mgr = PrefixCacheManager(None, max_entries=1)
        mgr.store_cache(list(range(50)), _cache(range(50)))
        mgr.store_cache([99], _cache([99]))
        assert list(mgr._root.children) == [99]
        mgr.check_invariants()

    def test_clear_drops_entries_and_stats(self):
        """clear() empties the cache and zeroes the statistics."""
        mgr = PrefixCacheManager(None)
        mgr.store_cache([1], _cache([1]))
        mgr.fetch_cache([1])
        mgr.clear()
        assert len(mgr) == 0 and mgr.stats == PrefixCacheStats()
        assert mgr.fetch_cache([1]) == (None, [1])

    def test_reset_stats_keeps_entries(self):
        """reset_stats() zeroes the counters but keeps what is stored."""
        mgr = PrefixCacheManager(None)
        mgr.store_cache([1], _cache([1]))
        mgr.fetch_cache([1])
        mgr.reset_stats()
        assert mgr.stats == PrefixCacheStats() and len(mgr) == 1


class TestSeedHelpers:
    def test_search_shapes(self):
        """_search returns (exact, shorter, longer, common_prefix_len) as lists."""
        mgr = PrefixCacheManager(None)
        mgr.store_cache([1, 2], _cache([1, 2]))
        mgr.store_cache([1, 2, 3, 4], _cache([1, 2, 3, 4]))
        assert mgr._search([1, 2]) == ([1, 2], None, None, 0)
        assert mgr._search([1, 2, 3]) == (None, [1, 2], [1, 2, 3, 4], 3)
        assert mgr._search([1, 2, 9]) == (None, [1, 2], None, 0)
        assert mgr._search([7]) == (None, None, None, 0)

    def test_touch_and_delete(self):
        """_touch_lru reorders, _delete_cache removes without counting an eviction."""
        mgr = PrefixCacheManager(None, max_entries=2)
        mgr.store_cache([1], _cache([1]))
        mgr.store_cache([2], _cache([2]))
        mgr._touch_lru((1,))
        mgr._touch_lru((3,))  # absent: nothing happens
        mgr._evict_lru()
        assert mgr._get_cache_entry([2]) is None and mgr.stats.evictions == 1
        mgr._delete_cache([1])
        mgr._delete_cache([1])
        assert len(mgr) == 0 and mgr.stats.evictions == 1
        mgr._evict_lru()
        assert mgr.stats.evictions == 1
        mgr.check_invariants()

    def test_can_trim_cache(self):
        """Trimmability follows each layer's is_trimmable, failing closed."""
        mgr = PrefixCacheManager(None)
        assert mgr._can_trim_cache([]) is False
        assert mgr._can_trim_cache([KVCache(), KVCache()]) is True
        assert mgr._can_trim_cache([KVCache(), _Layer((), 1, trimmable=False)]) is False

        class OldStyle:
            def trim(self, n):
                return n

        assert mgr._can_trim_cache([OldStyle()]) is True
        assert mgr._can_trim_cache([object()]) is False

    def test_rotating_cache_is_trimmable_until_it_wraps(self):
        """A RotatingKVCache can be trimmed only before its window fills."""
        mgr = PrefixCacheManager(None)
        layer = RotatingKVCache(max_size=4)
        layer.update_and_fetch(mx.zeros((1, 1, 3, 2)), mx.zeros((1, 1, 3, 2)))
        assert mgr._can_trim_cache([layer]) is True
        layer.update_and_fetch(mx.zeros((1, 1, 2, 2)), mx.zeros((1, 1, 2, 2)))
        assert mgr._can_trim_cache([layer]) is False

    def test_trim_cache_in_place(self):
        """_trim_cache trims every layer in place and returns the same list."""
        mgr = PrefixCacheManager(None)
        cache = [_Layer((), 5), _Layer((), 5)]
        assert mgr._trim_cache(cache, 2) is cache
        assert [layer.offset for layer in cache] == [3, 3]
        assert mgr._trim_cache(cache, 0) is cache and cache[0].offset == 3
        mixed = [_Layer((), 5), _Layer((), 5, trimmable=False)]
        mgr._trim_cache(mixed, 2)
        assert [layer.offset for layer in mixed] == [5, 5]


def _greedy(model, cache, tokens, steps=6):
    """Prefill ``tokens`` into ``cache``, then decode greedily; return logits and ids."""
    logits = model(mx.array([tokens]), cache=cache)
    first = logits[0, -1]
    out = []
    for _ in range(steps):
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)
    mx.eval(first)
    return first, out


class TestWithTinyLlama:
    PREFIX = "System: you are a terse assistant. Answer briefly.\nUser: "

    def test_shorter_prefix_continuation_matches_cold(self, tiny_llama):
        """Continuing from a fetched prefix cache gives the cold run's logits and tokens."""
        model, tokenizer = tiny_llama
        prefix = tokenizer.encode(self.PREFIX)
        full = prefix + tokenizer.encode("what is a trie?")
        cold_logits, cold_ids = _greedy(model, make_prompt_cache(model), full)

        mine = make_prompt_cache(model)
        model(mx.array([prefix]), cache=mine)
        mgr = PrefixCacheManager(model)
        mgr.store_cache(prefix, mine)
        _greedy(model, mine, tokenizer.encode("something else entirely"))  # keeps using it

        cache, remaining = mgr.fetch_cache(full)
        assert all(isinstance(layer, KVCache) for layer in cache)
        assert remaining == full[len(prefix):]
        warm_logits, warm_ids = _greedy(model, cache, remaining)
        assert warm_ids == cold_ids
        assert mx.allclose(warm_logits, cold_logits, atol=LOGITS_ATOL).item()

    def test_trimmed_longer_cache_matches_cold(self, tiny_llama):
        """A longer cache trimmed to the query continues exactly like a cold run."""
        model, tokenizer = tiny_llama
        prefix = tokenizer.encode(self.PREFIX)
        stored = prefix + tokenizer.encode("tell me about caches")
        other = tokenizer.encode("and now a different question")

        cache = make_prompt_cache(model)
        model(mx.array([stored]), cache=cache)
        mgr = PrefixCacheManager(model)
        mgr.store_cache(stored, cache)

        trimmed, remaining = mgr.fetch_cache(prefix)
        assert remaining == [] and {layer.offset for layer in trimmed} == {len(prefix)}
        warm_logits, warm_ids = _greedy(model, trimmed, other)
        cold_logits, cold_ids = _greedy(model, make_prompt_cache(model), prefix + other)
        assert warm_ids == cold_ids
        assert mx.allclose(warm_logits, cold_logits, atol=LOGITS_ATOL).item()

        # Decoding into the trimmed copy overwrote shared positions; the entry
        # must still hold the original suffix.
        exact, remaining = mgr.fetch_cache(stored)
        assert remaining == []
        probe = tokenizer.encode("?")
        warm_logits, warm_ids = _greedy(model, exact, probe)
        cold_logits, cold_ids = _greedy(model, make_prompt_cache(model), stored + probe)
        assert warm_ids == cold_ids
        assert mx.allclose(warm_logits, cold_logits, atol=LOGITS_ATOL).item()


class TestCheckInvariants:
    def test_healthy_trie_passes(self):
        """A manager after stores, hits and evictions satisfies every invariant."""
        mgr = PrefixCacheManager(None, max_entries=2)
        for tokens in ([1, 2, 3], [1, 2], [1, 2, 3, 4], [7]):
            mgr.store_cache(tokens, _cache(tokens))
        mgr.fetch_cache([1, 2, 3, 9])
        mgr.check_invariants()

    @pytest.mark.parametrize(
        "corrupt, message",
        [
            (lambda mgr: setattr(mgr, "max_size", 1), "max_size"),
            (lambda mgr: mgr._lru.popitem(last=False), "LRU"),
            (lambda mgr: setattr(mgr._find([1, 2]), "nearest", None), "stale nearest"),
            (lambda mgr: setattr(mgr._find([1, 2]), "depth", 5), "depth"),
            (lambda mgr: setattr(mgr._find([1, 2, 3]), "entry", None), "dead branch"),
        ],
    )
    def test_corruption_is_reported(self, corrupt, message):
        """Each broken invariant raises InvariantViolation naming it."""
        mgr = PrefixCacheManager(None)
        for tokens in ([1, 2], [1, 2, 3]):
            mgr.store_cache(tokens, _cache(tokens))
        corrupt(mgr)
        with pytest.raises(InvariantViolation, match=message):
            mgr.check_invariants()

    def test_checks_survive_python_o(self, run_optimized):
        """Under python -O (asserts stripped) a corrupted trie is still reported."""
        script = (
            "from mlxkv.cache.errors import InvariantViolation\n"
            "from mlxkv.cache.prefix import PrefixCacheManager\n"
            "assert False, 'asserts must be stripped'\n"
            "mgr = PrefixCacheManager(None)\n"
            "mgr.store_cache([1, 2], ['layer'])\n"
            "mgr._lru.popitem()\n"
            "try:\n"
            "    mgr.check_invariants()\n"
            "except InvariantViolation as error:\n"
            "    print('reported:', error)\n"
        )
        done = run_optimized(script)
        assert done.stdout.startswith("reported:")


class PrefixCacheAgainstReference(RuleBasedStateMachine):
    """Fetch results, LRU evictions and stats agree with a naive dict model."""

    tokens = st.lists(st.integers(0, 3), min_size=1, max_size=6).map(tuple)

    @initialize(max_entries=st.integers(1, 5))
    def setup(self, max_entries):
        self.mgr = PrefixCacheManager(None, max_entries=max_entries)
        self.max_entries = max_entries
        self.entries: dict[tuple, tuple[int, bool]] = {}  # key -> (seq, trimmable)
        self.lru: list[tuple] = []
        self.seq = 0
        self.expected = PrefixCacheStats()

    def _touch(self, key):
        self.lru.remove(key)
        self.lru.append(key)

    @rule(key=tokens, trimmable=st.booleans())
    def store(self, key, trimmable):
        self.mgr.store_cache(list(key), _cache(key, trimmable))
        if key in self.entries:
            self._touch(key)
            return
        self.entries[key] = (self.seq, trimmable)
        self.seq += 1
        self.lru.append(key)
        if len(self.lru) > self.max_entries:
            del self.entries[self.lru.pop(0)]
            self.expected.evictions += 1

    @rule(query=tokens)
    def fetch(self, query):
        cache, remaining = self.mgr.fetch_cache(list(query))
        self.expected.total_queries += 1
        n = len(query)
        longer = [k for k in self.entries if len(k) > n and k[:n] == query]
        shorter = [k for k in self.entries if len(k) < n and query[: len(k)] == k]
        if query in self.entries:
            used, covered, want_remaining = query, n, []
        elif longer and self.entries[min(longer, key=lambda k: (len(k), self.entries[k][0]))][1]:
            used = min(longer, key=lambda k: (len(k), self.entries[k][0]))
            covered, want_remaining = n, []
        elif shorter:
            used = max(shorter, key=len)
            covered, want_remaining = len(used), list(query[len(used):])
        else:
            assert cache is None and remaining == list(query)
            self.expected.misses += 1
            return
        assert cache is not None, f"expected a hit on {used} for {query}"
        assert cache[0].tag == used
        assert cache[0].offset == covered
        assert remaining == want_remaining
        self.expected.hits += 1
        self.expected.tokens_saved += covered
        self._touch(used)

    @invariant()
    def agrees(self):
        assert len(self.mgr) == len(self.entries)
        assert self.mgr.stats == self.expected
        self.mgr.check_invariants()


PrefixCacheAgainstReference.TestCase.settings = settings(
    max_examples=examples(60), stateful_step_count=30, deadline=None
)
TestPrefixCacheAgainstReference = PrefixCacheAgainstReference.TestCase
