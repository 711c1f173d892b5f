"""Attention over shared prefixes: every way (cascade, gathered, stacked) equals
fused attention over each row's prefix part followed by its suffix."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxkv.actors.prefix_attention import (
    PrefixAttention,
    attention_for,
    cascade_attention,
    gathered_attention,
    mixed_attention,
    stacked_attention,
)

from device_arithmetic import ATTENTION_ATOL
from graph_ops import primitives, working
from script_modules import script_module

TOL = ATTENTION_ATOL


@pytest.fixture(params=[way.value for way in PrefixAttention])
def attend(request: pytest.FixtureRequest) -> Any:
    """Each way's function."""
    return attention_for(PrefixAttention(request.param))


def _fused(q: Any, parts_k: list[Any], parts_v: list[Any], mask: Any = None) -> Any:
    return mx.fast.scaled_dot_product_attention(
        q, mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2), scale=q.shape[-1] ** -0.5, mask=mask
    )


class _InterleavedGroups:
    """A batch over several prefixes: rows interleaved, one row in no group,
    rows left-padded, groups of different lengths, one row seeing only its
    group's first blocks; ``length`` queries a row (causal over the suffix
    past one), in ``dtype``. :meth:`check` compares an output with fused
    attention over each row's part of its prefix and its own tokens (in half
    precision within its rounding: the softmax arithmetic is float32 either
    way)."""

    batch, heads, kv_heads, dim, suffix = 7, 4, 2, 8, 9
    owner = [0, 1, 0, -1, 2, 1, 0]
    sizes = [300, 45, 128]
    seen = [300, 45, 192, 0, 128, 45, 300]  # row 2 sees 192 of its group's 300

    def __init__(self, seed: int, dtype: str, length: int) -> None:
        rng = np.random.default_rng(seed)
        self.dtype, self.length = getattr(mx, dtype), length
        # Every query sees a token of its own: padding leaves at least `length`.
        self.pads = [min(pad, self.suffix - length) for pad in (0, 3, 1, 8, 0, 2, 5)]

        def normal(shape: tuple[int, ...]) -> Any:
            return mx.array(rng.standard_normal(shape), dtype=mx.float32).astype(self.dtype)

        batch, kv_heads, dim, suffix = self.batch, self.kv_heads, self.dim, self.suffix
        self.q = normal((batch, self.heads, length, dim))
        self.ks, self.vs = normal((batch, kv_heads, suffix, dim)), normal((batch, kv_heads, suffix, dim))
        self.prefixes = [(normal((1, kv_heads, n, dim)), normal((1, kv_heads, n, dim))) for n in self.sizes]
        self.segments = [
            ([b for b in range(batch) if self.owner[b] == g], kp, vp, [self.seen[b] for b in range(batch) if self.owner[b] == g])
            for g, (kp, vp) in enumerate(self.prefixes)
        ]
        causal = mx.arange(suffix - length, suffix)[:, None] >= mx.arange(suffix)[None]
        self.mask = mx.stack([causal & (mx.arange(suffix) >= pad)[None] for pad in self.pads])[:, None]  # (batch, 1, L, S)
        self.scale = dim**-0.5

    def check(self, out: Any) -> None:
        assert out.shape == self.q.shape and out.dtype == self.dtype
        tolerance = TOL if self.dtype == mx.float32 else 2e-2
        for b, pad in enumerate(self.pads):
            parts_k, parts_v = [], []
            if self.owner[b] >= 0:
                parts_k.append(self.prefixes[self.owner[b]][0][:, :, : self.seen[b]])
                parts_v.append(self.prefixes[self.owner[b]][1][:, :, : self.seen[b]])
            up_k = [a.astype(mx.float32) for a in (*parts_k, self.ks[b : b + 1, :, pad:])]
            up_v = [a.astype(mx.float32) for a in (*parts_v, self.vs[b : b + 1, :, pad:])]
            total = self.seen[b] + self.suffix - pad
            full = mx.arange(total - self.length, total)[:, None] >= mx.arange(total)[None]
            expected = _fused(self.q[b : b + 1].astype(mx.float32), up_k, up_v, full)
            np.testing.assert_allclose(
                np.array(out[b : b + 1].astype(mx.float32)), np.array(expected), atol=tolerance, rtol=0
            )


