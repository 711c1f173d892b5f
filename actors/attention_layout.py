"""How a shared-prefix attention step lays its rows out over their prefixes,
and the masks that say so, built once for all of a step's layers.

A batch's rows each see a part of one prefix (a :data:`Segment`) and their
own suffix. Every way of :mod:`~mlxkv.actors.prefix_attention` derives from
that the same few things: each row's span of the prefixes laid end to end
(:func:`spans`), its suffix's boolean mask (:func:`suffix_mask`), the
additive mask a fused call takes (:func:`as_bias`), padding that keeps a
fused call's shapes few (:data:`KEYS_QUANTUM`, :data:`QUERIES_QUANTUM`,
:func:`with_padded_queries`), and keys laid end to end (:func:`leading`,
:func:`joined`, :func:`zeros`). What a way derives from the rows alone is
kept per thread until they change (:func:`per_layout`); what it derives from
a step's mask object, until the next step (:func:`per_step`): a model's
layers each call attention with the same rows and mask, and on a GPU a
decode step is short enough for the host's time to count.

Invariants: a kept value is returned only for the key it was made for (and,
for :func:`per_step`, the same mask object); each thread keeps its own (the
MLX thread runs the model; a test's thread does not displace it).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Callable, Optional

__all__ = [
    "KEYS_QUANTUM",
    "QUERIES_QUANTUM",
    "Segment",
    "as_bias",
    "is_additive",
    "joined",
    "leading",
    "per_layout",
    "per_step",
    "positions_in",
    "round_up",
    "spans",
    "suffix_mask",
    "with_padded_queries",
    "zeros",
]

#: ``(rows, prefix keys, prefix values, lengths)``: the batch rows that attend
#: to one prefix ``(1, kv_heads, P, head_dim)``, each to its first ``lengths[i]`` positions.
Segment = tuple[list[int], Any, Any, list[int]]

#: A fused call's keys are padded to a multiple of this many positions (a
#: stacked decode step's prefix parts, a prefill call's keys), and a
#: prefill call's queries to a multiple of ``QUERIES_QUANTUM``:
#: MLX's CUDA backend builds a cuDNN graph for every new shape (see
#: :func:`~mlxkv.actors.stacked_attention.stacked_attention` and
#: :func:`~mlxkv.actors.banded_attention.banded_attention`).
KEYS_QUANTUM = 256
QUERIES_QUANTUM = 32


#: Per thread, each way's last layout: ``{way: (key, layout)}``.
_LAST_LAYOUTS = threading.local()


def per_layout(way: str, batch: int, segments: Sequence[Segment], extra: Any, make: Callable[[], Any]) -> Any:
    """``make()``, or what it gave for ``way`` on this thread when the batch's
    rows saw the same parts of their prefixes (and ``extra`` was the same):
    what a way derives from that alone holds for every layer of a step and
    every step until the rows change."""
    key = (batch, extra, tuple((tuple(rows), tuple(lengths)) for rows, _, _, lengths in segments))
    layouts = getattr(_LAST_LAYOUTS, "by_way", None)
    if layouts is None:
        layouts = _LAST_LAYOUTS.by_way = {}
    last = layouts.get(way)
    if last is not None and last[0] == key:
        return last[1]
    layout = make()
    layouts[way] = (key, layout)
    return layout


#: Per thread, the last of each kind of per-step work built (a way's mask;
#: the kernel's step launch), for the next layers of the same step.
_LAST_STEP = threading.local()


def per_step(key: tuple[Any, ...], mask: Any, build: Callable[[], Any], *, slot: str = "mask") -> Any:
    """``build()``, or what it gave for the same ``key`` and the same ``mask``
    object in ``slot``: a step's layers share one mask (the model makes it
    once a step), so every layer after the first reuses the full mask
    instead of adding its operations again. Work that one layer does beside
    another's takes a slot of its own (the kernel's launch, whose step may
    go on to build ``mixed``'s mask), so neither replaces the other."""
    last = getattr(_LAST_STEP, slot, None)
    if last is not None and last[0] == key and last[1] is mask:
        return last[2]
    full = build()
    setattr(_LAST_STEP, slot, (key, mask, full))
    return full


