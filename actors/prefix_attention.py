"""Attention over shared prefixes: each row of a batch attends to its part of
a prefix held once (a :class:`~mlxkv.cache.shared_prefix.PrefixGroup`'s buffer)
and to its own suffix, exactly as fused attention over that row's prefix part
followed by its suffix would.

Five ways, all with the signature ``(queries, keys, values, mask, scale,
segments) -> output`` (see :func:`cascade_attention` for the arguments):

- :func:`cascade_attention` -- each group's queries against its prefix in one
  matrix product, merged with every row's suffix attention through the
  softmax statistics (log-sum-exp: the cascade / Hydragen idea). The prefix
  is read once, the scores are materialised in float32; about twenty MLX
  operations a layer. Best on a CPU, where a call's arithmetic is its cost.
- :func:`gathered_attention` -- each row's prefix part copied beside its
  suffix for this call only (one transient of the rows' prefixes a layer,
  freed with the layer's attention) and one fused
  ``mx.fast.scaled_dot_product_attention`` over them, a row a batch entry
  with its mask: the same kernel mlx-lm's batched decoding runs.
- :func:`stacked_attention` -- every row's queries laid end to end as one
  query sequence over ``[each group's prefix; every row's suffix]``, with a
  mask that lets a row see its part of its prefix and its own suffix only:
  one fused call, each prefix read once, one short transient.
- :func:`mixed_attention` -- a decode step as matrix products a KV head
  (every row's queries of a head against the prefixes in one product, each
  head of a prefix read once for all of them), a prefill chunk in bands:
  rows of a prefix laid end to end over one copy of it, as many a band as
  leave the masked work near the gathered call's.
- :func:`kernel_attention` -- a decode step by one CUDA kernel a layer
  (:mod:`~mlxkv.actors.decode_kernel`: every row over its part of its prefix
  where it is held and its own suffix) where MLX runs on CUDA and the kernel
  takes the step; everything else as :func:`mixed_attention`.

On a GPU a call's kernels, not its bytes, dominate at these sizes (fused
attention over per-row copies beat the cascade there, a prefill chunk by far
more than a decode step), so which one serves is chosen per device (:class:`PrefixAttention`, :func:`attention_for`); the figures behind
each choice are in docs/benchmarks.md (``scripts/bench_attention.py``).

Nothing here evaluates inside a model call except the cascade's slices of a
long prefix (``evaluate_slices``: on the CPU they bound a prefill's score
transient; the fused ways have none to bound).
"""

from __future__ import annotations

import enum
import functools
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional

import attrs

from mlxkv.actors import decode_kernel

if TYPE_CHECKING:
    from mlxkv.cache.shared_prefix import BatchRows

__all__ = [
    "JOINED_SCORES",
    "SCORE_ELEMENTS",
    "PrefixAttention",
    "Segment",
    "attention_for",
    "cascade_attention",
    "gathered_attention",
    "kernel_attention",
    "mixed_attention",
    "stacked_attention",
]

#: ``(rows, prefix keys, prefix values, lengths)``: the batch rows that attend
#: to one prefix ``(1, kv_heads, P, head_dim)``, each to its first ``lengths[i]`` positions.
Segment = tuple[list[int], Any, Any, list[int]]


class PrefixAttention(enum.Enum):
    """Which way a runner attends over shared prefixes (see the module docstring)."""

    CASCADE = "cascade"
    GATHERED = "gathered"
    STACKED = "stacked"
    #: decode steps as products a KV head, prefill chunks in bands
    MIXED = "mixed"
    #: decode steps by one CUDA kernel a layer where it serves, else as ``mixed``
    KERNEL = "kernel"

    @classmethod
    def for_device(cls, device: Optional[Any] = None) -> PrefixAttention:
        """The way for ``device`` (default: MLX's default device): the cascade on
        the CPU; on a GPU, ``mixed`` -- decode steps as products a KV head,
        prefill chunks in bands over a copy of the prefix each (the H200's
        figures and the counts behind the choice: docs/benchmarks.md) --
        with its decode steps in one kernel a layer where MLX runs on CUDA
        (``kernel``: by its launches, a decode step's fewest; its own check
        at first use falls back to ``mixed``)."""
        import mlx.core as mx

        device = device if device is not None else mx.default_device()
        if device.type == mx.DeviceType.cpu:
            return cls.CASCADE
        return cls.KERNEL if decode_kernel.on_cuda(device) else cls.MIXED