class TestEveryWay:
    """Each way of attending over shared prefixes equals fused attention over
    each row's prefix part followed by its suffix."""

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(
        st.integers(1, 5),  # batch
        st.sampled_from([(2, 2), (4, 2), (4, 1)]),  # heads, kv heads
        st.integers(1, 6),  # query length
        st.integers(0, 2),  # groups
        st.data(),
    )
    def test_equals_fused_attention_over_the_concatenation(self, attend, batch, heads, length, num_groups, data):
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
        out = attend(q, ks, vs, mask, dim**-0.5, segments)
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
    def test_one_rows_prefill_over_part_of_its_prefix_equals_fused_attention(self, attend, mask_kind):
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
        out = attend(q, ks, vs, mask, dim**-0.5, [([0], kp, vp, [seen])])
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
    def test_a_decode_step_of_one_group_equals_fused_attention(self, attend, padded, seen):
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
        out = attend(q, ks, vs, mask, dim**-0.5, [(list(range(batch)), kp, vp, seen)])
        for b, (pad, n) in enumerate(zip(pads, seen)):
            expected = _fused(q[b : b + 1], [kp[:, :, :n], ks[b : b + 1, :, pad:]], [vp[:, :, :n], vs[b : b + 1, :, pad:]])
            np.testing.assert_allclose(np.array(out[b : b + 1]), np.array(expected), atol=TOL, rtol=0)

    @pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
    def test_a_decode_step_of_several_groups_equals_fused_attention(self, attend, dtype):
        """The step of a batch over several groups -- rows interleaved, one row
        in no group, rows left-padded, groups of different lengths, one row
        seeing only its group's first blocks -- equals fused attention over
        each row's part of its prefix + suffix (in half precision within its
        rounding: the softmax arithmetic is float32 either way)."""
        case = _InterleavedGroups(13, dtype, length=1)
        out = attend(case.q, case.ks, case.vs, case.mask, case.scale, case.segments)
        case.check(out)


class TestCascade:
    """What only the cascade does: score a long prefix a slice at a time."""

    def test_a_long_prefix_in_slices_equals_one_slice(self, monkeypatch):
        """Many queries against a long prefix are scored a slice at a time:
        the same result as one slice."""
        import mlxkv.actors.cascade_attention as module

        rng = np.random.default_rng(3)
        q = mx.array(rng.standard_normal((4, 4, 16, 8)), dtype=mx.float32)
        ks = mx.array(rng.standard_normal((4, 2, 16, 8)), dtype=mx.float32)
        kp = mx.array(rng.standard_normal((1, 2, 3000, 8)), dtype=mx.float32)
        segments = [([0, 1, 2, 3], kp, kp * 0.5, [3000, 2000, 1000, 10])]
        whole = cascade_attention(q, ks, ks, "causal", 0.3, segments)
        monkeypatch.setattr(module, "SCORE_ELEMENTS", 1 << 10)
        sliced = cascade_attention(q, ks, ks, "causal", 0.3, segments)
        np.testing.assert_allclose(np.array(sliced), np.array(whole), atol=TOL, rtol=0)

    def test_lazy_slices_give_the_same_attention(self, monkeypatch):
        """Left to MLX (nothing evaluated inside), the slices of a long prefix
        merge to the same result as slices evaluated one by one."""
        import mlxkv.actors.cascade_attention as module

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


