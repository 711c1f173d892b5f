"""Shared prefixes in memory: the cascade equals fused attention, the cache
classes hold suffixes only and batch them, and the hook routes only them."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxkv.cache import kv_state
from mlxkv.cache.shared_prefix import (
    BatchSharedPrefixCache,
    PrefixGroup,
    PrefixGroups,
    SharedPrefixCache,
    cascade_attention,
    install,
    suffix_cache,
)

TOL = 2e-6


def _fused(q: Any, parts_k: list[Any], parts_v: list[Any], mask: Any = None) -> Any:
    return mx.fast.scaled_dot_product_attention(
        q, mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2), scale=q.shape[-1] ** -0.5, mask=mask
    )


class TestCascadeAttention:
    @settings(max_examples=40, deadline=None)
    @given(
        st.integers(1, 5),  # batch
        st.sampled_from([(2, 2), (4, 2), (4, 1)]),  # heads, kv heads
        st.integers(1, 6),  # query length
        st.integers(0, 2),  # groups
        st.data(),
    )
    def test_equals_fused_attention_over_the_concatenation(self, batch, heads, length, num_groups, data):
        """Rows in any prefix groups, each seeing any leading part of its
        group's prefix, decoding or prefilling (causal over the suffix):
        the cascade equals fused attention over each row's prefix + suffix."""
        heads, kv_heads = heads
        seed = data.draw(st.integers(0, 2**16))
        rng = np.random.default_rng(seed)
        dim, suffix = 8, length + data.draw(st.integers(0, 5))
        q = mx.array(rng.standard_normal((batch, heads, length, dim)), dtype=mx.float32)
        ks = mx.array(rng.standard_normal((batch, kv_heads, suffix, dim)), dtype=mx.float32)
        vs = mx.array(rng.standard_normal((batch, kv_heads, suffix, dim)), dtype=mx.float32)
        owner = [data.draw(st.integers(-1, num_groups - 1)) for _ in range(batch)]
        segments = []
        prefixes = []
        for g in range(num_groups):
            size = data.draw(st.integers(1, 600))
            kp = mx.array(rng.standard_normal((1, kv_heads, size, dim)), dtype=mx.float32)
            vp = mx.array(rng.standard_normal((1, kv_heads, size, dim)), dtype=mx.float32)
            rows = [b for b in range(batch) if owner[b] == g]
            lengths = [data.draw(st.integers(1, size)) for _ in rows]
            prefixes.append((kp, vp, dict(zip(rows, lengths))))
            if rows:
                segments.append((rows, kp, vp, lengths))
        mask = "causal" if length > 1 else None
        out = cascade_attention(q, ks, vs, mask, dim**-0.5, segments)
        for b in range(batch):
            parts_k, parts_v = [], []
            if owner[b] >= 0:
                kp, vp, lengths = prefixes[owner[b]]
                parts_k.append(kp[:, :, : lengths[b]])
                parts_v.append(vp[:, :, : lengths[b]])
            full_mask = None
            if length > 1:
                seen = sum(p.shape[2] for p in parts_k) + suffix
                full_mask = mx.arange(seen - length, seen)[:, None] >= mx.arange(seen)[None]
            expected = _fused(q[b : b + 1], [*parts_k, ks[b : b + 1]], [*parts_v, vs[b : b + 1]], full_mask)
            np.testing.assert_allclose(np.array(out[b : b + 1]), np.array(expected), atol=TOL, rtol=0)

    @pytest.mark.parametrize("mask_kind", ["causal", "bool", "additive"])
    def test_one_rows_prefill_over_part_of_its_prefix_equals_fused_attention(self, mask_kind):
        """A lone row's prefill chunk (the fused path over prefix + suffix), with
        the model's mask as a string, a boolean or an additive array."""
        rng = np.random.default_rng(11)
        heads, kv_heads, dim, size, seen, length, suffix = 4, 2, 8, 200, 150, 5, 7
        q = mx.array(rng.standard_normal((1, heads, length, dim)), dtype=mx.float32)
        ks = mx.array(rng.standard_normal((1, kv_heads, suffix, dim)), dtype=mx.float32)
        vs = mx.array(rng.standard_normal((1, kv_heads, suffix, dim)), dtype=mx.float32)
        kp = mx.array(rng.standard_normal((1, kv_heads, size, dim)), dtype=mx.float32)
        vp = mx.array(rng.standard_normal((1, kv_heads, size, dim)), dtype=mx.float32)
        causal = mx.arange(suffix - length, suffix)[:, None] >= mx.arange(suffix)[None]
        mask = {
            "causal": "causal",
            "bool": causal[None, None],
            "additive": mx.where(causal, 0.0, -mx.inf)[None, None],
        }[mask_kind]
        out = cascade_attention(q, ks, vs, mask, dim**-0.5, [([0], kp, vp, [seen])])
        total = seen + suffix
        full = mx.arange(total - length, total)[:, None] >= mx.arange(total)[None]
        expected = _fused(q, [kp[:, :, :seen], ks], [vp[:, :, :seen], vs], full)
        np.testing.assert_allclose(np.array(out), np.array(expected), atol=TOL, rtol=0)

    @pytest.mark.parametrize("padded", [False, True])
    @pytest.mark.parametrize(
        "seen",
        [[300] * 5, [256, 300, 64, 256, 128], [256] * 5],
        ids=["whole-prefix", "mixed-lengths", "all-short-of-the-whole"],
    )
    def test_a_decode_step_of_one_group_equals_fused_attention(self, padded, seen):
        """A decode step -- every row one query over one group's prefix (all of
        it, or only its first blocks: rows seeing different lengths of it),
        rows left-padded in their suffix or not -- equals fused attention over
        each row's part of the prefix and its suffix."""
        rng = np.random.default_rng(7)
        batch, heads, kv_heads, dim, size, suffix = 5, 4, 2, 8, 300, 9
        q = mx.array(rng.standard_normal((batch, heads, 1, dim)), dtype=mx.float32)
        ks = mx.array(rng.standard_normal((batch, kv_heads, suffix, dim)), dtype=mx.float32)
        vs = mx.array(rng.standard_normal((batch, kv_heads, suffix, dim)), dtype=mx.float32)
        kp = mx.array(rng.standard_normal((1, kv_heads, size, dim)), dtype=mx.float32)
        vp = mx.array(rng.standard_normal((1, kv_heads, size, dim)), dtype=mx.float32)
        pads = [0, 3, 1, 8, 0] if padded else [0] * batch
        mask = mx.array([[[[j >= pad for j in range(suffix)]]] for pad in pads]) if padded else None
        out = cascade_attention(q, ks, vs, mask, dim**-0.5, [(list(range(batch)), kp, vp, seen)])
        for b, (pad, n) in enumerate(zip(pads, seen)):
            expected = _fused(q[b : b + 1], [kp[:, :, :n], ks[b : b + 1, :, pad:]], [vp[:, :, :n], vs[b : b + 1, :, pad:]])
            np.testing.assert_allclose(np.array(out[b : b + 1]), np.array(expected), atol=TOL, rtol=0)

    @pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
    def test_a_decode_step_of_several_groups_equals_fused_attention(self, dtype):
        """The step of a batch over several groups -- rows interleaved, one row
        in no group, rows left-padded, groups of different lengths, one row
        seeing only its group's first blocks -- equals fused attention over
        each row's part of its prefix + suffix (in half precision within its
        rounding: the softmax arithmetic is float32 either way)."""
        rng = np.random.default_rng(13)
        batch, heads, kv_heads, dim, suffix = 7, 4, 2, 8, 9
        owner = [0, 1, 0, -1, 2, 1, 0]
        sizes = [300, 45, 128]
        pads = [0, 3, 1, 8, 0, 2, 5]
        as_dtype = getattr(mx, dtype)

        def normal(shape):
            return mx.array(rng.standard_normal(shape), dtype=mx.float32).astype(as_dtype)

        q = normal((batch, heads, 1, dim))
        ks, vs = normal((batch, kv_heads, suffix, dim)), normal((batch, kv_heads, suffix, dim))
        prefixes = [(normal((1, kv_heads, n, dim)), normal((1, kv_heads, n, dim))) for n in sizes]
        seen = [300, 45, 192, 0, 128, 45, 300]  # row 2 sees 192 of its group's 300
        segments = [
            ([b for b in range(batch) if owner[b] == g], kp, vp, [seen[b] for b in range(batch) if owner[b] == g])
            for g, (kp, vp) in enumerate(prefixes)
        ]
        mask = mx.array([[[[j >= pad for j in range(suffix)]]] for pad in pads])
        out = cascade_attention(q, ks, vs, mask, dim**-0.5, segments)
        assert out.dtype == as_dtype
        tolerance = TOL if dtype == "float32" else 2e-2
        for b, pad in enumerate(pads):
            parts_k, parts_v = [], []
            if owner[b] >= 0:
                parts_k.append(prefixes[owner[b]][0][:, :, : seen[b]])
                parts_v.append(prefixes[owner[b]][1][:, :, : seen[b]])
            up = [a.astype(mx.float32) for a in (*parts_k, ks[b : b + 1, :, pad:])]
            vp_up = [a.astype(mx.float32) for a in (*parts_v, vs[b : b + 1, :, pad:])]
            expected = _fused(q[b : b + 1].astype(mx.float32), up, vp_up)
            np.testing.assert_allclose(
                np.array(out[b : b + 1].astype(mx.float32)), np.array(expected), atol=tolerance, rtol=0
            )

    def test_a_long_prefix_in_slices_equals_one_slice(self, monkeypatch):
        """Many queries against a long prefix are scored a slice at a time:
        the same result as one slice."""
        import mlxkv.cache.shared_prefix as module

        rng = np.random.default_rng(3)
        q = mx.array(rng.standard_normal((4, 4, 16, 8)), dtype=mx.float32)
        ks = mx.array(rng.standard_normal((4, 2, 16, 8)), dtype=mx.float32)
        kp = mx.array(rng.standard_normal((1, 2, 3000, 8)), dtype=mx.float32)
        segments = [([0, 1, 2, 3], kp, kp * 0.5, [3000, 2000, 1000, 10])]
        whole = cascade_attention(q, ks, ks, "causal", 0.3, segments)
        monkeypatch.setattr(module, "SCORE_ELEMENTS", 1 << 10)
        sliced = cascade_attention(q, ks, ks, "causal", 0.3, segments)
        np.testing.assert_allclose(np.array(sliced), np.array(whole), atol=TOL, rtol=0)


