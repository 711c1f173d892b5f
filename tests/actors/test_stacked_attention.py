"""The stacked way: over a batch cache's whole suffix buffer, its fused call's shapes padded."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxkv.actors.attention_layout import KEYS_QUANTUM
from mlxkv.actors.banded_attention import gathered_attention
from mlxkv.actors.stacked_attention import stacked_attention, stacked_rows

from attention_cases import fused
from device_arithmetic import ATTENTION_ATOL

TOL = ATTENTION_ATOL


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
            expected = fused(
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
                    expected = fused(q[b : b + 1], [kp[:, :, :n], kbuf[b : b + 1, :, own]], [vp[:, :, :n], vbuf[b : b + 1, :, own]])
                    np.testing.assert_allclose(np.array(out[b : b + 1]), np.array(expected), atol=TOL, rtol=0)
        width = KEYS_QUANTUM
        assert shapes == {((1, heads, 8, dim), (1, kv_heads, width + 8 * capacity, dim), (1, 1, 8, width + 8 * capacity))}
        assert [stacked_rows(n) for n in (1, 2, 3, 5, 8, 9, 32, 33)] == [1, 2, 4, 8, 8, 16, 32, 64]
