"""Shared prefixes in memory: the cache classes hold suffixes only and batch them."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache

from mlxkv.cache.shared_prefix import (
    BatchSharedPrefixCache,
    PrefixGroup,
    PrefixGroups,
    SharedPrefixCache,
    suffix_cache,
)

from graph_ops import primitives, working
from model_blocks import block_payloads


class TestCaches:
    def test_a_group_is_found_by_its_blocks_and_shared(self, tiny_llama):
        """A request whose payloads begin with a live group's blocks shares
        that group (as many blocks as match); other payloads make a new one;
        a group lives only while something refers to it."""
        model, _ = tiny_llama
        payloads = block_payloads(model, list(range(64)), 16)
        groups = PrefixGroups()
        first, shared = groups.take(payloads)
        assert shared == 4 and len(groups) == 1 and first.num_tokens == 64
        again, shared = groups.take(payloads[:2])
        assert again is first and shared == 2
        other, shared = groups.take(block_payloads(model, list(range(100, 132)), 16))
        assert other is not first and shared == 2 and len(groups) == 2
        del first, again, other
        import gc

        gc.collect()
        assert len(groups) == 0

    def test_a_request_holds_only_its_suffix(self, tiny_llama):
        """Over a shared prefix, a request's own cache is its suffix: its
        offset counts the prefix, update_and_fetch returns the suffix only."""
        model, _ = tiny_llama
        payloads = block_payloads(model, list(range(64)), 16)
        group = PrefixGroup.build(payloads)
        (suffix, *_rest) = suffix_cache((), 8, 2)
        cache = SharedPrefixCache(group, 0, 48, suffix)
        assert cache.offset == 48 and cache.nbytes == 0
        k = mx.zeros((1, 2, 3, 16))
        keys, values = cache.update_and_fetch(k, k)
        assert keys.shape[2] == 3 and cache.offset == 51
        plain = cache.to_plain()
        assert isinstance(plain, KVCache) and plain.offset == 51
        np.testing.assert_array_equal(np.array(plain.keys[..., :48, :]), np.array(group.keys[0][..., :48, :]))

    def test_a_plain_run_with_room_copies_prefix_and_suffix_once(self, tiny_llama):
        """``to_plain(extra)``: prefix then own tokens in one buffer with room for
        ``extra`` more (whole suffix steps), growing by a suffix's step; no
        prefix: the suffix itself."""
        from mlxkv.cache.shared_prefix import SUFFIX_STEP

        model, _ = tiny_llama
        group = PrefixGroup.build(block_payloads(model, list(range(64)), 16))
        (suffix, *_rest) = suffix_cache((), 8, 2)
        own = mx.ones((1, 2, 5, 16)) * 3
        suffix.update_and_fetch(own, own)
        plain = SharedPrefixCache(group, 0, 48, suffix).to_plain(20)
        assert plain.offset == 53 and plain.step == SUFFIX_STEP
        assert plain.keys.shape[2] % SUFFIX_STEP == 0 and plain.keys.shape[2] >= 73
        np.testing.assert_array_equal(np.array(plain.keys[..., :48, :]), np.array(group.keys[0][..., :48, :]))
        np.testing.assert_array_equal(np.array(plain.values[..., 48:53, :]), np.array(own))
        keys, _ = plain.update_and_fetch(own[..., :1, :], own[..., :1, :])
        assert keys.shape[2] == 54 and plain.keys.shape[2] >= 73  # written in place, not grown
        assert SharedPrefixCache(None, 0, 0, suffix).to_plain(20) is suffix

    def test_batches_merge_filter_extend_and_extract_suffixes(self, tiny_llama):
        """A batch of requests over prefixes keeps each row's group and prefix
        length; merging writes the rows into one buffer; filtering, extending
        and extracting move suffixes only; the batch's buffer stays whole
        suffix steps long (mlx-lm's trims it to
        the rows' longest on filter: a stacked decode step's shapes would
        change with every row that leaves)."""
        from mlxkv.cache.shared_prefix import SUFFIX_STEP

        model, _ = tiny_llama
        group = PrefixGroup.build(block_payloads(model, list(range(64)), 16))
        caches = []
        for n, own in ((64, 3), (32, 5), (0, 7)):
            suffix = KVCache()
            suffix.update_and_fetch(mx.ones((1, 2, own, 16)) * own, mx.ones((1, 2, own, 16)))
            caches.append(SharedPrefixCache(group if n else None, 0, n, suffix))
        batch = SharedPrefixCache.merge(caches)
        assert isinstance(batch, BatchSharedPrefixCache)
        # The rows written into one buffer of whole steps: no second, longer one.
        assert "Concatenate" not in primitives(batch.suffix.keys, batch.suffix.values)
        assert np.array(batch.offset).tolist() == [67, 37, 7]
        assert [rows for rows, *_ in batch.segments()] == [[0, 1]]
        whole = lambda: batch.suffix.keys.shape[2] % SUFFIX_STEP == batch.suffix.values.shape[2] % SUFFIX_STEP == 0  # noqa: E731
        assert whole()
        mx.eval(batch.suffix.keys, batch.suffix.values)
        batch.filter(mx.array([0, 1]))  # mlx-lm's filter cuts the rows' common left padding (2)
        assert np.array(batch.offset).tolist() == [67, 37] and whole()
        # The kept rows taken in one gather a side, not a gather and then a copy to whole steps.
        assert "Concatenate" not in primitives(batch.suffix.keys, batch.suffix.values)
        more = SharedPrefixCache.merge([caches[0]])
        batch.extend(more)
        assert np.array(batch.offset).tolist() == [67, 37, 67] and whole()
        assert np.array(batch.extract(1).suffix.state[0]).tolist() == np.full((1, 2, 5, 16), 5.0).tolist()
        row = batch.extract(2)
        assert isinstance(row, SharedPrefixCache) and row.group is group and row.num_prefix == 64
        assert row.suffix.offset == 3 and float(row.suffix.keys[0, 0, 0, 0]) == 3.0

    def test_the_offset_is_made_on_the_host_once_a_step(self, tiny_llama):
        """A layer reads a batch's offset twice (its queries' and its keys'
        positions): one array made from host numbers (no operation on the
        device), the same for every layer of the step, new after a write, a
        trim, a leave or a join; right however mlx-lm's suffix changes its own
        offset (in place here, as an mlx-lm writing ``+=`` would)."""
        model, _ = tiny_llama
        group = PrefixGroup.build(block_payloads(model, list(range(64)), 16))

        def batch_of(rows: tuple[tuple[int, int], ...]) -> BatchSharedPrefixCache:
            caches = []
            for n, own in rows:
                suffix = KVCache()
                suffix.update_and_fetch(mx.ones((1, 2, own, 16)), mx.ones((1, 2, own, 16)))
                caches.append(SharedPrefixCache(group if n else None, 0, n, suffix))
            return SharedPrefixCache.merge(caches)

        batch = batch_of(((64, 3), (32, 5), (0, 7)))
        first = batch.offset
        assert batch.offset is first and first.tolist() == [67, 37, 7]
        assert primitives(first) == []  # no operation to run
        another_layer = batch_of(((64, 3), (32, 5), (0, 7)))
        assert another_layer.offset is first
        step = mx.ones((3, 2, 1, 16))
        batch.update_and_fetch(step, step)
        assert batch.offset.tolist() == [68, 38, 8]
        batch.trim(1)
        assert batch.offset.tolist() == [67, 37, 7]
        batch.filter([0, 2])
        assert batch.offset.tolist() == [67, 7]
        batch.extend(batch_of(((16, 2),)))
        assert batch.offset.tolist() == [67, 7, 18]

        honest = batch.suffix.update_and_fetch

        def in_place(keys: Any, values: Any) -> Any:
            offset = batch.suffix.offset
            out = honest(keys, values)
            offset += keys.shape[2]  # the same array object, its value changed
            batch.suffix.offset = offset
            return out

        batch.suffix.update_and_fetch = in_place
        before = batch.offset
        batch.update_and_fetch(step, step)
        assert batch.suffix.offset is not None and batch.offset.tolist() == [68, 8, 19]
        assert before.tolist() == [67, 7, 18]
        # The suffix's own offset is host-made too: no sum queued behind it a step.
        assert batch.suffix.offset.tolist() == [4, 8, 3] and primitives(batch.suffix.offset) == []

    def test_the_rows_as_host_numbers_follow_every_change(self, tiny_llama):
        """``batch_rows``: each row's index in ``segments()`` (-1: no prefix),
        prefix length and padding as tuples, the same object until the rows or
        the padding are replaced, equal (not the same) in another layer's
        cache of the same rows, and made anew after a leave, a join and a
        prefill's padding (a step's layers key their work by it)."""
        model, _ = tiny_llama
        groups = [PrefixGroup.build(block_payloads(model, list(range(start, start + 64)), 16)) for start in (0, 100)]

        def batch_of(rows: tuple[tuple[int, int, int], ...]) -> BatchSharedPrefixCache:
            caches = []
            for g, n, own in rows:
                suffix = KVCache()
                suffix.update_and_fetch(mx.ones((1, 2, own, 16)), mx.ones((1, 2, own, 16)))
                caches.append(SharedPrefixCache(groups[g] if n else None, 0, n, suffix))
            return SharedPrefixCache.merge(caches)

        def agrees(batch: BatchSharedPrefixCache) -> Any:
            rows = batch.batch_rows()
            assert rows.prefix == tuple(n for _, n in batch.rows) and rows.padding == tuple(batch.padding)
            seen = [-1] * len(batch.rows)
            for index, (members, *_) in enumerate(batch.segments()):
                for row in members:
                    seen[row] = index
            assert rows.segment == tuple(seen)
            return rows

        batch = batch_of(((1, 32, 3), (0, 0, 5), (0, 64, 2)))
        first = agrees(batch)
        assert first == ((0, -1, 1), (32, 0, 64), (2, 0, 3))
        assert batch.batch_rows() is first
        another_layer = batch_of(((1, 32, 3), (0, 0, 5), (0, 64, 2)))
        assert another_layer.batch_rows() == first and another_layer.batch_rows() is not first
        step = mx.ones((3, 2, 1, 16))
        batch.update_and_fetch(step, step)
        assert batch.batch_rows() is first  # a write changes no row
        batch.filter([2, 0])
        assert agrees(batch).segment == (0, 1) and batch.batch_rows().prefix == (64, 32)
        batch.extend(batch_of(((1, 16, 2), (0, 0, 1))))
        assert agrees(batch).segment == (0, 1, 1, -1)
        before = batch.batch_rows()
        batch.prepare(right_padding=[0, 1, 0, 2], lengths=[3, 2, 3, 1])
        assert batch.batch_rows() is before  # the padding moves when the prefill is finalized
        batch.finalize()
        assert agrees(batch).padding == tuple(n + extra for n, extra in zip(before.padding, (0, 1, 0, 2)))

    def test_a_row_taken_out_without_a_copy_views_the_batch(self, tiny_llama):
        """``extract(copy=False)`` gives a row's suffix as the copy does, as
        views of the batch's buffer (nothing of their own to run); the
        default copies it (what a kept cache holds must not pin the batch's
        buffer)."""
        model, _ = tiny_llama
        group = PrefixGroup.build(block_payloads(model, list(range(64)), 16))
        caches = []
        for n, own in ((64, 3), (32, 5)):
            suffix = KVCache()
            suffix.update_and_fetch(mx.ones((1, 2, own, 16)) * own, mx.ones((1, 2, own, 16)) * -own)
            caches.append(SharedPrefixCache(group, 0, n, suffix))
        batch = SharedPrefixCache.merge(caches)
        mx.eval(batch.suffix.keys, batch.suffix.values)
        for row, own in ((0, 3), (1, 5)):
            view, copied = batch.extract(row, copy=False).suffix, batch.extract(row).suffix
            assert working(primitives(view.keys, view.values)) == 0
            assert primitives(copied.keys, copied.values).count("Contiguous") == 2
            assert view.offset == copied.offset == own
            for mine, theirs in ((view.keys, copied.keys), (view.values, copied.values)):
                assert mine.shape == theirs.shape == (1, 2, own, 16) and mx.array_equal(mine, theirs).item()

    def test_a_batch_suffix_grows_ahead_of_the_step_that_needs_room(self, tiny_llama):
        """``reserve`` grows the rows' suffixes only when the next tokens would
        not fit, keeps what they hold, and the step then writes in place."""
        model, _ = tiny_llama
        group = PrefixGroup.build(block_payloads(model, list(range(64)), 16))
        caches = []
        for own in (3, 5):
            suffix = KVCache()
            suffix.update_and_fetch(mx.ones((1, 2, own, 16)) * own, mx.ones((1, 2, own, 16)))
            caches.append(SharedPrefixCache(group, 0, 64, suffix))
        batch = SharedPrefixCache.merge(caches)
        held = np.array(batch.suffix.keys[..., : batch.suffix._idx, :])
        room = batch.suffix.keys.shape[2] - batch.suffix._idx
        assert room > 0 and batch.reserve(room) == []
        grown = batch.reserve(room + 1)
        assert len(grown) == 2 and batch.suffix.keys.shape[2] >= batch.suffix._idx + room + 1
        np.testing.assert_array_equal(np.array(batch.suffix.keys[..., : batch.suffix._idx, :]), held)
        keys = batch.suffix.keys
        batch.update_and_fetch(mx.zeros((2, 2, room + 1, 16)), mx.zeros((2, 2, room + 1, 16)))
        assert batch.suffix.keys.shape == keys.shape  # no growth inside the step
        assert np.array(batch.offset).tolist() == [64 + own + room + 1 for own in (3, 5)]

    def test_a_cut_into_the_prefix_keeps_whole_blocks(self, tiny_llama):
        """Cut back into its prefix, a cache keeps the whole blocks as its
        prefix and copies the partial block's tokens into its suffix."""
        model, _ = tiny_llama
        group = PrefixGroup.build(block_payloads(model, list(range(64)), 16))
        cache = SharedPrefixCache(group, 1, 64, KVCache())
        cut = cache.cut(40, 16)
        assert (cut.num_prefix, cut.suffix.offset, cut.offset) == (32, 8, 40)
        np.testing.assert_array_equal(
            np.array(cut.suffix.keys[..., :8, :]), np.array(group.keys[1][..., 32:40, :])
        )