def _payloads(model: Any, tokens: list[int], block: int) -> tuple[Any, ...]:
    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return tuple(kv_state.slice_blocks(cache, block, range(len(tokens) // block), num_tokens=len(tokens)))


class TestCaches:
    def test_a_group_is_found_by_its_blocks_and_shared(self, tiny_llama):
        """A request whose payloads begin with a live group's blocks shares
        that group (as many blocks as match); other payloads make a new one;
        a group lives only while something refers to it."""
        model, _ = tiny_llama
        payloads = _payloads(model, list(range(64)), 16)
        groups = PrefixGroups()
        first, shared = groups.take(payloads)
        assert shared == 4 and len(groups) == 1 and first.num_tokens == 64
        again, shared = groups.take(payloads[:2])
        assert again is first and shared == 2
        other, shared = groups.take(_payloads(model, list(range(100, 132)), 16))
        assert other is not first and shared == 2 and len(groups) == 2
        del first, again, other
        import gc

        gc.collect()
        assert len(groups) == 0

    def test_a_request_holds_only_its_suffix(self, tiny_llama):
        """Over a shared prefix, a request's own cache is its suffix: its
        offset counts the prefix, update_and_fetch returns the suffix only."""
        model, _ = tiny_llama
        payloads = _payloads(model, list(range(64)), 16)
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
        group = PrefixGroup.build(_payloads(model, list(range(64)), 16))
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
        length; filtering, extending and extracting move suffixes only."""
        model, _ = tiny_llama
        group = PrefixGroup.build(_payloads(model, list(range(64)), 16))
        caches = []
        for n, own in ((64, 3), (32, 5), (0, 7)):
            suffix = KVCache()
            suffix.update_and_fetch(mx.ones((1, 2, own, 16)) * own, mx.ones((1, 2, own, 16)))
            caches.append(SharedPrefixCache(group if n else None, 0, n, suffix))
        batch = SharedPrefixCache.merge(caches)
        assert isinstance(batch, BatchSharedPrefixCache)
        assert np.array(batch.offset).tolist() == [67, 37, 7]
        assert [rows for rows, *_ in batch.segments()] == [[0, 1]]
        batch.filter(mx.array([1, 2]))
        assert np.array(batch.offset).tolist() == [37, 7]
        more = SharedPrefixCache.merge([caches[0]])
        batch.extend(more)
        assert np.array(batch.offset).tolist() == [37, 7, 67]
        row = batch.extract(2)
        assert isinstance(row, SharedPrefixCache) and row.group is group and row.num_prefix == 64
        assert row.suffix.offset == 3 and float(row.suffix.keys[0, 0, 0, 0]) == 3.0

    def test_a_batch_suffix_grows_ahead_of_the_step_that_needs_room(self, tiny_llama):
        """``reserve`` grows the rows' suffixes only when the next tokens would
        not fit, keeps what they hold, and the step then writes in place."""
        model, _ = tiny_llama
        group = PrefixGroup.build(_payloads(model, list(range(64)), 16))
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
        group = PrefixGroup.build(_payloads(model, list(range(64)), 16))
        cache = SharedPrefixCache(group, 1, 64, KVCache())
        cut = cache.cut(40, 16)
        assert (cut.num_prefix, cut.suffix.offset, cut.offset) == (32, 8, 40)
        np.testing.assert_array_equal(
            np.array(cut.suffix.keys[..., :8, :]), np.array(group.keys[1][..., 32:40, :])
        )


class TestInstall:
    def test_routes_a_model_and_leaves_other_caches_alone(self, tiny_llama):
        """After install, the model's attention module name is the dispatcher;
        the same model with ordinary caches computes exactly as before."""
        import mlx_lm.models.llama as llama

        model, _ = tiny_llama
        x = mx.array([[1, 2, 3, 4]])
        before = model(x, cache=make_prompt_cache(model))
        assert install(model)
        assert install(model)  # once per module, whatever the calls
        assert hasattr(llama.scaled_dot_product_attention, "__wrapped__")
        assert not hasattr(llama.scaled_dot_product_attention.__wrapped__, "__wrapped__")
        after = model(x, cache=make_prompt_cache(model))
        assert mx.array_equal(before, after).item()

    def test_the_last_layer_leaves_its_prefix_slices_lazy(self, tiny_llama, monkeypatch):
        """Every layer but the last evaluates a long prefix's scores slice by
        slice; the last leaves them to MLX, so a prefill body's last-layer
        attention, which nothing reads, is never computed."""
        import mlxkv.cache.shared_prefix as module

        model, _ = tiny_llama
        assert install(model)
        group = PrefixGroup.build(_payloads(model, list(range(64)), 16))
        layers = len(group.keys)
        assert layers > 1
        caches = [SharedPrefixCache(group, i, 64, suffix) for i, suffix in enumerate(suffix_cache((), 8, layers))]
        assert [c.last_layer for c in caches] == [False] * (layers - 1) + [True]
        batch = [SharedPrefixCache.merge([c, SharedPrefixCache(group, c.layer, 32, suffix_cache((), 8, 1)[0])]) for c in caches]
        assert [b.last_layer for b in batch] == [False] * (layers - 1) + [True]
        flags: list[bool] = []
        real = module.cascade_attention

        def recording(*args: Any, evaluate_slices: bool = True) -> Any:
            flags.append(evaluate_slices)
            return real(*args, evaluate_slices=evaluate_slices)

        monkeypatch.setattr(module, "cascade_attention", recording)
        model(mx.array([[1, 2, 3, 4], [5, 6, 7, 8]]), cache=batch)
        assert flags == [True] * (layers - 1) + [False]

    def test_lazy_slices_give_the_same_attention(self, monkeypatch):
        """Left to MLX (nothing evaluated inside), the slices of a long prefix
        merge to the same result as slices evaluated one by one."""
        import mlxkv.cache.shared_prefix as module

        rng = np.random.default_rng(5)
        q = mx.array(rng.standard_normal((3, 4, 16, 8)), dtype=mx.float32)
        ks = mx.array(rng.standard_normal((3, 2, 16, 8)), dtype=mx.float32)
        kp = mx.array(rng.standard_normal((1, 2, 3000, 8)), dtype=mx.float32)
        segments = [([0, 1, 2], kp, kp * 0.5, [3000, 1500, 20])]
        monkeypatch.setattr(module, "SCORE_ELEMENTS", 1 << 10)
        evaluated: list[int] = []
        real_eval = mx.eval

        def counting(*arrays: Any) -> None:
            evaluated.append(len(arrays))
            real_eval(*arrays)

        monkeypatch.setattr(mx, "eval", counting)
        forced = cascade_attention(q, ks, ks, "causal", 0.3, segments)
        assert evaluated, "the slices are evaluated one by one by default"
        evaluated.clear()
        lazy = cascade_attention(q, ks, ks, "causal", 0.3, segments, evaluate_slices=False)
        assert not evaluated, "lazy slices are left to MLX"
        monkeypatch.setattr(mx, "eval", real_eval)
        np.testing.assert_allclose(np.array(lazy), np.array(forced), atol=TOL, rtol=0)

    def test_a_model_without_the_name_is_not_served(self):
        """A model whose attention does not call a module-level
        scaled_dot_product_attention is refused, and nothing changes."""
        import mlx.nn as nn

        class Attention(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.q_proj = self.k_proj = self.v_proj = nn.Linear(2, 2)

        class Model(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.layers = [Attention()]

        assert not install(Model())

    @pytest.mark.parametrize("name", ["sliding_llama", "hybrid_model"])
    def test_only_plain_kv_models_share(self, name, request):
        """A sliding window or recurrent layers keep copies: the runner says so."""
        from mlxkv.actors.model_runner import TextRunner

        model, tokenizer = request.getfixturevalue(name)
        assert not TextRunner(model, tokenizer, prefill_chunk=64).info.shared_prefix
        plain = request.getfixturevalue("tiny_llama")
        assert TextRunner(*plain, prefill_chunk=64).info.shared_prefix
