"""Attention over shared prefixes: each row of a batch attends to its part of
a prefix held once (a :class:`~mlxkv.cache.shared_prefix.PrefixGroup`'s buffer)
and to its own suffix, exactly as fused attention over that row's prefix part
followed by its suffix would.

Five ways, all with the signature ``(queries, keys, values, mask, scale,
segments) -> output`` (the arguments: :func:`cascade_attention`). This
module chooses among them and holds the GPU's two; the other three have a
module each, and what they all build a step from is
:mod:`~mlxkv.actors.attention_layout`'s:

- :func:`~mlxkv.actors.cascade_attention.cascade_attention` -- each group's
  queries against its prefix in one matrix product, merged with every row's
  suffix attention through the softmax statistics (log-sum-exp: the cascade
  / Hydragen idea). The prefix is read once, the scores are materialised in
  float32; about twenty MLX operations a layer. Best on a CPU, where a
  call's arithmetic is its cost.
- :func:`~mlxkv.actors.banded_attention.gathered_attention` -- each row's
  prefix part copied beside its suffix for this call only (one transient of
  the rows' prefixes a layer, freed with the layer's attention) and one
  fused ``mx.fast.scaled_dot_product_attention`` over them, a row a batch
  entry with its mask: the same kernel mlx-lm's batched decoding runs.
- :func:`~mlxkv.actors.stacked_attention.stacked_attention` -- every row's
  queries laid end to end as one query sequence over ``[each group's
  prefix; every row's suffix]``, with a mask that lets a row see its part of
  its prefix and its own suffix only: one fused call, each prefix read
  once, one short transient.
- :func:`mixed_attention` -- a decode step as matrix products a KV head
  (every row's queries of a head against the prefixes in one product, each
  head of a prefix read once for all of them), a prefill chunk in bands
  (:func:`~mlxkv.actors.banded_attention.banded_attention`): rows of a
  prefix laid end to end over one copy of it, as many a band as leave the
  masked work near the gathered call's.
- :func:`kernel_attention` -- a decode step by one CUDA kernel a layer
  (:mod:`~mlxkv.actors.decode_kernel`: every row over its part of its prefix
  where it is held and its own suffix) where MLX runs on CUDA and the kernel
  takes the step; everything else as :func:`mixed_attention`.

On a GPU a call's kernels, not its bytes, dominate at these sizes (fused
attention over per-row copies beat the cascade there, a prefill chunk by far
more than a decode step), so which one serves is chosen per device
(:class:`PrefixAttention`, :func:`attention_for`); the figures behind each
choice are in docs/benchmarks.md (``scripts/bench_attention.py``).

Nothing here evaluates inside a model call except the cascade's slices of a
long prefix (``evaluate_slices``: on the CPU they bound a prefill's score
transient; the fused ways have none to bound).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional

from mlxkv.actors import decode_kernel
from mlxkv.actors.attention_layout import (
    Segment,
    as_bias,
    is_additive,
    joined,
    leading,
    per_layout,
    per_step,
    spans,
    suffix_mask,
)
from mlxkv.actors.banded_attention import banded_attention, gathered_attention, prefill_band
from mlxkv.actors.cascade_attention import cascade_attention
from mlxkv.actors.stacked_attention import stacked_attention

if TYPE_CHECKING:
    from mlxkv.cache.shared_prefix import BatchRows

__all__ = [
    "JOINED_SCORES",
    "PrefixAttention",
    "Segment",
    "attention_for",
    "cascade_attention",
    "gathered_attention",
    "kernel_attention",
    "mixed_attention",
    "stacked_attention",
]


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


def mixed_attention(
    queries: Any, keys: Any, values: Any, mask: Any, scale: float, segments: Sequence[Segment], **options: Any
) -> Any:
    """A decode step (one query a row) as products a KV head
    (:func:`_decode_by_head`; a lone row, an additive mask, or more than
    :data:`JOINED_SCORES` joined prefix scores, by :func:`cascade_attention`),
    a prefill chunk in bands (:func:`banded_attention`, rows a band by
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
        if is_additive(mask) or not segments:
            return cascade_attention(queries, keys, values, mask, scale, segments, **options)
        band = prefill_band(queries.shape[0], segments, keys.shape[2])
        return banded_attention(queries, keys, values, mask, scale, segments, band)
    batch, heads = queries.shape[:2]
    if (
        is_additive(mask)
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
        step = per_step(
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
        is_additive(mask)
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
    longests, low, high = per_layout("by head", batch, segments, None, lambda: spans(batch, segments))
    width = sum(longests)
    prefix_k = joined([leading(k, n) for (_, k, _, _), n in zip(segments, longests)]).squeeze(0)  # (kv, W, dim)
    prefix_v = joined([leading(v, n) for (_, _, v, _), n in zip(segments, longests)]).squeeze(0)

    # Every row sees all of one prefix (a batch over one system prompt): only the suffix is masked.
    whole = len(segments) == 1 and min(high) == width

    def build() -> Any:
        if whole and mask is None:
            return None
        own = suffix_mask(mask, batch, 1, suffix).reshape(batch, suffix)
        if whole:
            seen = mx.ones((batch, width), dtype=mx.bool_)
        else:
            columns = mx.arange(width)[None]
            seen = (columns >= mx.array(low)[:, None]) & (columns < mx.array(high)[:, None])  # (batch, W)
        return as_bias(mx.concatenate([seen, own], axis=-1)[None, :, None, :], queries.dtype)  # (1, batch, 1, W + S)

    bias = per_step(("by head", batch, suffix, width, low, high, whole, queries.dtype), mask, build)
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


def _head_first(weights: Any, values: Any) -> Any:
    """``weights`` ``(rows, kv_heads, repeats, P)`` times one prefix's
    ``values`` ``(kv_heads, P, dim)`` as one product a KV head over every row
    -- ``(rows * repeats, P) x (P, dim)``, a single batched GEMM -- laid back
    out a row first: ``(rows, kv_heads, repeats, dim)``."""
    rows, kv_heads, repeats, width = weights.shape
    out = weights.transpose(1, 0, 2, 3).reshape(kv_heads, rows * repeats, width) @ values
    return out.reshape(kv_heads, rows, repeats, -1).transpose(1, 0, 2, 3)