class TestPaddingOnTheHost:
    """A batch keeps its rows' left padding on the host (mlx-lm's filter and
    extract read it back from the device: a wait for every step queued)."""

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.data())
    def test_it_always_equals_the_suffixs_and_cuts_and_extracts_as_mlx_lm_does(self, tiny_llama, data):
        """Rows of any suffix lengths merged, then any run of leaves (any rows
        kept), joins (another merged batch) and right-padded prefills (rolled
        into the left padding by ``finalize``): the host padding equals the
        suffix's ``left_padding``; each row's tokens and each extracted row
        equal those of an mlx-lm ``BatchKVCache`` put through the same steps
        with its own ``filter`` and ``extract`` (whose rows are left-padded
        up to a step less: its ``filter`` cuts further, to no common padding,
        where this cache keeps its buffer whole steps); and a decode step's
        write, into reserved room or growing the buffer, returns mlx-lm's
        keys and values."""
        import copy

        from mlxkv.cache.shared_prefix import SUFFIX_STEP

        model, _ = tiny_llama
        group = PrefixGroup.build(block_payloads(model, list(range(32)), 16))
        counter = [0]

        def rows(n: int) -> BatchSharedPrefixCache:
            caches = []
            for _ in range(n):
                own = data.draw(st.integers(0, 9))
                counter[0] += 1
                suffix = KVCache()
                if own:
                    k = mx.arange(own * 4, dtype=mx.float32).reshape(1, 1, own, 4) + 100 * counter[0]
                    suffix.update_and_fetch(k, k)
                caches.append(SharedPrefixCache(group, 0, 32, suffix))
            return SharedPrefixCache.merge(caches)

        def twin_of(suffix: Any) -> Any:
            """An mlx-lm batch cache of its own (``+=`` on an MLX array changes it in place)."""
            twin = copy.copy(suffix)
            twin.left_padding, twin.offset = mx.array(suffix.left_padding), mx.array(suffix.offset)
            return twin

        def same(batch: BatchSharedPrefixCache, twin: Any) -> None:
            assert batch.padding == batch.suffix.left_padding.tolist()
            # A leave cuts up to a step less padding than mlx-lm's (the buffer stays whole steps).
            extra = [mine - theirs for mine, theirs in zip(batch.padding, twin.left_padding.tolist())]
            assert len(set(extra)) == 1 and 0 <= extra[0] < SUFFIX_STEP
            assert batch.suffix._idx == twin._idx + extra[0]
            if twin.keys is not None and twin._idx:
                assert batch.suffix.keys.shape[2] % SUFFIX_STEP == 0
                np.testing.assert_array_equal(
                    np.array(batch.suffix.keys[..., extra[0] : batch.suffix._idx, :]),
                    np.array(twin.keys[..., : twin._idx, :]),
                )
                for i in range(len(batch.padding)):
                    mine, theirs = batch.extract(i).suffix, twin.extract(i)
                    assert mine.offset == theirs.offset
                    np.testing.assert_array_equal(np.array(mine.keys), np.array(theirs.keys))

        batch = rows(data.draw(st.integers(1, 4)))
        twin = twin_of(batch.suffix)
        same(batch, twin)
        for _ in range(data.draw(st.integers(1, 6))):
            step = data.draw(st.sampled_from(["leave", "join", "prefill", "decode"]))
            if step == "leave":
                count = len(batch.padding)
                kept = sorted(data.draw(st.sets(st.integers(0, count - 1), min_size=1, max_size=count)))
                batch.filter(mx.array(kept))
                twin.filter(mx.array(kept))
            elif step == "join":
                more = rows(data.draw(st.integers(1, 3)))
                other = twin_of(more.suffix)
                batch.extend(more)
                twin.extend(other)
            elif step == "decode" and twin.keys is not None:
                # A decode step's write: the buffer's room (reserved, as a step does) or a growth.
                if data.draw(st.booleans()):
                    mx.eval(batch.reserve(1))
                k = mx.full((len(batch.padding), 1, 1, 4), float(data.draw(st.integers(1, 99))))
                v = -k  # not the keys: a write that swaps them fails
                mine, theirs = batch.update_and_fetch(k, v), twin.update_and_fetch(k, v)
                extra = batch.suffix._idx - twin._idx
                for a, b in zip(mine, theirs):
                    np.testing.assert_array_equal(np.array(a[:, :, extra:]), np.array(b))
                assert primitives(batch.suffix.offset) == []  # host-made: no sum queued
            elif twin.keys is not None:
                lengths = [data.draw(st.integers(1, 4)) for _ in batch.padding]
                right = [max(lengths) - n for n in lengths]
                k = mx.ones((len(lengths), 1, max(lengths), 4))
                for cache in (batch, twin):
                    cache.prepare(lengths=lengths, right_padding=right)
                    cache.update_and_fetch(k, k) if cache is twin else cache.suffix.update_and_fetch(k, k)
                    cache.finalize()
            same(batch, twin)