def spans(batch: int, segments: Sequence[Segment]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Each segment's longest part, and each row's visible span ``[low, high)``
    of the segments' parts laid end to end (rows in no segment: empty)."""
    low, high, longests, start = [0] * batch, [0] * batch, [], 0
    for rows, _, _, lengths in segments:
        longest = max(lengths)
        for row, n in zip(rows, lengths):
            low[row], high[row] = start, start + n
        longests.append(longest)
        start += longest
    return tuple(longests), tuple(low), tuple(high)


def positions_in(order: Sequence[int], rows: Optional[int] = None) -> list[int]:
    """Each of ``rows`` rows' position in ``order`` (default: ``order`` holds
    every row once; ``-1`` entries, empty places, are no row's)."""
    where = [0] * (len(order) if rows is None else rows)
    for position, row in enumerate(order):
        if row >= 0:
            where[row] = position
    return where


def suffix_mask(mask: Any, batch: int, length: int, suffix: int, width: Optional[int] = None) -> Any:
    """The suffix's boolean mask as ``(batch, 1, L, S)``: all visible for None,
    the last ``L`` of ``S`` positions' causal mask for ``"causal"``; with
    ``width`` past ``S``, as ``(batch, 1, L, width)``, positions past ``S``
    hidden."""
    import mlx.core as mx

    if mask is None:
        own = mx.ones((batch, 1, length, suffix), dtype=mx.bool_)
    elif isinstance(mask, str):
        causal = mx.arange(suffix - length, suffix)[:, None] >= mx.arange(suffix)[None]
        own = mx.broadcast_to(causal[None, None], (batch, 1, length, suffix))
    else:
        mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
        own = mx.broadcast_to(mask, (batch, 1, length, suffix))
    if width is None or width == suffix:
        return own
    return mx.concatenate([own, mx.zeros((batch, 1, length, width - suffix), dtype=mx.bool_)], axis=-1)


def as_bias(visible: Any, dtype: Any) -> Any:
    """A boolean mask as the additive one a fused call takes without converting it:
    0 where visible, ``-inf`` elsewhere, in ``dtype``."""
    import mlx.core as mx

    return mx.where(visible, mx.array(0, dtype=dtype), mx.array(-mx.inf, dtype=dtype))


def is_additive(mask: Any) -> bool:
    """Whether ``mask`` is an additive array (the fused ways take boolean masks;
    shared-prefix caches give those or none)."""
    import mlx.core as mx

    return mask is not None and not isinstance(mask, str) and mask.dtype != mx.bool_


def with_padded_queries(visible: Any, count: int, *, axis: int) -> Any:
    """The boolean mask ``visible`` with ``count`` padded queries more along
    ``axis``, each seeing the first key only: every query must see a key (an
    all-hidden row is 0/0), and a padded query's output is dropped."""
    import mlx.core as mx

    shape = list(visible.shape)
    shape[axis] = count
    first = mx.arange(visible.shape[-1]) == 0
    return mx.concatenate([visible, mx.broadcast_to(first, shape)], axis=axis)


def leading(array: Any, width: int) -> Any:
    """``array``'s first ``width`` positions (axis 2), zero-padded if it has fewer."""
    import mlx.core as mx

    size = array.shape[2]
    if size == width:
        return array
    if size > width:
        return array[:, :, :width]
    b, h, _, d = array.shape
    return mx.concatenate([array, zeros(array, (b, h, width - size, d))], axis=2)


def joined(parts: Sequence[Any]) -> Any:
    """``parts`` concatenated along the positions (axis 2), empty ones left out
    (one part alone: itself, not a copy)."""
    import mlx.core as mx

    kept = [part for part in parts if part.shape[2]]
    return kept[0] if len(kept) == 1 else mx.concatenate(kept, axis=2)


def zeros(like: Any, shape: tuple[int, ...]) -> Any:
    """Zeros of ``shape`` in ``like``'s dtype, as a broadcast scalar (no kernel of their own)."""
    import mlx.core as mx

    return mx.broadcast_to(mx.array(0, dtype=like.dtype), shape)


def round_up(n: int, quantum: int) -> int:
    """``n`` rounded up to a multiple of ``quantum``."""
    return -(-n // quantum) * quantum
