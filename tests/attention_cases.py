"""Cases of attention over shared prefixes the attention tests share: a batch
over several prefixes checked row by row against fused attention over that
row's prefix part and its own tokens."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from device_arithmetic import ATTENTION_ATOL

__all__ = ["InterleavedGroups", "OnePrefixWhole", "fused"]


def fused(q: Any, parts_k: list[Any], parts_v: list[Any], mask: Any = None) -> Any:
    """Fused attention of ``q`` over the keys and values laid end to end."""
    return mx.fast.scaled_dot_product_attention(
        q, mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2), scale=q.shape[-1] ** -0.5, mask=mask
    )


class InterleavedGroups:
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
        tolerance = ATTENTION_ATOL if self.dtype == mx.float32 else 2e-2
        for b, pad in enumerate(self.pads):
            parts_k, parts_v = [], []
            if self.owner[b] >= 0:
                parts_k.append(self.prefixes[self.owner[b]][0][:, :, : self.seen[b]])
                parts_v.append(self.prefixes[self.owner[b]][1][:, :, : self.seen[b]])
            up_k = [a.astype(mx.float32) for a in (*parts_k, self.ks[b : b + 1, :, pad:])]
            up_v = [a.astype(mx.float32) for a in (*parts_v, self.vs[b : b + 1, :, pad:])]
            total = self.seen[b] + self.suffix - pad
            full = mx.arange(total - self.length, total)[:, None] >= mx.arange(total)[None]
            expected = fused(self.q[b : b + 1].astype(mx.float32), up_k, up_v, full)
            np.testing.assert_allclose(
                np.array(out[b : b + 1].astype(mx.float32)), np.array(expected), atol=tolerance, rtol=0
            )


class OnePrefixWhole(InterleavedGroups):
    """Every row over all of one prefix: a batch over one system prompt."""

    owner = [0] * 7
    sizes = [300]
    seen = [300] * 7
