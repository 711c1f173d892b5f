"""Attention over shared prefixes: every way equals fused attention over each
row's prefix part followed by its suffix; what the GPU's ways (mixed, kernel)
and the fused calls do beside that."""

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

from attention_cases import InterleavedGroups, OnePrefixWhole, fused
from device_arithmetic import ATTENTION_ATOL
from graph_ops import primitives, working
from script_modules import script_module

TOL = ATTENTION_ATOL


@pytest.fixture(params=[way.value for way in PrefixAttention])
def attend(request: pytest.FixtureRequest) -> Any:
    """Each way's function."""
    return attention_for(PrefixAttention(request.param))



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
            expected = fused(q[b : b + 1], [*parts_k, ks[b : b + 1]], [*parts_v, vs[b : b + 1]], full_mask)
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
        expected = fused(q, [kp[:, :, :seen], ks], [vp[:, :, :seen], vs], full)
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
            expected = fused(q[b : b + 1], [kp[:, :, :n], ks[b : b + 1, :, pad:]], [vp[:, :, :n], vs[b : b + 1, :, pad:]])
            np.testing.assert_allclose(np.array(out[b : b + 1]), np.array(expected), atol=TOL, rtol=0)

    @pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
    def test_a_decode_step_of_several_groups_equals_fused_attention(self, attend, dtype):
        """The step of a batch over several groups -- rows interleaved, one row
        in no group, rows left-padded, groups of different lengths, one row
        seeing only its group's first blocks -- equals fused attention over
        each row's part of its prefix + suffix (in half precision within its
        rounding: the softmax arithmetic is float32 either way)."""
        case = InterleavedGroups(13, dtype, length=1)
        out = attend(case.q, case.ks, case.vs, case.mask, case.scale, case.segments)
        case.check(out)


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
                expected = fused(q[b : b + 1], [kp[:, :, :n], ks[b : b + 1]], [vp[:, :, :n], vs[b : b + 1]], causal)
                np.testing.assert_allclose(np.array(out[b : b + 1]), np.array(expected), atol=TOL, rtol=0)
        queries, keys = QUERIES_QUANTUM, KEYS_QUANTUM
        if way == "gathered":
            expected_shapes = {((batch, heads, queries, dim), (batch, kv_heads, keys, dim), (batch, 1, queries, keys))}
        else:
            expected_shapes = {((1, heads, queries, dim), (1, kv_heads, keys, dim), (1, 1, queries, keys))}
        assert shapes == expected_shapes



def _cuda_matmul() -> Any:
    """``scripts/cuda_matmul.py``: MLX's CUDA launches for a product, off a GPU."""
    return script_module("cuda_matmul")



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
    @pytest.mark.parametrize("groups", [InterleavedGroups, OnePrefixWhole], ids=["interleaved", "one-prefix-whole"])
    @pytest.mark.parametrize("way", [w for w in PrefixAttention if w is not PrefixAttention.CASCADE], ids=lambda w: w.value)
    def test_every_product_of_a_gpu_way_is_one_launch(self, way, groups, length):
        cuda = _cuda_matmul()
        attend = attention_for(way)
        case = groups(7, "float32", length)
        with cuda.GemmLaunches() as counted:
            out = attend(case.q, case.ks, case.vs, case.mask, case.scale, case.segments)
        case.check(out)
        assert [p.launches for p in counted.products] == [1] * len(counted.products)
