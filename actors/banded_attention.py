"""Fused attention over shared prefixes in bands: rows of a prefix laid end
to end as one query sequence over one copy of its part, a band a batch entry
of one fused call (:func:`banded_attention`). Bands of one row are
:func:`gathered_attention` (a copy of the prefix part a row: the kernel
mlx-lm's batched decoding runs); :func:`prefill_band` picks the most rows a
band whose masked work stays near that -- the GPU's way for prefill chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from mlxkv.actors.attention_layout import (
    KEYS_QUANTUM,
    QUERIES_QUANTUM,
    Segment,
    as_bias,
    is_additive,
    joined,
    leading,
    per_layout,
    per_step,
    positions_in,
    round_up,
    suffix_mask,
    with_padded_queries,
    zeros,
)
from mlxkv.actors.cascade_attention import cascade_attention

__all__ = ["BAND_SHARE", "banded_attention", "gathered_attention", "prefill_band"]


def gathered_attention(
    queries: Any, keys: Any, values: Any, mask: Any, scale: float, segments: Sequence[Segment], **_: Any
) -> Any:
    """Fused attention over each row's prefix part and its suffix, side by side.

    The rows' prefix parts are gathered for this call into one
    ``(batch, kv_heads, W, head_dim)`` transient (``W``: the longest part any
    row sees; a row sees its own part, the rest is masked), put before the
    suffixes, and one fused call runs over all of it: a batch entry a row
    (:func:`banded_attention`, a band a row). The prefix stays held once;
    the transient is freed with the layer's attention. Arguments and result
    as :func:`cascade_attention`'s.
    """
    if is_additive(mask) or not segments:
        return cascade_attention(queries, keys, values, mask, scale, segments)
    return banded_attention(queries, keys, values, mask, scale, segments, 1)


#: A banded prefill's masked work is at most ``1 + 1 / BAND_SHARE`` times
#: the work of its rows attended apart (:func:`prefill_band`): it lays rows of
#: a prefix end to end over one copy of it while the other rows' suffixes
#: (and a band's empty places) cost no more.
BAND_SHARE = 4


def prefill_band(batch: int, segments: Sequence[Segment], suffix: int) -> int:
    """How many rows a banded prefill chunk over ``segments`` lays end to end
    (``suffix``: each row's suffix positions): the most whose masked work
    -- every place of every band, ``band * (W + band * suffix)`` a band --
    stays within ``1 + 1 / BAND_SHARE`` of the rows' apart, ``batch * (W +
    suffix)``. One of the powers of two below the largest segment's rows,
    or that many (few band sizes, few shapes of the fused call: on CUDA a
    graph is built for every new one); at least one."""
    width = max(max(lengths) for *_, lengths in segments)
    grouped = [len(rows) for rows, *_ in segments]
    groups = [*grouped, batch - sum(grouped)]
    most = max(grouped)
    apart = batch * (width + suffix) * (1 + 1 / BAND_SHARE)
    sizes = [most, *(1 << i for i in range(most.bit_length() - 1, 0, -1) if 1 << i < most)]
    for band in sizes:
        if sum(-(-n // band) for n in groups) * band * (width + band * suffix) <= apart:
            return band
    return 1


@attrs.frozen(eq=False)
class _Bands:
    """Where each row sits in a banded call: ``slots`` holds each band's
    places in order, each a row or -1 (an empty place): a segment's
    rows in its own bands (``segment_bands`` of them), segment after
    segment, then the rows in no segment. ``seen``: each place's visible
    prefix positions (an empty place sees the first, so that its queries see
    a key; their output is dropped). ``index``: each place's row (an empty
    place takes row 0's queries and keys, which no other place sees) and
    ``inverse``: each row's place; both None when the places are the rows in
    order. Made once a layout and kept per thread
    (:func:`~mlxkv.actors.attention_layout.per_layout`)."""

    slots: tuple[int, ...]
    segment_bands: tuple[int, ...]
    seen: tuple[int, ...]
    index: Any
    inverse: Any

    @staticmethod
    def of(batch: int, segments: Sequence[Segment], band: int) -> _Bands:
        return per_layout("banded", batch, segments, band, lambda: _Bands._make(batch, segments, band))

    @staticmethod
    def _make(batch: int, segments: Sequence[Segment], band: int) -> _Bands:
        import mlx.core as mx

        slots: list[int] = []
        seen: list[int] = []

        def place(rows: Sequence[int], lengths: Sequence[int]) -> int:
            empty = -len(rows) % band
            slots.extend([*rows, *[-1] * empty])
            seen.extend([*lengths, *[1] * empty])
            return (len(rows) + empty) // band

        segment_bands = tuple(place(rows, lengths) for rows, _, _, lengths in segments)
        grouped = {row for rows, *_ in segments for row in rows}
        alone = [row for row in range(batch) if row not in grouped]
        place(alone, [0] * len(alone))
        index = inverse = None
        if slots != list(range(batch)):
            index = mx.array([max(row, 0) for row in slots])
            inverse = mx.array(positions_in(slots, batch))
        return _Bands(tuple(slots), segment_bands, tuple(seen), index, inverse)


def banded_attention(
    queries: Any, keys: Any, values: Any, mask: Any, scale: float, segments: Sequence[Segment], band: int
) -> Any:
    """Fused attention over shared prefixes in bands: up to ``band`` rows of a
    prefix laid end to end as one query sequence over ``[that prefix's part
    (zero-padded to W, the longest part any row sees); the band's suffixes;
    zeros]``, each row masked to its part of the prefix and its own suffix;
    one fused call, a batch entry a band. Bands of one row are
    :func:`gathered_attention`: a copy of the prefix part a row; a band of
    them all reads the prefix once, for more masked work (the other rows'
    suffixes), which :func:`prefill_band` bounds. The transient, one copy of
    the prefix part a band, is freed with the layer's attention.

    A prefill chunk's call (several queries a row: cuDNN on CUDA, a graph
    built for every new shape) runs each band's queries padded to a multiple
    of :data:`QUERIES_QUANTUM` (a padded query sees one key; its output is
    dropped) and its keys to a multiple of :data:`KEYS_QUANTUM` (zero keys no
    query sees): a served chat's prefill calls differ in their rows' lengths
    almost every time. The mask, additive in the queries' dtype, is built
    once a step. Arguments and result as :func:`cascade_attention`'s (the
    mask boolean or None).
    """
    import mlx.core as mx

    batch, heads, length, dim = queries.shape
    kv_heads, suffix = keys.shape[1], keys.shape[2]
    layout = _Bands.of(batch, segments, band)
    bands, queries_len = len(layout.slots) // band, band * length
    width = max(max(lengths) for *_, lengths in segments)
    if length > 1:
        padded_len = round_up(queries_len, QUERIES_QUANTUM)
        room = round_up(width + band * suffix, KEYS_QUANTUM) - width - band * suffix
    else:
        padded_len, room = queries_len, 0

    def in_bands(side: Any) -> Any:
        """Rows ``(batch, h, n, d)`` as bands ``(bands, h, band * n, d)``: a band's places' rows end to end."""
        if layout.index is not None:
            side = side[layout.index]
        if band == 1:
            return side
        _, h, n, d = side.shape
        return side.reshape(bands, band, h, n, d).transpose(0, 2, 1, 3, 4).reshape(bands, h, band * n, d)

    def prefix_parts(which: int, like: Any) -> Any:
        """Each band's prefix part, ``which``: 1 the keys, 2 the values."""
        parts = []
        for segment, count in zip(segments, layout.segment_bands):
            part = leading(segment[which], width)
            parts.append(mx.broadcast_to(part, (count, *part.shape[1:])))
        if bands > sum(layout.segment_bands):
            parts.append(zeros(like, (bands - sum(layout.segment_bands), kv_heads, width, like.shape[3])))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)

    def build() -> Any:
        visible = mx.arange(width)[None] < mx.array(layout.seen)[:, None]  # (places, W)
        own = suffix_mask(mask, batch, length, suffix)  # (batch, 1, L, S)
        if layout.index is not None:
            own = own[layout.index]
        own = own.reshape(bands, band, length, 1, suffix)
        if band > 1:
            places = mx.arange(band)
            own = (places[:, None] == places[None])[None, :, None, :, None] & own  # a place sees its own suffix
        prefix = mx.broadcast_to(visible.reshape(bands, band, 1, width), (bands, band, length, width))
        parts = [prefix.reshape(bands, queries_len, width), own.reshape(bands, queries_len, band * suffix)]
        if room:
            parts.append(mx.zeros((bands, queries_len, room), dtype=mx.bool_))
        full = mx.concatenate(parts, axis=-1)
        if padded_len > queries_len:
            full = with_padded_queries(full, padded_len - queries_len, axis=1)
        return as_bias(full[:, None], queries.dtype)  # (bands, 1, padded_len, keys)

    full = per_step(("banded", batch, length, suffix, width, band, layout.slots, layout.seen), mask, build)
    banded = in_bands(queries)
    if padded_len > queries_len:
        banded = mx.concatenate([banded, zeros(banded, (bands, heads, padded_len - queries_len, dim))], axis=2)
    all_keys = joined([prefix_parts(1, keys), in_bands(keys), zeros(keys, (bands, kv_heads, room, dim))])
    all_values = joined(
        [prefix_parts(2, values), in_bands(values), zeros(values, (bands, kv_heads, room, values.shape[3]))]
    )
    out = mx.fast.scaled_dot_product_attention(banded, all_keys, all_values, scale=scale, mask=full)
    if padded_len > queries_len:
        out = out[:, :, :queries_len]
    if band > 1:
        out = out.reshape(bands, heads, band, length, -1).transpose(0, 2, 1, 3, 4).reshape(bands * band, heads, length, -1)
    return out if layout.inverse is None else out[layout.inverse]
