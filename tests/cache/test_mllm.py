"""Image hashing and MLLMPrefixCacheManager: keys, prefix matches, LRU, salts."""

from __future__ import annotations

import base64
import hashlib
import itertools
import urllib.parse

import mlx.core as mx
import numpy as np
import pytest
from budget import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache

from mlxkv.cache import mllm
from mlxkv.cache.errors import InvalidInput, InvariantViolation
from mlxkv.cache.mllm import (
    MLLMCacheStats,
    MLLMPrefixCacheEntry,
    MLLMPrefixCacheManager,
    compute_image_hash,
    compute_images_hash,
    image_digest,
    images_digest,
)

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
OTHER_PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(255, -1, -1)) * 4
MIB = 1024 * 1024
HEX = set("0123456789abcdef")


def _sha16(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _kv(tokens: int, heads: int = 1, dim: int = 4) -> list:
    """A one-layer real KVCache holding ``tokens`` positions of zeros."""
    layer = KVCache()
    layer.update_and_fetch(mx.zeros((1, heads, tokens, dim)), mx.zeros((1, heads, tokens, dim)))
    mx.eval(layer.keys, layer.values)
    return [layer]


def _embeddings(mib: float) -> mx.array:
    """float32 vision embeddings of exactly ``mib`` MiB."""
    return mx.zeros((int(mib * MIB) // 4,), dtype=mx.float32)


class TestComputeImageHash:
    def test_file_hashes_its_content(self, tmp_path):
        """A file path hashes to the first 16 hex of its bytes' SHA-256 (the seed's value)."""
        path = tmp_path / "cat.png"
        path.write_bytes(PNG)
        assert compute_image_hash(str(path)) == _sha16(PNG)
        assert compute_image_hash(path) == _sha16(PNG)

    def test_same_bytes_under_another_name_hash_alike(self, tmp_path):
        """The name of the file does not matter, only its content."""
        (tmp_path / "a.png").write_bytes(PNG)
        (tmp_path / "b.jpg").write_bytes(PNG)
        (tmp_path / "c.png").write_bytes(OTHER_PNG)
        a, b, c = (compute_image_hash(tmp_path / n) for n in ("a.png", "b.jpg", "c.png"))
        assert a == b != c

    def test_data_url_file_and_bytes_agree(self, tmp_path):
        """A file, a base64 data URL, a percent-encoded data URL and raw bytes key alike."""
        path = tmp_path / "cat.png"
        path.write_bytes(PNG)
        b64 = "data:image/png;base64," + base64.b64encode(PNG).decode()
        wrapped = "data:image/png;base64," + "\n".join(
            base64.b64encode(PNG).decode()[i : i + 76] for i in range(0, 1400, 76)
        )
        pct = "data:application/octet-stream," + urllib.parse.quote_from_bytes(PNG)
        hashes = {compute_image_hash(x) for x in (path, b64, wrapped, pct, PNG, bytearray(PNG))}
        assert hashes == {_sha16(PNG)}
        digests = {image_digest(x) for x in (path, b64, pct, memoryview(PNG))}
        assert len(digests) == 1

    def test_url_hashes_the_string(self):
        """A URL is hashed as text; nothing is fetched."""
        url = "https://images.invalid/does/not/exist.png"
        assert compute_image_hash(url) == _sha16(url.encode())
        assert compute_image_hash("file:///no/such/file.png") == _sha16(b"file:///no/such/file.png")

    def test_url_and_its_text_as_bytes_differ_internally(self):
        """Short hashes of a URL and of its text as bytes agree; full keys keep them apart."""
        url = "https://example.invalid/cat.png"
        assert compute_image_hash(url) == compute_image_hash(url.encode())
        assert image_digest(url) != image_digest(url.encode())

    def test_numpy_arrays_hash_dtype_shape_and_bytes(self):
        """Equal arrays agree; a different dtype or shape over the same bytes does not."""
        a = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
        assert compute_image_hash(a) == compute_image_hash(a.copy())
        assert compute_image_hash(a) != compute_image_hash(a.reshape(4, 3, 2))
        assert compute_image_hash(a) != compute_image_hash(a.view(np.int8))
        assert compute_image_hash(a) != compute_image_hash(a.tobytes())

    def test_layout_and_byte_order_do_not_matter(self):
        """A strided view and a big-endian copy hash like the plain array of the same values."""
        base = np.arange(40, dtype=np.float32).reshape(5, 8)
        view = base[:, ::2]
        assert not view.flags.c_contiguous
        assert compute_image_hash(view) == compute_image_hash(np.ascontiguousarray(view))
        assert compute_image_hash(base.astype(">f4")) == compute_image_hash(base)

    def test_mx_arrays_hash_like_numpy(self):
        """An MLX array hashes like the numpy array with the same dtype, shape and values."""
        a = np.arange(12, dtype=np.float32).reshape(3, 4)
        assert compute_image_hash(mx.array(a)) == compute_image_hash(a)
        assert compute_image_hash(mx.array(a)[:, ::2]) == compute_image_hash(a[:, ::2])
        half = mx.ones((2, 2), dtype=mx.bfloat16)
        assert compute_image_hash(half) != compute_image_hash(mx.ones((2, 2), dtype=mx.float16))

    @pytest.mark.parametrize(
        "source",
        [
            "https://images.invalid/cat.png",
            "video:/clips/cat.mp4:fps2.0:max16",
            "request-42/image-0",
            "relative/typo.png",
            "data:image/png;base64",
            "data:image/png;base64,@@@not-base64@@@",
            "bad\0name.png",
        ],
    )
    def test_unreadable_strings_are_keyed_by_the_string(self, source):
        """A string that is not a readable file is keyed by itself, with the seed's short hash."""
        assert compute_image_hash(source) == _sha16(source.encode())
        assert image_digest(source) == image_digest(source)
        assert image_digest(source) != image_digest(source + " ")

    def test_missing_and_unreadable_paths_are_keyed_by_their_string(self, tmp_path):
        """A missing path or a directory, as str or os.PathLike, keys by its path string."""
        missing = tmp_path / "nope.png"
        assert compute_image_hash(missing) == compute_image_hash(str(missing))
        assert compute_image_hash(missing) == _sha16(str(missing).encode())
        assert image_digest(tmp_path) == image_digest(str(tmp_path))
        assert image_digest(missing) != image_digest(tmp_path)

    def test_string_keys_never_meet_content_keys(self, tmp_path):
        """A string keyed as such differs from a file or bytes holding the same characters."""
        name = "video:/clips/cat.mp4:fps2.0:max16"
        holder = tmp_path / "holder.bin"
        holder.write_bytes(name.encode())
        assert compute_image_hash(name) == compute_image_hash(holder)  # the seed's 64 bits
        assert len({image_digest(name), image_digest(holder), image_digest(name.encode())}) == 2
        assert image_digest(name) != image_digest(holder)

    def test_readable_file_keeps_its_content_key(self, tmp_path):
        """Once the path can be read, it keys by content, not by its name."""
        path = tmp_path / "late.png"
        as_string = image_digest(str(path))
        path.write_bytes(PNG)
        assert image_digest(str(path)) == image_digest(PNG) != as_string

    def test_manager_keys_unreadable_sources(self):
        """The manager stores and finds entries for URLs, video specs and identifiers, in order."""
        mgr = MLLMPrefixCacheManager()
        images = ["https://images.invalid/a.png", "video:/v.mp4:fps1.0:max8", "img-7"]
        mgr.store(images, "p", _embeddings(0.01), _kv(2), [1, 2])
        entry, length = mgr.fetch(images, "p", [1, 2, 3])
        assert entry is not None and length == 2
        assert mgr.fetch(images[::-1], "p")[0] is None
        mgr.check_invariants()

    @pytest.mark.parametrize("bad", [None, 42, 1.5, {"url": "x"}, np.array([object()])])
    def test_unsupported_types_are_invalid(self, bad):
        """Anything but a path, URL, bytes or array is refused."""
        with pytest.raises(InvalidInput):
            compute_image_hash(bad)


class TestComputeImagesHash:
    def test_no_images(self):
        """An empty list, or None, has the seed's 'no_images' hash."""
        assert compute_images_hash([]) == "no_images"
        assert compute_images_hash(None) == "no_images"

    def test_single_image_matches_seed_formula(self):
        """For one image the combined short hash is the seed's value."""
        assert compute_images_hash([PNG]) == _sha16(_sha16(PNG).encode())

    def test_order_matters(self):
        """[A, B] and [B, A] hash differently, short and full."""
        assert compute_images_hash([PNG, OTHER_PNG]) != compute_images_hash([OTHER_PNG, PNG])
        assert images_digest([PNG, OTHER_PNG]) != images_digest([OTHER_PNG, PNG])

    def test_repetition_matters(self):
        """[A] and [A, A] are different requests."""
        assert images_digest([PNG]) != images_digest([PNG, PNG])

    def test_strengths(self):
        """Public hashes are 16 hex characters; internal keys are 64."""
        for value in (compute_image_hash(PNG), compute_images_hash([PNG, OTHER_PNG])):
            assert len(value) == 16 and set(value) <= HEX
        for value in (image_digest(PNG), images_digest([PNG, OTHER_PNG]), images_digest([])):
            assert len(value) == 64 and set(value) <= HEX
        key = MLLMPrefixCacheManager()._make_cache_key([PNG], "p")
        assert len(key) == 64 and set(key) <= HEX

    def test_single_image_instead_of_list_is_invalid(self):
        """A bare string or bytes is refused rather than split into characters."""
        with pytest.raises(InvalidInput):
            compute_images_hash("https://example.invalid/a.png")
        with pytest.raises(InvalidInput):
            images_digest(PNG)
        with pytest.raises(InvalidInput):
            compute_images_hash(7)

    @settings(max_examples=examples(60), deadline=None)
    @given(
        st.lists(st.binary(min_size=1, max_size=8), min_size=2, max_size=5, unique=True).flatmap(
            lambda imgs: st.tuples(st.just(imgs), st.permutations(range(len(imgs))))
        )
    )
    def test_permutation_changes_key_unless_identity(self, case):
        """Reordering distinct images changes the full key exactly when the order changes."""
        images, order = case
        permuted = [images[i] for i in order]
        same = list(order) == list(range(len(images)))
        assert (images_digest(permuted) == images_digest(images)) == same
        mgr = MLLMPrefixCacheManager()
        assert (mgr._make_cache_key(permuted, "p") == mgr._make_cache_key(images, "p")) == same


class TestStatsAndEntry:
    def test_stats_to_dict_has_seed_keys(self):
        """to_dict reports the seed's keys with the derived hit rate."""
        stats = MLLMCacheStats(hits=1, misses=1, total_queries=4)
        assert stats.to_dict() == {
            "hits": 1, "misses": 1, "partial_hits": 0, "hit_rate": 0.25, "tokens_saved": 0,
            "image_cache_hits": 0, "vision_encoder_skips": 0, "total_queries": 4, "evictions": 0,
        }
        assert MLLMCacheStats().hit_rate == 0.0

    def test_entry_sizes_and_prefix(self):
        """An entry counts its tokens, its arrays' bytes and its shared prefix."""
        kv = _kv(3, heads=2, dim=8)
        entry = MLLMPrefixCacheEntry(
            image_hash="i", prompt_hash="p", vision_embeddings=_embeddings(0.5),
            kv_cache=kv, token_ids=[1, 2, 3],
        )
        assert entry.total_tokens == 3
        assert entry.memory_size == MIB // 2 + kv[0].keys.nbytes + kv[0].values.nbytes
        assert entry.get_prefix_match_length([1, 2, 9, 9]) == 2
        assert entry.get_prefix_match_length([1, 2, 3, 4]) == 3
        assert entry.get_prefix_match_length([]) == 0
        assert entry.created_at == 0  # no wall clock

    def test_aliases(self):
        """The MLLM*/VLM* aliases name the seed's classes."""
        assert mllm.MLLMCacheManager is MLLMPrefixCacheManager
        assert mllm.VLMCacheManager is MLLMPrefixCacheManager
        assert mllm.VLMPrefixCacheManager is MLLMPrefixCacheManager
        assert mllm.VLMCacheStats is MLLMCacheStats
        assert mllm.VLMPrefixCacheEntry is MLLMPrefixCacheEntry
        assert mllm.VLMCacheEntry is MLLMPrefixCacheEntry


class TestManagerFetch:
    def test_defaults_and_bad_bounds(self):
        """Defaults are 50 entries and 2048 MiB; non-positive bounds are refused."""
        mgr = MLLMPrefixCacheManager()
        assert mgr.max_size == 50 and mgr.max_memory == 2048 * MIB
        for kwargs in ({"max_entries": 0}, {"max_entries": 2.0}, {"max_memory_mb": 0},
                       {"max_memory_mb": -1}, {"max_memory_mb": float("inf")},
                       {"max_entries": True}):
            with pytest.raises(InvalidInput):
                MLLMPrefixCacheManager(**kwargs)

    def test_scripted_sequence_stats(self):
        """A miss, a full hit, a diverging hit and an image-only hit count as the seed does."""
        mgr = MLLMPrefixCacheManager()
        assert mgr.fetch([PNG], "describe", [1, 2, 3, 4]) == (None, 0)
        mgr.store([PNG], "describe", _embeddings(0.001), _kv(4), [1, 2, 3, 4], num_image_tokens=2)

        entry, n = mgr.fetch([PNG], "describe", [1, 2, 3, 4, 5])
        assert n == 4 and entry.hit_count == 1 and entry.num_text_tokens == 2
        entry, n = mgr.fetch([PNG], "describe", [1, 2, 7])
        assert n == 2 and entry.hit_count == 2
        entry, n = mgr.fetch([PNG], "describe", np.array([1, 2, 3, 4]))
        assert n == 4
        entry, n = mgr.fetch([PNG], "another prompt", [1, 2, 3, 4])
        assert n == 0 and entry is not None and entry.vision_embeddings is not None
        stats = mgr.get_stats()
        assert {k: stats[k] for k in mgr.stats.to_dict()} == {
            "hits": 3, "misses": 1, "partial_hits": 2, "hit_rate": 0.6, "tokens_saved": 10,
            "image_cache_hits": 3, "vision_encoder_skips": 4, "total_queries": 5, "evictions": 0,
        }
        mgr.check_invariants()

    def test_text_only_entries(self):
        """Without images there is no image-only match and no image hit count."""
        mgr = MLLMPrefixCacheManager()
        mgr.store([], "hello", None, _kv(2), [5, 6])
        assert mgr.fetch([], "hello")[1] == 2
        assert mgr.fetch([], "bye") == (None, 0)
        stats = mgr.get_stats()
        assert stats["image_cache_hits"] == 0 and stats["vision_encoder_skips"] == 0
        assert stats["hits"] == 1 and stats["misses"] == 1

    def test_image_only_match_needs_same_order_and_embeddings(self):
        """Vision embeddings are reused only for the same images in the same order."""
        mgr = MLLMPrefixCacheManager()
        mgr.store([PNG, OTHER_PNG], "p", _embeddings(0.001), _kv(2), [1, 2])
        mgr.store([OTHER_PNG], "p", None, _kv(2), [1, 2])  # no embeddings to reuse
        assert mgr.fetch([OTHER_PNG, PNG], "q") == (None, 0)
        assert mgr.fetch([OTHER_PNG], "q") == (None, 0)
        entry, n = mgr.fetch([PNG, OTHER_PNG], "q")
        assert entry is not None and n == 0

    def test_file_and_data_url_share_an_entry(self, tmp_path):
        """An image stored by path is found when the request sends it as a data URL."""
        path = tmp_path / "img.png"
        path.write_bytes(PNG)
        mgr = MLLMPrefixCacheManager()
        mgr.store([str(path)], "p", None, _kv(2), [1, 2])
        data_url = "data:image/png;base64," + base64.b64encode(PNG).decode()
        assert mgr.fetch([data_url], "p")[1] == 2

    def test_fetched_entry_is_detached(self):
        """Decoding into a fetched KV cache or editing the entry leaves the stored one intact."""
        mgr = MLLMPrefixCacheManager()
        mine = _kv(4)
        mgr.store([PNG], "p", _embeddings(0.001), mine, [1, 2, 3, 4])
        mine[0].update_and_fetch(mx.ones((1, 1, 4, 4)), mx.ones((1, 1, 4, 4)))  # caller goes on
        entry, _ = mgr.fetch([PNG], "p")
        layer = entry.kv_cache[0]
        layer.trim(2)
        layer.update_and_fetch(mx.ones((1, 1, 2, 4)), mx.ones((1, 1, 2, 4)))
        entry.token_ids.append(99)
        entry.kv_cache.append("junk")

        again, n = mgr.fetch([PNG], "p")
        assert n == 4 and len(again.kv_cache) == 1 and again.token_ids == [1, 2, 3, 4]
        stored = again.kv_cache[0]
        assert stored is not layer and stored.offset == 4
        assert mx.array_equal(stored.keys[..., :4, :], mx.zeros((1, 1, 4, 4))).item()

    def test_bad_input_is_refused_uncounted(self):
        """Bad prompt, token ids, images or salt raise InvalidInput and count nothing."""
        mgr = MLLMPrefixCacheManager()
        mgr.store([PNG], "p", None, _kv(2), [1, 2])
        for args, kwargs in (
            (([PNG], 5), {}),
            (([PNG], "p", ["a"]), {}),
            (([PNG], "p", [1.5]), {}),
            (([PNG], "p", "12"), {}),
            ((PNG, "p"), {}),
            (([PNG], "p"), {"cache_salt": 3}),
        ):
            with pytest.raises(InvalidInput):
                mgr.fetch(*args, **kwargs)
        assert mgr.stats == MLLMCacheStats()


class TestManagerStore:
    def test_lru_by_count(self):
        """Past max_entries the least recently used entry goes, and is counted."""
        mgr = MLLMPrefixCacheManager(max_entries=2)
        mgr.store([PNG], "a", None, _kv(1), [1])
        mgr.store([PNG], "b", None, _kv(1), [1])
        mgr.fetch([PNG], "a")
        mgr.store([PNG], "c", None, _kv(1), [1])
        assert len(mgr) == 2 and mgr.stats.evictions == 1
        assert mgr.fetch([PNG], "b") == (None, 0)
        assert mgr.fetch([PNG], "a")[0] is not None and mgr.fetch([PNG], "c")[0] is not None
        mgr.check_invariants()

    def test_lru_by_memory(self):
        """Entries are evicted oldest first until the new entry's bytes fit."""
        mgr = MLLMPrefixCacheManager(max_memory_mb=3)
        for prompt in "abc":
            mgr.store([PNG], prompt, _embeddings(1), [], [1])
        assert mgr.get_stats()["memory_used_mb"] == 3.0
        mgr.fetch([PNG], "a")
        mgr.store([PNG], "d", _embeddings(1.5), [], [1])
        assert mgr.stats.evictions == 2
        assert [p for p in "abcd" if mgr.fetch([PNG], p)[1] == 1] == ["a", "d"]
        assert mgr.get_stats()["memory_used_mb"] == 2.5
        mgr.check_invariants()

    def test_memory_counts_kv_arrays(self):
        """KV layers count with the bytes of their buffers."""
        mgr = MLLMPrefixCacheManager()
        kv = _kv(10, heads=2, dim=16)
        mgr.store([], "p", None, kv, list(range(10)))
        assert mgr._current_memory == kv[0].keys.nbytes + kv[0].values.nbytes > 0

    def test_entry_over_budget_is_refused(self):
        """An entry bigger than the whole budget is not stored and evicts nothing."""
        mgr = MLLMPrefixCacheManager(max_memory_mb=2)
        mgr.store([PNG], "small", _embeddings(1), [], [1])
        mgr.store([PNG], "huge", _embeddings(3), [], [1])
        assert len(mgr) == 1 and mgr.stats.evictions == 0
        assert mgr.fetch([PNG], "small")[1] == 1
        mgr.check_invariants()

    def test_restore_replaces_without_double_counting(self):
        """Storing the same images and prompt again replaces the entry and its bytes."""
        mgr = MLLMPrefixCacheManager(max_memory_mb=4)
        mgr.store([PNG], "p", _embeddings(1), [], [1])
        mgr.store([PNG], "p", _embeddings(2), [], [1, 2])
        assert len(mgr) == 1 and mgr.stats.evictions == 0
        assert mgr.get_stats()["memory_used_mb"] == 2.0
        assert mgr.fetch([PNG], "p")[1] == 2
        mgr.check_invariants()

    def test_created_at_is_a_logical_tick(self):
        """Each store stamps the next value of a counter, not the time."""
        mgr = MLLMPrefixCacheManager()
        mgr.store([], "a", None, [], [1])
        mgr.store([], "b", None, [], [1])
        a, b = mgr.fetch([], "a")[0], mgr.fetch([], "b")[0]
        assert (a.created_at, b.created_at) == (1, 2)

    def test_bad_store_input_changes_nothing(self):
        """Malformed stores raise InvalidInput and leave the cache as it was."""
        mgr = MLLMPrefixCacheManager()
        for args, kwargs in (
            (([PNG], "p", None, _kv(1), [1, 2]), {"num_image_tokens": 3}),
            (([PNG], "p", None, _kv(1), [1, 2]), {"num_image_tokens": -1}),
            (([PNG], "p", None, KVCache(), [1]), {}),
            (([PNG], "p", None, _kv(1), ["x"]), {}),
            (([PNG], None, None, _kv(1), [1]), {}),
            (([PNG], "p", None, _kv(1), [1]), {"cache_salt": b"s"}),
        ):
            with pytest.raises(InvalidInput):
                mgr.store(*args, **kwargs)
        assert len(mgr) == 0 and mgr._current_memory == 0


class TestSaltIsolation:
    def test_different_salts_never_share(self):
        """An entry stored under one salt is invisible under another salt or none."""
        mgr = MLLMPrefixCacheManager()
        mgr.store([PNG], "p", _embeddings(0.001), _kv(2), [1, 2], cache_salt="tenant-a")
        assert mgr.fetch([PNG], "p", cache_salt="tenant-b") == (None, 0)
        assert mgr.fetch([PNG], "p") == (None, 0)
        assert mgr.fetch([PNG], "other", cache_salt="tenant-b") == (None, 0)  # no image reuse
        assert mgr.fetch_cache([PNG], "p", cache_salt="tenant-b") == (None, False)
        assert mgr.fetch([PNG], "p", cache_salt="tenant-a")[1] == 2
        assert mgr.fetch([PNG], "other", cache_salt="tenant-a")[0] is not None

    def test_salts_key_separately(self):
        """Each salt, and no salt, gives its own entry key."""
        mgr = MLLMPrefixCacheManager()
        keys = {mgr._make_cache_key([PNG], "p", cache_salt=s) for s in (None, "", "a", "b")}
        assert len(keys) == 4
        scopes = {mgr._make_image_only_key([PNG], cache_salt=s) for s in (None, "a")}
        assert len(scopes) == 2


class TestLegacyAndBookkeeping:
    def test_legacy_store_and_fetch(self):
        """store_cache/fetch_cache round-trip a KV cache; empty caches store nothing."""
        mgr = MLLMPrefixCacheManager()
        mgr.store_cache([PNG], "p", None)
        mgr.store_cache([PNG], "p", [])
        assert len(mgr) == 0
        kv = _kv(3)
        mgr.store_cache([PNG], "p", kv, num_tokens=3)
        cache, hit = mgr.fetch_cache([PNG], "p")
        assert hit and len(cache) == 1 and cache[0] is not kv[0] and cache[0].offset == 3
        assert mgr.fetch_cache([PNG], "q") == (None, False)
        with pytest.raises(InvalidInput):
            mgr.store_cache([PNG], "p", kv, num_tokens=-1)

    def test_legacy_fetch_ignores_image_only_matches(self):
        """fetch_cache never serves another prompt's KV cache as a hit."""
        mgr = MLLMPrefixCacheManager()
        mgr.store([PNG], "p", _embeddings(0.001), _kv(2), [1, 2])
        assert mgr.fetch_cache([PNG], "q") == (None, False)
        assert mgr.stats.partial_hits == 1

    def test_get_stats_keys_repr_len_clear(self):
        """get_stats adds occupancy; repr, len, reset_stats and clear behave as in the seed."""
        mgr = MLLMPrefixCacheManager(max_entries=5, max_memory_mb=8)
        mgr.store([PNG], "p", _embeddings(1.5), [], [1])
        mgr.fetch([PNG], "p")
        stats = mgr.get_stats()
        assert set(stats) == set(MLLMCacheStats().to_dict()) | {
            "entries", "max_entries", "memory_used_mb", "max_memory_mb",
        }
        assert (stats["entries"], stats["max_entries"]) == (1, 5)
        assert (stats["memory_used_mb"], stats["max_memory_mb"]) == (1.5, 8.0)
        assert repr(mgr) == "<MLLMPrefixCacheManager entries=1 memory=1.5MB>"
        assert len(mgr) == 1
        mgr.reset_stats()
        assert mgr.stats == MLLMCacheStats() and len(mgr) == 1
        mgr.fetch([PNG], "p")
        mgr.clear()
        assert len(mgr) == 0 and mgr.stats == MLLMCacheStats()
        assert repr(mgr) == "<MLLMPrefixCacheManager entries=0 memory=0.0MB>"
        mgr.check_invariants()

    def test_random_workload_keeps_invariants(self):
        """A mixed sequence of stores, fetches and evictions keeps the bookkeeping exact."""
        mgr = MLLMPrefixCacheManager(max_entries=4, max_memory_mb=1)
        images = [[PNG], [OTHER_PNG], [PNG, OTHER_PNG], []]
        for i, (imgs, prompt, salt) in enumerate(
            itertools.islice(itertools.cycle(itertools.product(images, "ab", (None, "s"))), 60)
        ):
            if i % 3:
                mgr.fetch(imgs, prompt, [1, 2], cache_salt=salt)
            else:
                emb = _embeddings(0.3) if i % 2 else None
                mgr.store(imgs, prompt, emb, _kv(2), [1, 2, 3], cache_salt=salt)
            mgr.check_invariants()
        assert mgr.stats.evictions > 0


class TestCheckInvariants:
    @pytest.mark.parametrize(
        "corrupt, message",
        [
            (lambda mgr: setattr(mgr, "max_size", 1), "max_size"),
            (lambda mgr: setattr(mgr, "max_memory", 1), "budget"),
            (lambda mgr: setattr(mgr, "_current_memory", mgr._current_memory - 1), "drifted"),
            (lambda mgr: mgr._by_images.clear(), "image index"),
            (lambda mgr: next(iter(mgr._by_images.values())).clear(), "image index"),
        ],
    )
    def test_corruption_is_reported(self, corrupt, message):
        """Each broken invariant raises InvariantViolation naming it."""
        mgr = MLLMPrefixCacheManager()
        mgr.store([PNG], "p", _embeddings(0.01), _kv(2), [1, 2])
        mgr.store([OTHER_PNG], "p", _embeddings(0.01), _kv(2), [1, 2])
        mgr.check_invariants()
        corrupt(mgr)
        with pytest.raises(InvariantViolation, match=message):
            mgr.check_invariants()

    def test_checks_survive_python_o(self, run_optimized):
        """Under python -O (asserts stripped) a corrupted manager is still reported."""
        script = (
            "from mlxkv.cache.errors import InvariantViolation\n"
            "from mlxkv.cache.mllm import MLLMPrefixCacheManager\n"
            "assert False, 'asserts must be stripped'\n"
            "mgr = MLLMPrefixCacheManager()\n"
            "mgr.store([b'img'], 'p', None, [], [1])\n"
            "mgr._current_memory += 1\n"
            "try:\n"
            "    mgr.check_invariants()\n"
            "except InvariantViolation as error:\n"
            "    print('reported:', error)\n"
        )
        done = run_optimized(script)
        assert done.stdout.startswith("reported: byte count")