class TestFusedWays:
    """What only the fused ways do: build a step's mask once for all its layers."""

    @pytest.mark.parametrize(
        "attend", [gathered_attention, stacked_attention, mixed_attention], ids=["gathered", "stacked", "mixed"]
    )
    def test_a_steps_mask_is_built_once_for_every_layer(self, attend, monkeypatch):
        """Layers of one step pass the same mask object: only the first builds
        the full mask (the others add none of its operations); another mask
        object, or other rows' lengths, build it again."""
        rng = np.random.default_rng(2)
        q = mx.array(rng.standard_normal((3, 4, 1, 8)), dtype=mx.float32)
        ks = mx.array(rng.standard_normal((3, 2, 5, 8)), dtype=mx.float32)
        kp = mx.array(rng.standard_normal((1, 2, 40, 8)), dtype=mx.float32)
        mask = mx.array([[[[True] * 5]], [[[False, True, True, True, True]]], [[[True] * 5]]])
        built: list[int] = []
        real = mx.arange

        def counting(*args: Any, **kwargs: Any) -> Any:
            built.append(1)
            return real(*args, **kwargs)

        monkeypatch.setattr(mx, "arange", counting)
        segments = [([0, 1, 2], kp, kp, [40, 30, 40])]
        first = attend(q, ks, ks, mask, 0.3, segments)
        once = len(built)
        for _ in range(3):  # the step's other layers
            again = attend(q, ks, ks, mask, 0.3, segments)
        assert once > 0 and len(built) == once
        attend(q, ks, ks, mx.array(np.array(mask)), 0.3, segments)
        assert len(built) == 2 * once
        attend(q, ks, ks, mask, 0.3, [([0, 1, 2], kp, kp, [40, 20, 40])])
        assert len(built) == 3 * once
        monkeypatch.setattr(mx, "arange", real)
        np.testing.assert_array_equal(np.array(first), np.array(again))


class TestMixedDecodeByHead:
    """The mixed way's decode step (a KV head's rows in one product): its
    operations do not grow with the prefixes, and it copies no prefix."""

    @staticmethod
    def _step(attend: Any, groups: int) -> list[str]:
        """The primitives of a decode step's layer after its first (the step's
        mask built and evaluated): 8 rows spread over ``groups`` prefixes."""
        rng = np.random.default_rng(groups)
        batch, heads, kv_heads, dim, suffix = 8, 4, 2, 8, 6
        q = mx.array(rng.standard_normal((batch, heads, 1, dim)), dtype=mx.float32)
        ks = mx.array(rng.standard_normal((batch, kv_heads, suffix, dim)), dtype=mx.float32)
        prefixes = [mx.array(rng.standard_normal((1, kv_heads, 40 + g, dim)), dtype=mx.float32) for g in range(groups)]
        segments = [(list(range(g, batch, groups)), kp, kp, [40] * len(range(g, batch, groups))) for g, kp in enumerate(prefixes)]
        mask = mx.array(rng.random((batch, 1, 1, suffix)) < 0.8) | (mx.arange(suffix) == suffix - 1)
        mx.eval(q, ks, mask, *prefixes, attend(q, ks, ks, mask, 0.3, segments))
        return primitives(attend(q, ks, ks, mask, 0.3, segments))

    def test_its_operations_do_not_grow_with_the_prefixes(self):
        assert working(self._step(mixed_attention, 2)) == working(self._step(mixed_attention, 4))
        # The cascade's decode, which a prefix costs two products: the count can tell.
        assert working(self._step(cascade_attention, 4)) > working(self._step(cascade_attention, 2))

    def test_many_long_prefixes_go_by_the_cascade(self, monkeypatch):
        """Past JOINED_SCORES joined prefix scores a step goes by the cascade
        (a row scored against its own prefix only), exactly the same."""
        from mlxkv.actors import prefix_attention as module

        ran: list[str] = []
        real = module._decode_by_head
        monkeypatch.setattr(module, "_decode_by_head", lambda *a: ran.append("by head") or real(*a))
        rng = np.random.default_rng(5)
        q = mx.array(rng.standard_normal((8, 4, 1, 8)), dtype=mx.float32)
        ks = mx.array(rng.standard_normal((8, 2, 6, 8)), dtype=mx.float32)
        prefixes = [mx.array(rng.standard_normal((1, 2, 40 + g, 8)), dtype=mx.float32) for g in range(4)]
        segments = [([g, g + 4], kp, kp, [40 + g, 30]) for g, kp in enumerate(prefixes)]
        by_head = mixed_attention(q, ks, ks, None, 0.3, segments)
        assert ran == ["by head"]
        monkeypatch.setattr(module, "JOINED_SCORES", 8 * 4 * (40 + 41 + 42 + 43) - 1)  # 8 rows, 4 heads
        capped = mixed_attention(q, ks, ks, None, 0.3, segments)
        assert ran == ["by head"]  # not again
        cascade = cascade_attention(q, ks, ks, None, 0.3, segments)
        np.testing.assert_array_equal(np.array(capped), np.array(cascade))
        np.testing.assert_allclose(np.array(by_head), np.array(cascade), atol=ATTENTION_ATOL, rtol=0)

    def test_one_prefix_is_read_where_it_is_held(self):
        """One prefix: no gather (MLX's integer index) and no concatenation but
        the scores'."""
        ops = self._step(mixed_attention, 1)
        assert "Gather" not in ops and ops.count("Concatenate") == 1