def attention_for(way: PrefixAttention) -> Callable[..., Any]:
    """The function of ``way``."""
    return {
        PrefixAttention.CASCADE: cascade_attention,
        PrefixAttention.GATHERED: gathered_attention,
        PrefixAttention.STACKED: stacked_attention,
        PrefixAttention.MIXED: mixed_attention,
        PrefixAttention.KERNEL: kernel_attention,
    }[way]


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
            :func:`stacked_attention`); the cascade attends to ``keys`` and
            ``values`` as given.

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
        scores = q_rows @ _leading(prefix_keys, part.longest)[:, :, None].swapaxes(-1, -2)  # (rows, kv, rep, 1, P)
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
        prefix_outs.append(weighted[..., : part.longest] @ _leading(prefix_values, part.longest)[:, :, None])
    if layout.alone:
        prefix_outs.append(mx.zeros((layout.alone, *prefix_outs[0].shape[1:]), dtype=prefix_outs[0].dtype))
    out = out + (prefix_outs[0] if len(prefix_outs) == 1 else mx.concatenate(prefix_outs))
    if layout.inverse is not None:
        out = out[layout.inverse]
    return out.astype(queries.dtype).reshape(batch, heads, 1, -1)


def _head_first(weights: Any, values: Any) -> Any:
    """``weights`` ``(rows, kv_heads, repeats, P)`` times one prefix's
    ``values`` ``(kv_heads, P, dim)`` as one product a KV head over every row
    -- ``(rows * repeats, P) x (P, dim)``, a single batched GEMM -- laid back
    out a row first: ``(rows, kv_heads, repeats, dim)``."""
    rows, kv_heads, repeats, width = weights.shape
    out = weights.transpose(1, 0, 2, 3).reshape(kv_heads, rows * repeats, width) @ values
    return out.reshape(kv_heads, rows, repeats, -1).transpose(1, 0, 2, 3)


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
        return _per_layout("cascade", batch, segments, dtype, lambda: _DecodeLayout._make(batch, segments, dtype))

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
                hidden = _as_bias(visible[:, None, None, None, :], dtype)
            parts.append(_SegmentPart(len(rows), start, longest, hidden))
            start += len(rows)
        order_index = mx.array(order) if permuted else None
        inverse = mx.array(_inverse(order)) if permuted else None
        width = max(part.longest for part in parts)
        return _DecodeLayout(order_index, inverse, width, tuple(parts), len(alone))


#: Per thread, each way's last layout: ``{way: (key, layout)}``.
_LAST_LAYOUTS = threading.local()


def _per_layout(way: str, batch: int, segments: Sequence[Segment], extra: Any, make: Callable[[], Any]) -> Any:
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


#: The most prefix scores one slice of :func:`cascade_attention` computes at once.
SCORE_ELEMENTS = 1 << 18


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


