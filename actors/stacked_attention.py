"""Fused attention over shared prefixes with every row's queries as one
sequence over ``[each group's prefix; every row's suffix]``
(:func:`stacked_attention`): one fused call a layer, each prefix read once,
its shapes padded to stay few.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

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
    round_up,
    spans,
    suffix_mask,
    with_padded_queries,
    zeros,
)
from mlxkv.actors.cascade_attention import cascade_attention

__all__ = ["stacked_attention", "stacked_rows"]


def stacked_attention(
    queries: Any,
    keys: Any,
    values: Any,
    mask: Any,
    scale: float,
    segments: Sequence[Segment],
    *,
    suffix_buffer: Optional[tuple[Any, Any]] = None,
    **_: Any,
) -> Any:
    """Every row's queries as one sequence over ``[each group's prefix; every
    row's suffix]``, masked so that a row sees its part of its group's prefix
    and its own suffix: one fused call, each prefix read once.

    The transient is one copy of the prefixes' visible parts and the
    suffixes laid end to end; the mask is ``(batch * L, prefixes + batch * S)``,
    additive in the queries' dtype (a GPU's fused kernel takes no booleans:
    given them, MLX converts them in every layer), built once a step.

    ``suffix_buffer``: the batch cache's whole suffix buffers ``(keys,
    values)``, ``(batch, kv_heads, C, head_dim)`` whose first ``S`` positions
    are ``keys`` and ``values`` (the rest room for tokens to come, masked
    out; the hook gives them in decode steps). A decode step then attends over all ``C``, so its fused call has
    the same shapes from step to step until the buffer grows (every
    :data:`~mlxkv.cache.shared_prefix.SUFFIX_STEP` tokens): MLX's CUDA
    backend builds a cuDNN graph for every new shape of a fused call (a
    step whose key length grew by one built one every step) and caches
    them by shape. For the same reason a decode step's rows are padded up to
    a power of two (:func:`stacked_rows`: a padded row's query sees one
    zero key, its output is dropped) and its prefixes' parts to a multiple
    of :data:`KEYS_QUANTUM` positions (zero keys no row sees):
    rows come and go every few steps of a busy batch (32 requests over one
    prefix on the built-in model: 42 shapes in 249 steps unpadded), and a
    served batch's prefixes change with them. A prefill chunk's call pads
    its rows' query sequence to a multiple of :data:`QUERIES_QUANTUM` (a
    padded query sees one key; its output is dropped) and its keys to one of
    :data:`KEYS_QUANTUM`, as
    :func:`~mlxkv.actors.banded_attention.gathered_attention` does. Other
    arguments and the result as :func:`cascade_attention`'s.
    """
    import mlx.core as mx

    if is_additive(mask) or not segments:
        return cascade_attention(queries, keys, values, mask, scale, segments)
    batch, heads, length, dim = queries.shape
    used = keys.shape[2]
    if suffix_buffer is not None:
        keys, values = suffix_buffer
    kv_heads, suffix = keys.shape[1], keys.shape[2]
    longests, low, high = per_layout("stacked", batch, segments, None, lambda: spans(batch, segments))
    total = sum(longests)
    if length == 1:
        # A decode step: padded rows, prefix parts padded; the suffix buffer's room is the keys' padding.
        rows, width, room, queries_room = stacked_rows(batch), round_up(total, KEYS_QUANTUM), 0, 0
    else:
        # A prefill chunk: the query sequence and the keys as a whole padded.
        rows, width = batch, total
        room = round_up(total + batch * suffix, KEYS_QUANTUM) - total - batch * suffix
        queries_room = round_up(batch * length, QUERIES_QUANTUM) - batch * length
    # [each segment's part; zeros to `width`; the rows' suffixes; zeros for the padded rows; zeros of `room`]
    stacked_k = [leading(prefix_keys, n) for (_, prefix_keys, _, _), n in zip(segments, longests)]
    stacked_v = [leading(prefix_values, n) for (_, _, prefix_values, _), n in zip(segments, longests)]
    for parts, side in ((stacked_k, keys), (stacked_v, values)):
        parts.append(zeros(side, (1, kv_heads, width - total, side.shape[3])))
        parts.append(side.transpose(1, 0, 2, 3).reshape(1, kv_heads, batch * suffix, side.shape[3]))
        parts.append(zeros(side, (1, kv_heads, (rows - batch) * suffix + room, side.shape[3])))

    def build() -> Any:
        padded = rows - batch
        columns = mx.arange(width)[None]
        # A padded row sees the first column only: every query sees a key.
        starts, stops = mx.array(low + (0,) * padded)[:, None], mx.array(high + (1,) * padded)[:, None]
        seen = (columns >= starts) & (columns < stops)  # (rows, width)
        own = suffix_mask(mask, batch, length, used, width=suffix)[:, 0]  # (batch, L, C)
        if padded:
            own = mx.concatenate([own, mx.zeros((padded, length, suffix), dtype=mx.bool_)])
        index = mx.arange(rows)
        same_row = (index[:, None] == index[None])[:, None, :, None]  # (rows, 1, rows, 1)
        block = (same_row & own[:, :, None, :]).reshape(rows * length, rows * suffix)
        prefix = mx.broadcast_to(seen[:, None, :], (rows, length, width)).reshape(rows * length, width)
        parts = [prefix, block]
        if room:
            parts.append(mx.zeros((rows * length, room), dtype=mx.bool_))
        full = mx.concatenate(parts, axis=-1)
        if queries_room:
            full = with_padded_queries(full, queries_room, axis=0)
        return as_bias(full[None, None], queries.dtype)

    full = per_step(("stacked", batch, length, used, suffix, low, high), mask, build)
    if rows > batch:
        queries = mx.concatenate([queries, zeros(queries, (rows - batch, heads, length, dim))])
    stacked = queries.transpose(1, 0, 2, 3).reshape(1, heads, rows * length, dim)
    if queries_room:
        stacked = mx.concatenate([stacked, zeros(stacked, (1, heads, queries_room, dim))], axis=2)
    all_keys, all_values = joined(stacked_k), joined(stacked_v)
    out = mx.fast.scaled_dot_product_attention(stacked, all_keys, all_values, scale=scale, mask=full)
    if queries_room:
        out = out[:, :, : rows * length]
    return out.reshape(heads, rows, length, -1)[:, :batch].transpose(1, 0, 2, 3)


def stacked_rows(batch: int) -> int:
    """The rows a stacked decode step of ``batch`` rows runs: the next power of two."""
    return 1 << (batch - 1).bit_length()
