"""Prefill in bands: how many rows a band lays end to end, and each band size exact."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxkv.actors.banded_attention import BAND_SHARE, banded_attention, prefill_band
from mlxkv.actors.prefix_attention import mixed_attention

from attention_cases import InterleavedGroups, fused
from device_arithmetic import ATTENTION_ATOL

TOL = ATTENTION_ATOL


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

        case = InterleavedGroups(band * 10 + length, dtype, length)
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
            expected = fused(q[b : b + 1], [kp, ks[b : b + 1]], [kp, ks[b : b + 1]], causal)
            np.testing.assert_allclose(np.array(out[b : b + 1]), np.array(expected), atol=TOL, rtol=0)