def gathered_attention(
    queries: Any, keys: Any, values: Any, mask: Any, scale: float, segments: Sequence[Segment], **_: Any
) -> Any:
    """Fused attention over each row's prefix part and its suffix, side by side.

    The rows' prefix parts are gathered for this call into one
    ``(batch, kv_heads, W, head_dim)`` transient (``W``: the longest part any
    row sees; a row sees its own part, the rest is masked), put before the
    suffixes, and one fused call runs over all of it: a batch entry a row
    (:func:`_banded_attention`, a band a row). The prefix stays held once;
    the transient is freed with the layer's attention. Arguments and result
    as :func:`cascade_attention`'s.
    """
    if _additive(mask) or not segments:
        return cascade_attention(queries, keys, values, mask, scale, segments)
    return _banded_attention(queries, keys, values, mask, scale, segments, 1)


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
    order. Made once a layout and kept per thread, like
    :class:`_DecodeLayout`."""

    slots: tuple[int, ...]
    segment_bands: tuple[int, ...]
    seen: tuple[int, ...]
    index: Any
    inverse: Any

    @staticmethod
    def of(batch: int, segments: Sequence[Segment], band: int) -> _Bands:
        return _per_layout("banded", batch, segments, band, lambda: _Bands._make(batch, segments, band))

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
            inverse = mx.array(_inverse(slots, batch))
        return _Bands(tuple(slots), segment_bands, tuple(seen), index, inverse)


def _banded_attention(
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
        padded_len = _round_up(queries_len, QUERIES_QUANTUM)
        room = _round_up(width + band * suffix, KEYS_QUANTUM) - width - band * suffix
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
            part = _leading(segment[which], width)
            parts.append(mx.broadcast_to(part, (count, *part.shape[1:])))
        if bands > sum(layout.segment_bands):
            parts.append(_zeros(like, (bands - sum(layout.segment_bands), kv_heads, width, like.shape[3])))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)

    def build() -> Any:
        visible = mx.arange(width)[None] < mx.array(layout.seen)[:, None]  # (places, W)
        own = _suffix_mask(mask, batch, length, suffix)  # (batch, 1, L, S)
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
            full = _with_padded_queries(full, padded_len - queries_len, axis=1)
        return _as_bias(full[:, None], queries.dtype)  # (bands, 1, padded_len, keys)

    full = _per_step(("banded", batch, length, suffix, width, band, layout.slots, layout.seen), mask, build)
    banded = in_bands(queries)
    if padded_len > queries_len:
        banded = mx.concatenate([banded, _zeros(banded, (bands, heads, padded_len - queries_len, dim))], axis=2)
    all_keys = _joined([prefix_parts(1, keys), in_bands(keys), _zeros(keys, (bands, kv_heads, room, dim))])
    all_values = _joined(
        [prefix_parts(2, values), in_bands(values), _zeros(values, (bands, kv_heads, room, values.shape[3]))]
    )
    out = mx.fast.scaled_dot_product_attention(banded, all_keys, all_values, scale=scale, mask=full)
    if padded_len > queries_len:
        out = out[:, :, :queries_len]
    if band > 1:
        out = out.reshape(bands, heads, band, length, -1).transpose(0, 2, 1, 3, 4).reshape(bands * band, heads, length, -1)
    return out if layout.inverse is None else out[layout.inverse]


def mixed_attention(
    queries: Any, keys: Any, values: Any, mask: Any, scale: float, segments: Sequence[Segment], **options: Any
) -> Any:
    """A decode step (one query a row) as products a KV head
    (:func:`_decode_by_head`; a lone row, an additive mask, or more than
    :data:`JOINED_SCORES` joined prefix scores, by :func:`cascade_attention`),
    a prefill chunk in bands (:func:`_banded_attention`, rows a band by
    :func:`prefill_band`: one copy of a prefix for many rows where their
    suffixes are short beside it, a copy a row where they are not).
    On a GPU a decode step's gathered copies cost as much time as the
    cascade and hold every layer's copies of the prefix until the step's
    kernels finish (a peak several times the cascade's), and the cascade's
    prefix products are a vector product a row and query head; a prefill
    chunk's cascade is several gathered calls' time, and a gathered chunk's
    copies were most of the GPU's peak memory (the H200 figures:
    docs/benchmarks.md)."""
    if queries.shape[2] > 1:
        if _additive(mask) or not segments:
            return cascade_attention(queries, keys, values, mask, scale, segments, **options)
        band = prefill_band(queries.shape[0], segments, keys.shape[2])
        return _banded_attention(queries, keys, values, mask, scale, segments, band)
    batch, heads = queries.shape[:2]
    if (
        _additive(mask)
        or not segments
        or (batch == 1 and len(segments) == 1)
        or (len(segments) > 1 and batch * heads * sum(max(n) for *_, n in segments) > JOINED_SCORES)
    ):
        return cascade_attention(queries, keys, values, mask, scale, segments, **options)
    return _decode_by_head(queries, keys, values, mask, scale, segments)


def kernel_attention(
    queries: Any,
    keys: Any,
    values: Any,
    mask: Any,
    scale: float,
    segments: Sequence[Segment],
    *,
    suffix_buffer: Optional[tuple[Any, Any]] = None,
    rows: Optional[BatchRows] = None,
    **options: Any,
) -> Any:
    """A decode step by one kernel a layer
    (:func:`~mlxkv.actors.decode_kernel.decode_attention`) where it serves:
    MLX's CUDA backend, a batch cache's step (``suffix_buffer``: its whole
    suffix buffers; ``rows``: its rows' segments, prefix lengths and left
    padding, which its boolean mask -- or none, for no padding -- says
    again), shapes and prefixes the kernel takes, and a kernel of that build
    that passed its check in this process (the first step of a build checks
    it: a wait, once). Everything else -- prefill chunks, other devices, an
    additive mask -- as :func:`mixed_attention`.

    Whether the kernel serves, and its launch but the layer's own arrays
    (the rows' layout, an input; template, grid), are made by a step's first
    layer and looked up by the rest (by the rows -- their segments say how
    many prefixes --, the suffix's length, the queries' shape and dtype and
    the KV heads: a step's layers are one model's, one dtype), so a layer
    costs the host a lookup and the call."""
    if queries.shape[2] == 1 and suffix_buffer is not None and rows is not None:
        length = keys.shape[2]
        step = _per_step(
            ("kernel", rows, length, queries.shape, keys.shape[1], queries.dtype),
            mask,
            lambda: _kernel_step(queries, keys.shape[1], mask, segments, suffix_buffer, rows.padding, length),
            slot="kernel",
        )
        if step is not None:
            return decode_kernel.decode_attention(queries, *suffix_buffer, length, rows.padding, scale, segments, step)
    return mixed_attention(queries, keys, values, mask, scale, segments, suffix_buffer=suffix_buffer, **options)


def _kernel_step(
    queries: Any, kv_heads: int, mask: Any, segments: Sequence[Segment], suffix_buffer: tuple[Any, Any],
    padding: Sequence[int], length: int,
) -> Any:
    """The kernel's :func:`~mlxkv.actors.decode_kernel.step_launch` for this
    step (its layers share ``mask``), or None where the kernel does not
    serve it."""
    if (
        _additive(mask)
        or not decode_kernel.supported(queries, segments, suffix_buffer)
        or not decode_kernel.usable(queries.dtype, queries.shape[3], queries.shape[1], kv_heads)
    ):
        return None
    return decode_kernel.step_launch(queries, kv_heads, segments, padding, length)


#: The most prefix scores a decode step by head computes over several
#: prefixes joined (each row scores every prefix, most of them masked):
#: past it (many long prefixes at once) the step goes by the cascade, which
#: scores a row against its own prefix only. 2^25: 64 MiB of half-precision
#: scores a layer, e.g. 32 rows of 32 heads over 32,768 joined positions.
JOINED_SCORES = 1 << 25


def _decode_by_head(
    queries: Any, keys: Any, values: Any, mask: Any, scale: float, segments: Sequence[Segment]
) -> Any:
    """A decode step over shared prefixes as products a KV head: the prefixes'
    parts the rows see, laid end to end (one prefix: its buffer, no copy),
    are scored against every row's queries of a KV head in one matrix product
    -- ``(batch * repeats, head_dim) x (head_dim, W)``: each head of the
    prefix read once for all of them, where :func:`cascade_attention`'s
    decode runs a vector product a row and query head and a pair of them a
    prefix -- and weighted the same way; each row sees its own part only
    (``-inf`` elsewhere; the mask, with the suffix's, built once a step; a
    batch whose rows all see the whole of one prefix masks only the
    suffixes' scores, not a pass over them all).
    One softmax over the prefix and suffix scores side by side, in float32
    (``precise``). A step's operations do not grow with its prefixes; the
    price is scores a row does not see, the other prefixes' (a GPU's decode
    step is its kernels, not this arithmetic; the CPU keeps the cascade: in
    float32 there a call of either takes the same time, and the cascade
    scores a row against its own prefix only).
    Arguments and result as :func:`cascade_attention`'s (the mask boolean
    or None).
    """
    import mlx.core as mx

    batch, heads, _, dim = queries.shape
    kv_heads, suffix = keys.shape[1], keys.shape[2]
    repeats = heads // kv_heads
    longests, low, high = _per_layout("by head", batch, segments, None, lambda: _stacked_spans(batch, segments))
    width = sum(longests)
    prefix_k = _joined([_leading(k, n) for (_, k, _, _), n in zip(segments, longests)]).squeeze(0)  # (kv, W, dim)
    prefix_v = _joined([_leading(v, n) for (_, _, v, _), n in zip(segments, longests)]).squeeze(0)

    # Every row sees all of one prefix (a batch over one system prompt): only the suffix is masked.
    whole = len(segments) == 1 and min(high) == width

    def build() -> Any:
        if whole and mask is None:
            return None
        own = _suffix_mask(mask, batch, 1, suffix).reshape(batch, suffix)
        if whole:
            seen = mx.ones((batch, width), dtype=mx.bool_)
        else:
            columns = mx.arange(width)[None]
            seen = (columns >= mx.array(low)[:, None]) & (columns < mx.array(high)[:, None])  # (batch, W)
        return _as_bias(mx.concatenate([seen, own], axis=-1)[None, :, None, :], queries.dtype)  # (1, batch, 1, W + S)

    bias = _per_step(("by head", batch, suffix, width, low, high, whole, queries.dtype), mask, build)
    # The prefix products a KV head first, (kv_heads, batch * repeats, ...): one
    # product a head for every row. The suffix products a row first, (batch,
    # kv_heads, ...), as the suffixes are held: their batch axes then collapse
    # into one, one cuBLAS call on MLX's CUDA backend, which runs batch axes
    # that do not (a KV head's rows of the suffixes are not one stride apart)
    # as a kernel writing a pointer array and a call over it
    # (scripts/cuda_matmul.py). The scale and the mask go on the joined
    # scores in one fused kernel (a multiply of the queries and an add of
    # the mask were a kernel each).
    q_by_row = queries.reshape(batch, kv_heads, repeats, dim)
    q_by_head = q_by_row.transpose(1, 0, 2, 3)
    prefix_scores = q_by_head.reshape(kv_heads, batch * repeats, dim) @ prefix_k.swapaxes(-1, -2)
    own_scores = (q_by_row @ keys.swapaxes(-1, -2)).transpose(1, 0, 2, 3)  # (kv, batch, rep, S)
    scores = mx.concatenate([prefix_scores.reshape(kv_heads, batch, repeats, width), own_scores], axis=-1)
    weights = mx.softmax(_scaled(scale, masked=bias is not None)(scores, bias), axis=-1, precise=True)
    by_row = weights.transpose(1, 0, 2, 3)  # (batch, kv, rep, W + S)
    out = by_row[..., width:] @ values + _head_first(by_row[..., :width], prefix_v)
    return out.reshape(batch, heads, 1, -1)


@functools.lru_cache(maxsize=None)
def _scaled(scale: float, *, masked: bool) -> Callable[[Any, Any], Any]:
    """``scores * scale`` (``+ bias`` where ``masked``; else the bias is
    None) as one compiled function: one kernel on a GPU for any shape."""
    import mlx.core as mx

    if masked:
        return mx.compile(lambda scores, bias: scores * scale + bias, shapeless=True)
    return mx.compile(lambda scores, _bias: scores * scale, shapeless=True)


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
    :data:`KEYS_QUANTUM`, as :func:`gathered_attention` does. Other arguments and the
    result as :func:`cascade_attention`'s.
    """
    import mlx.core as mx

    if _additive(mask) or not segments:
        return cascade_attention(queries, keys, values, mask, scale, segments)
    batch, heads, length, dim = queries.shape
    used = keys.shape[2]
    if suffix_buffer is not None:
        keys, values = suffix_buffer
    kv_heads, suffix = keys.shape[1], keys.shape[2]
    longests, low, high = _per_layout("stacked", batch, segments, None, lambda: _stacked_spans(batch, segments))
    total = sum(longests)
    if length == 1:
        # A decode step: padded rows, prefix parts padded; the suffix buffer's room is the keys' padding.
        rows, width, room, queries_room = stacked_rows(batch), _round_up(total, KEYS_QUANTUM), 0, 0
    else:
        # A prefill chunk: the query sequence and the keys as a whole padded.
        rows, width = batch, total
        room = _round_up(total + batch * suffix, KEYS_QUANTUM) - total - batch * suffix
        queries_room = _round_up(batch * length, QUERIES_QUANTUM) - batch * length
    # [each segment's part; zeros to `width`; the rows' suffixes; zeros for the padded rows; zeros of `room`]
    stacked_k = [_leading(prefix_keys, n) for (_, prefix_keys, _, _), n in zip(segments, longests)]
    stacked_v = [_leading(prefix_values, n) for (_, _, prefix_values, _), n in zip(segments, longests)]
    for parts, side in ((stacked_k, keys), (stacked_v, values)):
        parts.append(_zeros(side, (1, kv_heads, width - total, side.shape[3])))
        parts.append(side.transpose(1, 0, 2, 3).reshape(1, kv_heads, batch * suffix, side.shape[3]))
        parts.append(_zeros(side, (1, kv_heads, (rows - batch) * suffix + room, side.shape[3])))

    def build() -> Any:
        padded = rows - batch
        columns = mx.arange(width)[None]
        # A padded row sees the first column only: every query sees a key.
        starts, stops = mx.array(low + (0,) * padded)[:, None], mx.array(high + (1,) * padded)[:, None]
        seen = (columns >= starts) & (columns < stops)  # (rows, width)
        own = _suffix_mask(mask, batch, length, used, width=suffix)[:, 0]  # (batch, L, C)
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
            full = _with_padded_queries(full, queries_room, axis=0)
        return _as_bias(full[None, None], queries.dtype)

    full = _per_step(("stacked", batch, length, used, suffix, low, high), mask, build)
    if rows > batch:
        queries = mx.concatenate([queries, _zeros(queries, (rows - batch, heads, length, dim))])
    stacked = queries.transpose(1, 0, 2, 3).reshape(1, heads, rows * length, dim)
    if queries_room:
        stacked = mx.concatenate([stacked, _zeros(stacked, (1, heads, queries_room, dim))], axis=2)
    all_keys, all_values = _joined(stacked_k), _joined(stacked_v)
    out = mx.fast.scaled_dot_product_attention(stacked, all_keys, all_values, scale=scale, mask=full)
    if queries_room:
        out = out[:, :, : rows * length]
    return out.reshape(heads, rows, length, -1)[:, :batch].transpose(1, 0, 2, 3)


