"""The cascade: a long prefix scored a slice at a time, a decode step's layout kept while its rows are."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mlxkv.actors.cascade_attention import cascade_attention

from attention_cases import fused
from device_arithmetic import ATTENTION_ATOL

TOL = ATTENTION_ATOL


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
                fused(q[i : i + 1], [pk[:, :, : seen.get(i, 0)], k[i : i + 1]], [pv[:, :, : seen.get(i, 0)], v[i : i + 1]])
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