class TestBandedPrefill:
    """The mixed way's prefill in bands: rows of a prefix laid end to end over
    one copy of it while the masked work stays near the rows' attended apart."""

    @staticmethod
    def _segment(rows: list[int], width: int) -> Any:
        return (rows, None, None, [width] * len(rows))

    @pytest.mark.parametrize(
        "batch, groups, suffix, band",
        [
            (32, [32], 32, 16),  # 32 requests' own 32 tokens over 2,048 shared: two copies, not 32
            (32, [32], 48, 8),
            (8, [8], 48, 8),  # one copy
            (20, [20], 8, 20),  # a band of all of them where that is cheaper than a power of two
            (20, [20], 32, 4),  # 16 and 4 a band would leave 12 places empty
            (4, [4], 2048, 1),  # long suffixes: a row its own copy (the gathered call)
            (8, [2, 2, 2, 2], 96, 2),
            (33, [32], 32, 4),  # a row in no prefix: a band of its own, mostly empty
            (1, [1], 32, 1),
        ],
    )
    def test_the_most_rows_whose_work_stays_within_the_bound(self, batch, groups, suffix, band):
        from mlxkv.actors.banded_attention import BAND_SHARE, prefill_band

        width, start, segments = 2048, 0, []
        for n in groups:
            segments.append(self._segment(list(range(start, start + n)), width))
            start += n
        chosen = prefill_band(batch, segments, suffix)
        assert chosen == band
        counts = [*groups, batch - sum(groups)]

        def work(k: int) -> int:
            return sum(-(-n // k) for n in counts) * k * (width + k * suffix)

        bound = batch * (width + suffix) * (1 + 1 / BAND_SHARE)
        assert work(chosen) <= bound
        larger = [1 << i for i in range(10) if chosen < 1 << i < max(groups)] + ([max(groups)] if chosen < max(groups) else [])
        assert all(work(k) > bound for k in larger)

    @pytest.mark.parametrize("band", [1, 2, 3, 4, 7])
    @pytest.mark.parametrize("length", [1, 5])
    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_every_band_size_attends_exactly(self, band, length, dtype):
        """Rows interleaved over three prefixes (one seeing part of its
        prefix, one in none), left-padded suffixes, bands of any size (empty
        places in the last band of a segment): each row equals fused
        attention over its part of its prefix and its own suffix."""
        from mlxkv.actors.banded_attention import banded_attention

        case = _InterleavedGroups(band * 10 + length, dtype, length)
        case.check(banded_attention(case.q, case.ks, case.vs, case.mask, case.scale, case.segments, band))

    @pytest.mark.parametrize("suffix, copies", [(8, 1), (512, 8)])
    def test_a_prefill_reads_one_copy_of_its_prefix_where_the_suffixes_are_short(self, suffix, copies, monkeypatch):
        """Eight rows' prefill over one 512-token prefix: with 8 tokens each,
        one band, so the fused call's keys hold the prefix once; with 512
        each (suffixes as long as the prefix), a copy a row, as gathered."""
        rng = np.random.default_rng(4)
        batch, heads, kv_heads, dim, size, length = 8, 4, 2, 8, 512, 8
        calls: list[tuple[Any, ...]] = []
        real = mx.fast.scaled_dot_product_attention

        def spy(q: Any, k: Any, v: Any, *, scale: float, mask: Any = None) -> Any:
            calls.append(k.shape)
            return real(q, k, v, scale=scale, mask=mask)

        monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
        q = mx.array(rng.standard_normal((batch, heads, length, dim)), dtype=mx.float32)
        ks = mx.array(rng.standard_normal((batch, kv_heads, suffix, dim)), dtype=mx.float32)
        kp = mx.array(rng.standard_normal((1, kv_heads, size, dim)), dtype=mx.float32)
        out = mixed_attention(q, ks, ks, "causal", dim**-0.5, [(list(range(batch)), kp, kp, [size] * batch)])
        assert len(calls) == 1 and calls[0][0] == copies
        causal = mx.arange(size + suffix - length, size + suffix)[:, None] >= mx.arange(size + suffix)[None]
        for b in range(batch):
            expected = _fused(q[b : b + 1], [kp, ks[b : b + 1]], [kp, ks[b : b + 1]], causal)
            np.testing.assert_allclose(np.array(out[b : b + 1]), np.array(expected), atol=TOL, rtol=0)


class TestStackedOverTheSuffixBuffer:
    """A decode step of the stacked way attends over the batch cache's whole
    suffix buffer, its room masked out: the same attention, and the same
    shapes for its fused call from step to step until the buffer grows."""

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_the_buffers_room_is_never_seen(self, dtype):
        """Rows left-padded, one group seen in part by one row; the buffer's
        room past the rows' tokens holds huge values -- which any weight on
        them would show -- and the step equals fused attention over each
        row's prefix part and its own tokens only."""
        rng = np.random.default_rng(11)
        dt = getattr(mx, dtype)
        batch, heads, kv_heads, dim, size, used, room = 4, 4, 2, 8, 96, 6, 10
        q = mx.array(rng.standard_normal((batch, heads, 1, dim)), dtype=dt)
        kbuf = mx.array(rng.standard_normal((batch, kv_heads, used + room, dim)), dtype=dt)
        vbuf = mx.array(rng.standard_normal((batch, kv_heads, used + room, dim)), dtype=dt)
        kbuf[:, :, used:] = 40.0
        vbuf[:, :, used:] = 1e4
        kp = mx.array(rng.standard_normal((1, kv_heads, size, dim)), dtype=dt)
        vp = mx.array(rng.standard_normal((1, kv_heads, size, dim)), dtype=dt)
        pads = [0, 2, 0, 5]
        mask = mx.array([[[[j >= pad for j in range(used)]]] for pad in pads])
        seen = [96, 96, 64, 96]
        out = stacked_attention(
            q, kbuf[:, :, :used], vbuf[:, :, :used], mask, dim**-0.5,
            [(list(range(batch)), kp, vp, seen)], suffix_buffer=(kbuf, vbuf),
        )  # fmt: skip
        plain = stacked_attention(q, kbuf[:, :, :used], vbuf[:, :, :used], mask, dim**-0.5, [(list(range(batch)), kp, vp, seen)])
        tol = TOL if dtype == "float32" else 2e-2
        for b, (pad, n) in enumerate(zip(pads, seen)):
            expected = _fused(
                q[b : b + 1], [kp[:, :, :n], kbuf[b : b + 1, :, pad:used]], [vp[:, :, :n], vbuf[b : b + 1, :, pad:used]]
            )
            got = np.array(out[b : b + 1].astype(mx.float32))
            np.testing.assert_allclose(got, np.array(expected.astype(mx.float32)), atol=tol, rtol=0)
            np.testing.assert_allclose(got, np.array(plain[b : b + 1].astype(mx.float32)), atol=tol, rtol=0)

    def test_the_fused_calls_mask_is_additive_in_the_queries_dtype(self, monkeypatch):
        """What the fused call gets: a mask of the queries' dtype (a GPU's fused
        kernel takes no booleans, MLX would convert them in every layer),
        and, in a decode step, keys as long as the prefix and the whole buffer."""
        calls: list[tuple[Any, ...]] = []
        real = mx.fast.scaled_dot_product_attention

        def spy(q: Any, k: Any, v: Any, *, scale: float, mask: Any = None) -> Any:
            calls.append((q.shape, k.shape, mask.dtype, mask.shape))
            return real(q, k, v, scale=scale, mask=mask)

        monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
        q = mx.zeros((3, 4, 1, 8), dtype=mx.bfloat16)
        kbuf = mx.zeros((3, 2, 16, 8), dtype=mx.bfloat16)
        kp = mx.zeros((1, 2, 64, 8), dtype=mx.bfloat16)
        mask = mx.ones((3, 1, 1, 5), dtype=mx.bool_)
        stacked_attention(q, kbuf[:, :, :5], kbuf[:, :, :5], mask, 0.3, [([0, 1, 2], kp, kp, [64] * 3)], suffix_buffer=(kbuf, kbuf))
        gathered_attention(q, kbuf[:, :, :5], kbuf[:, :, :5], mask, 0.3, [([0, 1, 2], kp, kp, [64] * 3)])
        (stacked, gathered) = calls
        # 3 rows padded to 4; the 64-position prefix to KEYS_QUANTUM.
        assert stacked == ((1, 4, 4, 8), (1, 2, 256 + 4 * 16, 8), mx.bfloat16, (1, 1, 4, 256 + 4 * 16))
        assert gathered[2] == mx.bfloat16


class TestStackedShapesPadded:
    """A stacked decode step runs its rows padded to a power of two and its
    prefixes' parts to a multiple of KEYS_QUANTUM: rows coming and
    going, and prefixes of other lengths, keep the fused call's shapes (a
    GPU builds a cuDNN graph for each new one), and the padding changes no
    row's attention."""

    def test_rows_and_prefixes_of_other_sizes_share_one_shape_and_attend_exactly(self, monkeypatch):
        from mlxkv.actors.attention_layout import KEYS_QUANTUM
        from mlxkv.actors.stacked_attention import stacked_rows

        rng = np.random.default_rng(5)
        heads, kv_heads, dim, capacity = 4, 2, 8, 16
        shapes: set[tuple[Any, ...]] = set()
        real = mx.fast.scaled_dot_product_attention

        def spy(q: Any, k: Any, v: Any, *, scale: float, mask: Any = None) -> Any:
            if mask is not None:  # (the reference below runs unmasked)
                shapes.add((q.shape, k.shape, mask.shape))
            return real(q, k, v, scale=scale, mask=mask)

        monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
        for batch, sizes in ((5, (40, 100)), (6, (200,)), (7, (96, 96)), (8, (17, 30, 150))):
            q = mx.array(rng.standard_normal((batch, heads, 1, dim)), dtype=mx.float32)
            kbuf = mx.array(rng.standard_normal((batch, kv_heads, capacity, dim)), dtype=mx.float32)
            vbuf = mx.array(rng.standard_normal((batch, kv_heads, capacity, dim)), dtype=mx.float32)
            used = [3 + (b % 4) for b in range(batch)]
            # Rows left-padded to the longest; the buffer's room past it is masked.
            mask = mx.array([[[[j >= max(used) - u for j in range(max(used))]]] for u in used])
            prefixes = [(mx.array(rng.standard_normal((1, kv_heads, n, dim)), dtype=mx.float32),) * 2 for n in sizes]
            segments = []
            for g, (kp, vp) in enumerate(prefixes):
                rows = [b for b in range(batch) if b % len(sizes) == g]
                seen = [kp.shape[2] - (b % 3) for b in rows]
                segments.append((rows, kp, vp, seen))
            top = max(used)
            out = stacked_attention(
                q, kbuf[:, :, :top], vbuf[:, :, :top], mask, dim**-0.5, segments, suffix_buffer=(kbuf, vbuf)
            )
            assert out.shape == (batch, heads, 1, dim)
            for rows, kp, vp, seen in segments:
                for b, n in zip(rows, seen):
                    own = slice(top - used[b], top)
                    expected = _fused(q[b : b + 1], [kp[:, :, :n], kbuf[b : b + 1, :, own]], [vp[:, :, :n], vbuf[b : b + 1, :, own]])
                    np.testing.assert_allclose(np.array(out[b : b + 1]), np.array(expected), atol=TOL, rtol=0)
        width = KEYS_QUANTUM
        assert shapes == {((1, heads, 8, dim), (1, kv_heads, width + 8 * capacity, dim), (1, 1, 8, width + 8 * capacity))}
        assert [stacked_rows(n) for n in (1, 2, 3, 5, 8, 9, 32, 33)] == [1, 2, 4, 8, 8, 16, 32, 64]


class TestPrefillShapesPadded:
    @pytest.mark.parametrize("way", ["gathered", "stacked", "mixed"])
    def test_prefill_chunks_of_other_lengths_share_one_shape_and_attend_exactly(self, way, monkeypatch):
        """A fused way's prefill call pads its queries to a multiple of
        QUERIES_QUANTUM (gathered: each row's; stacked: the rows' sequence;
        mixed, the GPU default: each band's, here one of both rows) and its
        keys to one of KEYS_QUANTUM:
        chunks of 5 to 16 tokens over prefix parts of 33 to 200 share one
        fused shape, and each row's attention is exact."""
        from mlxkv.actors.attention_layout import KEYS_QUANTUM, QUERIES_QUANTUM

        attend = {"gathered": gathered_attention, "stacked": stacked_attention, "mixed": mixed_attention}[way]
        rng = np.random.default_rng(9)
        batch, heads, kv_heads, dim = 2, 4, 2, 8
        shapes: set[tuple[Any, ...]] = set()
        real = mx.fast.scaled_dot_product_attention

        def spy(q: Any, k: Any, v: Any, *, scale: float, mask: Any = None) -> Any:
            if mask is not None and not isinstance(mask, str) and mask.ndim == 4:
                shapes.add((q.shape, k.shape, mask.shape))
            return real(q, k, v, scale=scale, mask=mask)

        monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
        for length, size, seen in ((5, 40, [40, 33]), (16, 200, [200, 120]), (11, 96, [64, 96])):
            q = mx.array(rng.standard_normal((batch, heads, length, dim)), dtype=mx.float32)
            ks = mx.array(rng.standard_normal((batch, kv_heads, length, dim)), dtype=mx.float32)
            vs = mx.array(rng.standard_normal((batch, kv_heads, length, dim)), dtype=mx.float32)
            kp = mx.array(rng.standard_normal((1, kv_heads, size, dim)), dtype=mx.float32)
            vp = mx.array(rng.standard_normal((1, kv_heads, size, dim)), dtype=mx.float32)
            out = attend(q, ks, vs, "causal", dim**-0.5, [([0, 1], kp, vp, seen)])
            assert out.shape == (batch, heads, length, dim)
            for b, n in enumerate(seen):
                causal = mx.arange(n, n + length)[:, None] >= mx.arange(n + length)[None]
                expected = _fused(q[b : b + 1], [kp[:, :, :n], ks[b : b + 1]], [vp[:, :, :n], vs[b : b + 1]], causal)
                np.testing.assert_allclose(np.array(out[b : b + 1]), np.array(expected), atol=TOL, rtol=0)
        queries, keys = QUERIES_QUANTUM, KEYS_QUANTUM
        if way == "gathered":
            expected_shapes = {((batch, heads, queries, dim), (batch, kv_heads, keys, dim), (batch, 1, queries, keys))}
        else:
            expected_shapes = {((1, heads, queries, dim), (1, kv_heads, keys, dim), (1, 1, queries, keys))}
        assert shapes == expected_shapes


class TestDecodeLayoutKept:
    """The cascade's decode step derives its row order and masks once for as
    long as the rows see the same parts of the same prefixes (every layer of
    a step, every step), and again when that changes."""

    def test_reused_while_the_rows_are_the_same_and_remade_when_they_change(self):
        from mlxkv.actors import cascade_attention as pa

        rng = np.random.default_rng(3)
        q = mx.array(rng.standard_normal((3, 4, 1, 8)).astype(np.float32))
        k = mx.array(rng.standard_normal((3, 2, 5, 8)).astype(np.float32))
        v = mx.array(rng.standard_normal((3, 2, 5, 8)).astype(np.float32))
        pk = mx.array(rng.standard_normal((1, 2, 12, 8)).astype(np.float32))
        pv = mx.array(rng.standard_normal((1, 2, 12, 8)).astype(np.float32))

        def expected(rows, lengths):
            seen = dict(zip(rows, lengths))
            return mx.concatenate([
                _fused(q[i : i + 1], [pk[:, :, : seen.get(i, 0)], k[i : i + 1]], [pv[:, :, : seen.get(i, 0)], v[i : i + 1]])
                for i in range(3)
            ])  # fmt: skip

        first = [([2, 0], pk, pv, [12, 7])]
        out = pa.cascade_attention(q, k, v, None, 8**-0.5, first)
        layout = pa._DecodeLayout.of(3, first, q.dtype)
        assert pa._DecodeLayout.of(3, [([2, 0], pk, pv, [12, 7])], q.dtype) is layout
        np.testing.assert_allclose(np.array(out), np.array(expected([2, 0], [12, 7])), atol=ATTENTION_ATOL)
        second = [([0, 1], pk, pv, [3, 12])]
        out = pa.cascade_attention(q, k, v, None, 8**-0.5, second)
        assert pa._DecodeLayout.of(3, second, q.dtype) is not layout
        np.testing.assert_allclose(np.array(out), np.array(expected([0, 1], [3, 12])), atol=ATTENTION_ATOL)


def _cuda_matmul() -> Any:
    """``scripts/cuda_matmul.py``: MLX's CUDA launches for a product, off a GPU."""
    return script_module("cuda_matmul")


class _OnePrefixWhole(_InterleavedGroups):
    """Every row over all of one prefix: a batch over one system prompt."""

    owner = [0] * 7
    sizes = [300]
    seen = [300] * 7


class TestOneLaunchAProduct:
    """MLX's CUDA backend runs a matrix product as one cuBLAS call when the
    operands' batch axes collapse into one; otherwise, built with CUDA 12.9
    or later, as a kernel writing a pointer array and one cuBLAS call over
    it (earlier: a call for every index of the axes before the last).
    ``scripts/cuda_matmul.py`` reads the layouts as the backend does: no GPU
    here, so the model of it is checked on layouts whose launches its source
    fixes. Every product a GPU candidate makes is one launch: a KV head's
    query heads are a product's rows, not a batch axis over which the keys
    or values are broadcast, and the suffixes are read as they are held. The
    cascade, the CPU's way, keeps its broadcast products: laid out as one
    launch each, its prefill measured 10-28% slower on the CPU
    (docs/benchmarks.md, 2026-12-06, fourth session)."""

    def test_the_launches_of_known_layouts(self):
        cuda = _cuda_matmul()
        rng = np.random.default_rng(0)
        batch, kv_heads, repeats, suffix, dim = 3, 2, 4, 5, 8

        def normal(*shape: int) -> Any:
            return mx.array(rng.standard_normal(shape), dtype=mx.float32)

        def launches(a: Any, b: Any) -> tuple[Any, Any]:
            """With a pointer array (CUDA 12.9+), and with a call an index (earlier)."""
            return cuda.gemm_launches(a, b), cuda.gemm_launches(a, b, pointer_array=False)

        q, keys = normal(batch, kv_heads, repeats, dim), normal(batch, kv_heads, suffix, dim)
        assert launches(q, keys.swapaxes(-1, -2)) == (cuda.Product(1, 0), cuda.Product(1, 0))
        # Read a KV head first: the batch axes are not one stride apart.
        by_head = launches(q.transpose(1, 0, 2, 3), keys.transpose(1, 0, 3, 2))
        assert by_head == (cuda.Product(2, 0), cuda.Product(kv_heads, 0))
        # One query a product, values broadcast over the query heads.
        weights = normal(batch, kv_heads, repeats, 1, suffix)
        assert launches(weights, keys[:, :, None]) == (cuda.Product(2, 0), cuda.Product(batch * kv_heads, 0))
        # ... but a vector product (the keys transposed) takes any batch layout in one.
        assert launches(q[..., None, :], keys[:, :, None].swapaxes(-1, -2)) == (cuda.Product(1, 0),) * 2
        # A batch over a matrix broadcast to it is folded into the rows: one call.
        assert launches(q.reshape(batch * kv_heads, repeats, dim), keys[0, 0].T) == (cuda.Product(1, 0),) * 2
        # Rows with a gap between them (a slice of the last axis) are copied first.
        assert launches(normal(batch, kv_heads, repeats, 9)[..., 4:], keys) == (cuda.Product(1, 1),) * 2

    @pytest.mark.parametrize("length", [1, 4], ids=["decode", "prefill"])
    @pytest.mark.parametrize("groups", [_InterleavedGroups, _OnePrefixWhole], ids=["interleaved", "one-prefix-whole"])
    @pytest.mark.parametrize("way", [w for w in PrefixAttention if w is not PrefixAttention.CASCADE], ids=lambda w: w.value)
    def test_every_product_of_a_gpu_way_is_one_launch(self, way, groups, length):
        cuda = _cuda_matmul()
        attend = attention_for(way)
        case = groups(7, "float32", length)
        with cuda.GemmLaunches() as counted:
            out = attend(case.q, case.ks, case.vs, case.mask, case.scale, case.segments)
        case.check(out)
        assert [p.launches for p in counted.products] == [1] * len(counted.products)