#: A fused call's keys are padded to a multiple of this many positions (a
#: stacked decode step's prefix parts, a prefill call's keys), and a
#: prefill call's queries to a multiple of ``QUERIES_QUANTUM``:
#: MLX's CUDA backend builds a cuDNN graph for every new shape (see
#: :func:`stacked_attention` and :func:`gathered_attention`).
KEYS_QUANTUM = 256
QUERIES_QUANTUM = 32


def stacked_rows(batch: int) -> int:
    """The rows a stacked decode step of ``batch`` rows runs: the next power of two."""
    return 1 << (batch - 1).bit_length()


def _round_up(n: int, quantum: int) -> int:
    return -(-n // quantum) * quantum


def _with_padded_queries(visible: Any, count: int, *, axis: int) -> Any:
    """The boolean mask ``visible`` with ``count`` padded queries more along
    ``axis``, each seeing the first key only: every query must see a key (an
    all-hidden row is 0/0), and a padded query's output is dropped."""
    import mlx.core as mx

    shape = list(visible.shape)
    shape[axis] = count
    first = mx.arange(visible.shape[-1]) == 0
    return mx.concatenate([visible, mx.broadcast_to(first, shape)], axis=axis)


def _joined(parts: Sequence[Any]) -> Any:
    """``parts`` concatenated along the positions (axis 2), empty ones left out
    (one part alone: itself, not a copy)."""
    import mlx.core as mx

    kept = [part for part in parts if part.shape[2]]
    return kept[0] if len(kept) == 1 else mx.concatenate(kept, axis=2)


def _zeros(like: Any, shape: tuple[int, ...]) -> Any:
    """Zeros of ``shape`` in ``like``'s dtype, as a broadcast scalar (no kernel of their own)."""
    import mlx.core as mx

    return mx.broadcast_to(mx.array(0, dtype=like.dtype), shape)


def _stacked_spans(batch: int, segments: Sequence[Segment]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
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


#: Per thread, the last of each kind of per-step work built (a way's mask;
#: the kernel's step launch), for the next layers of the same step.
_LAST_STEP = threading.local()


def _per_step(key: tuple[Any, ...], mask: Any, build: Callable[[], Any], *, slot: str = "mask") -> Any:
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


def _additive(mask: Any) -> bool:
    """Whether ``mask`` is an additive array (the fused ways take boolean masks;
    shared-prefix caches give those or none)."""
    import mlx.core as mx

    return mask is not None and not isinstance(mask, str) and mask.dtype != mx.bool_


def _leading(array: Any, width: int) -> Any:
    """``array``'s first ``width`` positions (axis 2), zero-padded if it has fewer."""
    import mlx.core as mx

    size = array.shape[2]
    if size == width:
        return array
    if size > width:
        return array[:, :, :width]
    b, h, _, d = array.shape
    return mx.concatenate([array, _zeros(array, (b, h, width - size, d))], axis=2)


def _suffix_mask(mask: Any, batch: int, length: int, suffix: int, width: Optional[int] = None) -> Any:
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


def _as_bias(visible: Any, dtype: Any) -> Any:
    """A boolean mask as the additive one a fused call takes without converting it:
    0 where visible, ``-inf`` elsewhere, in ``dtype``."""
    import mlx.core as mx

    return mx.where(visible, mx.array(0, dtype=dtype), mx.array(-mx.inf, dtype=dtype))


def _inverse(order: Sequence[int], rows: Optional[int] = None) -> list[int]:
    """Each of ``rows`` rows' position in ``order`` (default: ``order`` holds
    every row once; ``-1`` entries, empty places, are no row's)."""
    where = [0] * (len(order) if rows is None else rows)
    for position, row in enumerate(order):
        if row >= 0:
            where[row] = position
    return where
