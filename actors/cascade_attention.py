"""The cascade: attention over shared prefixes merged through the softmax's
statistics (log-sum-exp; the cascade / Hydragen idea), the CPU's way.

Each group's queries meet their prefix in one matrix product, the scores in
float32; a decode step puts every row's prefix and suffix scores through one
softmax (:func:`_decode_step`), a lone row goes by fused attention over its
prefix and suffix side by side (:func:`_one_row`). On a CPU a call's
arithmetic is its cost, and the cascade scores a row against its own part
of its prefix only. The other ways fall back to it where they do not serve
(an additive mask, a batch without prefixes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from mlxkv.actors.attention_layout import Segment, as_bias, leading, per_layout, positions_in

__all__ = ["SCORE_ELEMENTS", "cascade_attention"]

#: The most prefix scores one slice of :func:`cascade_attention` computes at once.
SCORE_ELEMENTS = 1 << 18


def cascade_attention(
    queries: Any,
    keys: Any,
    values: Any,
    mask: Any,
    scale: float,
    segments: list[tuple[list[int], Any, Any, list[int]]],
    *,
    evaluate_slices: bool = True,
    **_: Any,
) -> Any:
    """Attention over shared prefixes and each row's own suffix, merged exactly.

    Args:
        queries: ``(batch, heads, L, head_dim)``, positions already rotated.
        keys, values: the rows' suffixes ``(batch, kv_heads, S, head_dim)``.
        mask: the suffix's mask: None, ``"causal"`` (the last ``L`` of the
            ``S`` positions are the queries'), or a boolean or additive array
            broadcastable to ``(batch, 1, L, S)``.
        scale: the softmax scale.
        segments: ``(rows, keys, values, lengths)``: rows that attend to a
            prefix ``(1, kv_heads, P, head_dim)``, each to its first
            ``lengths[i]`` positions.
        evaluate_slices: evaluate the scores of many queries against a long
            prefix a slice at a time, so the transients stay near
            :data:`SCORE_ELEMENTS` floats. False leaves the slices to MLX:
            for a model's last layer, whose output over a prefill's body
            nobody evaluates (only the body's keys and values enter the
            cache: the prompt's last token runs in a call of its own), so
            forcing the slices would compute attention that is never read
            -- half the attention of a batched prefill on a two-layer model.
        **_: what other ways take (``suffix_buffer``: see
            :func:`~mlxkv.actors.stacked_attention.stacked_attention`); the
            cascade attends to ``keys`` and ``values`` as given.

    Returns:
        ``(batch, heads, L, head_dim)``, as fused attention over each row's
        prefix followed by its suffix.
    """
    import mlx.core as mx

    batch, heads, length, dim = queries.shape
    kv_heads = keys.shape[1]
    repeats = heads // kv_heads
    if batch == 1 and len(segments) == 1:
        return _one_row(queries, keys, values, mask, scale, segments[0])
    if length == 1:
        return _decode_step(queries, keys, values, mask, scale, segments)
    q = (queries * scale).reshape(batch, kv_heads, repeats, length, dim)
    scores = q @ keys[:, :, None].swapaxes(-1, -2)  # (batch, kv_heads, repeats, L, S)
    if mask is not None:
        if isinstance(mask, str):
            total = keys.shape[2]
            allowed = mx.arange(total - length, total)[:, None] >= mx.arange(total)[None]
            scores = mx.where(allowed, scores, -mx.inf)
        else:
            mask = mask.reshape(mask.shape[0], 1, 1, *mask.shape[-2:]) if mask.ndim == 4 else mask
            scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask
    # Every row sees at least its own newest token: no row is all masked.
    output, lse = _softmax_out(scores, values[:, :, None])
    for rows, prefix_keys, prefix_values, lengths in segments:
        whole = len(rows) == batch
        index = None if whole else mx.array(rows)
        q_rows = q if whole else q[index]
        count, size = len(rows), prefix_keys.shape[2]
        flat = q_rows.transpose(1, 0, 2, 3, 4).reshape(kv_heads, count * repeats * length, dim)
        keep = None
        if any(n < size for n in lengths):
            keep = mx.arange(size)[None] < mx.array(lengths)[:, None]  # (rows, P)
            keep = mx.broadcast_to(keep[:, None, None, :], (count, repeats, length, size))
            keep = keep.reshape(1, count * repeats * length, size)
        # The scores of many queries against a long prefix are computed a
        # slice of the prefix at a time (merged as they go), so a prefill's
        # transient memory stays near SCORE_ELEMENTS floats (a decode step's
        # queries are few: one slice).
        step = max(256, SCORE_ELEMENTS // max(1, kv_heads * count * repeats * length))
        # squeeze, not [0]: MLX indexes an integer with a gather, a copy of the prefix.
        prefix_k, prefix_v = prefix_keys.squeeze(0), prefix_values.squeeze(0)
        prefix_out = prefix_lse = None
        for begin in range(0, size, step):
            stop = min(size, begin + step)
            part = flat @ prefix_k[:, begin:stop].swapaxes(-1, -2)  # (kv_heads, rows*repeats*L, step)
            if keep is not None:
                part = mx.where(keep[..., begin:stop], part, -mx.inf)
            out, lse_part = _softmax_out(part, prefix_v[:, begin:stop], masked=keep is not None)
            if prefix_out is None:
                prefix_out, prefix_lse = out, lse_part
            else:
                joint = mx.logaddexp(prefix_lse, lse_part)
                prefix_out = prefix_out * mx.exp(prefix_lse - joint) + out * mx.exp(lse_part - joint)
                prefix_lse = joint
            if step < size and evaluate_slices:
                # Evaluated slice by slice: left to itself, MLX computes every
                # slice's scores before merging any, and the transient is the
                # whole score matrix again.
                mx.eval(prefix_out, prefix_lse)
        prefix_out = prefix_out.reshape(kv_heads, count, repeats, length, -1).transpose(1, 0, 2, 3, 4)
        prefix_lse = prefix_lse.reshape(kv_heads, count, repeats, length, 1).transpose(1, 0, 2, 3, 4)
        mine_out = output if whole else output[index]
        mine_lse = lse if whole else lse[index]
        # Each side weighted by its share of the softmax mass (a row is in one
        # segment, so the merged log-sum-exp is not needed again).
        share = mx.sigmoid(mine_lse - prefix_lse)
        merged = prefix_out + share * (mine_out - prefix_out)
        if whole:
            output = merged
        else:
            output[index] = merged
    return output.reshape(batch, heads, length, -1)


def _one_row(
    queries: Any, keys: Any, values: Any, mask: Any, scale: float, segment: tuple[list[int], Any, Any, list[int]]
) -> Any:
    """A lone row over its shared prefix (a prefill chunk, or a decode step of a
    request decoding alone): fused attention over the prefix and the suffix side
    by side. The concatenation is a transient of one layer's prefix for one row
    (freed once this layer's attention ran); the row still holds only its
    suffix, and with nothing to share the fused kernel is faster than the
    cascade's separate scores (a decode step of one request over 512 tokens:
    ~5-8% of the step)."""
    import mlx.core as mx

    _, prefix_keys, prefix_values, lengths = segment
    size = lengths[0]
    length, total = queries.shape[2], size + keys.shape[2]
    keys = mx.concatenate([prefix_keys[:, :, :size], keys], axis=2)
    values = mx.concatenate([prefix_values[:, :, :size], values], axis=2)
    if isinstance(mask, str):
        # The queries are the last `length` of all positions, prefix first.
        mask = mx.arange(total - length, total)[:, None] >= mx.arange(total)[None]
    elif mask is not None:
        seen = mx.ones if mask.dtype == mx.bool_ else mx.zeros
        mask = mx.concatenate([seen((*mask.shape[:-1], size), dtype=mask.dtype), mask], axis=-1)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def _decode_step(
    queries: Any, keys: Any, values: Any, mask: Any, scale: float, segments: list[tuple[list[int], Any, Any, list[int]]]
) -> Any:
    """A decode step: every row one query, each row of a segment over its
    group's leading ``lengths[i]`` positions (rows in no segment have only
    their suffix).

    One softmax for the whole batch: each segment's rows are scored together
    against the longest part of its prefix any of them sees (one matrix
    product a segment); the positions a row does not see -- past its own
    length, or past its segment's longest where another segment's is
    longer -- are ``-inf``; the batch's prefix scores and suffix scores go
    through one softmax side by side (the scores are a query's, not the KV;
    a row that shares only a group's first blocks -- a turn-1 request over a
    group built for a turn 2 -- stays on this path). The weights then split
    into one product a segment with its prefix's values and one for the
    batch with the suffixes'. Nothing of the KV is copied but the suffixes,
    gathered into segment order when the batch's rows are not in it (the
    queries too, once: each segment's are then a slice). Beyond one segment,
    each costs a product and slices, not a softmax of its own nor a gather:
    on the CPU a step's graph nodes are much of its time, and on a GPU its
    kernels are (docs/benchmarks.md has the counts). The
    softmax accumulates in float32 whatever the model's dtype (``precise``).
    """
    import mlx.core as mx

    batch, heads, _, dim = queries.shape
    kv_heads = keys.shape[1]
    repeats = heads // kv_heads
    q = (queries * scale).reshape(batch, kv_heads, repeats, 1, dim)
    own_scores = q @ keys[:, :, None].swapaxes(-1, -2)  # (batch, kv, rep, 1, S)
    if mask is not None:
        mask = mask.reshape(mask.shape[0], 1, 1, *mask.shape[-2:]) if mask.ndim == 4 else mask
        own_scores = mx.where(mask, own_scores, -mx.inf) if mask.dtype == mx.bool_ else own_scores + mask
    if not segments:
        weights = mx.softmax(own_scores, axis=-1, precise=True)
        return (weights @ values[:, :, None]).astype(queries.dtype).reshape(batch, heads, 1, -1)
    layout = _DecodeLayout.of(batch, segments, own_scores.dtype)
    # One gather into segment order; each segment's queries are then a view.
    q_sorted = q if layout.order is None else q[layout.order]
    parts = []
    for (_, prefix_keys, _, _), part in zip(segments, layout.parts):
        q_rows = q_sorted if part.rows == batch else q_sorted[part.start : part.start + part.rows]
        scores = q_rows @ leading(prefix_keys, part.longest)[:, :, None].swapaxes(-1, -2)  # (rows, kv, rep, 1, P)
        if part.hidden is not None:
            scores = scores + part.hidden
        if part.longest < layout.width:
            scores = mx.pad(scores, [(0, 0)] * 4 + [(0, layout.width - part.longest)], constant_values=-mx.inf)
        parts.append(scores)
    if layout.alone:
        parts.append(mx.full((layout.alone, kv_heads, repeats, 1, layout.width), -mx.inf, dtype=parts[0].dtype))
    prefix_scores = parts[0] if len(parts) == 1 else mx.concatenate(parts)
    own = own_scores if layout.order is None else own_scores[layout.order]
    weights = mx.softmax(mx.concatenate([prefix_scores, own.astype(prefix_scores.dtype)], axis=-1), axis=-1, precise=True)
    mine = values if layout.order is None else values[layout.order]
    out = weights[..., layout.width :] @ mine[:, :, None]
    prefix_outs = []
    for (_, _, prefix_values, _), part in zip(segments, layout.parts):
        weighted = weights if part.rows == batch else weights[part.start : part.start + part.rows]
        prefix_outs.append(weighted[..., : part.longest] @ leading(prefix_values, part.longest)[:, :, None])
    if layout.alone:
        prefix_outs.append(mx.zeros((layout.alone, *prefix_outs[0].shape[1:]), dtype=prefix_outs[0].dtype))
    out = out + (prefix_outs[0] if len(prefix_outs) == 1 else mx.concatenate(prefix_outs))
    if layout.inverse is not None:
        out = out[layout.inverse]
    return out.astype(queries.dtype).reshape(batch, heads, 1, -1)


@attrs.frozen
class _SegmentPart:
    """One segment of a decode step's layout: its ``rows`` (how many), the
    ``start`` of its rows in segment order, the ``longest`` part of its
    prefix any of them sees, and ``hidden``: 0 where a row sees a position
    of that part, ``-inf`` where it does not ``(rows, 1, 1, 1, longest)``
    (None: every row sees all of it)."""

    rows: int
    start: int
    longest: int
    hidden: Any


@attrs.frozen
class _DecodeLayout:
    """What :func:`_decode_step` derives from which rows see how much of which
    prefix -- the same for every layer of a step and for every step until
    the batch's rows change: the rows in segment order (``order``; None:
    already in it), back in batch order (``inverse``), the prefix scores'
    ``width``, each segment's :class:`_SegmentPart`, and how many rows see
    no prefix (``alone``, last in segment order).

    Made once and kept per thread (:meth:`of`): its masks are computed with
    the first step that uses them and read by the later ones, so a step's
    layers add neither operations nor Python work for it past a key (a
    GPU's decode step is short enough for the host's time to count)."""

    order: Any
    inverse: Any
    width: int
    parts: tuple[_SegmentPart, ...]
    alone: int

    @staticmethod
    def of(batch: int, segments: Sequence[Segment], dtype: Any) -> _DecodeLayout:
        """The layout of ``segments`` over ``batch`` rows, its masks in ``dtype``."""
        return per_layout("cascade", batch, segments, dtype, lambda: _DecodeLayout._make(batch, segments, dtype))

    @staticmethod
    def _make(batch: int, segments: Sequence[Segment], dtype: Any) -> _DecodeLayout:
        import mlx.core as mx

        order = [row for rows, _, _, _ in segments for row in rows]
        grouped = set(order)
        alone = [row for row in range(batch) if row not in grouped]
        order += alone
        permuted = order != list(range(batch))
        parts, start = [], 0
        for rows, _, _, lengths in segments:
            longest = max(lengths)
            hidden = None
            if min(lengths) < longest:
                visible = mx.arange(longest)[None] < mx.array(lengths)[:, None]  # (rows, P)
                hidden = as_bias(visible[:, None, None, None, :], dtype)
            parts.append(_SegmentPart(len(rows), start, longest, hidden))
            start += len(rows)
        order_index = mx.array(order) if permuted else None
        inverse = mx.array(positions_in(order)) if permuted else None
        width = max(part.longest for part in parts)
        return _DecodeLayout(order_index, inverse, width, tuple(parts), len(alone))


def _softmax_out(scores: Any, values: Any, *, masked: bool = False) -> tuple[Any, Any]:
    """Softmax-weighted ``values`` and the log-sum-exp of ``scores`` (last axis).

    ``masked``: some query may see none of these positions (all ``-inf``); it
    then contributes nothing: output 0 and log-sum-exp ``-inf`` (not 0/0).
    One exponential pass over the scores (a log-sum-exp first would be a
    second: on this CPU ``exp`` is most of a softmax's time); the weighted
    values are normalised after the product, where they are few.
    """
    import mlx.core as mx

    top = scores.max(-1, keepdims=True)
    if masked:
        top = mx.where(mx.isinf(top), 0.0, top)
    weights = mx.exp(scores - top)
    total = weights.sum(-1, keepdims=True)
    out = (weights @ values) / (mx.maximum(total, 1e-30) if masked else total)
    return out, top + mx.log(total)
