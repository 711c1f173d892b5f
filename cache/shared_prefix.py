"""Shared prefixes in memory: requests that begin with the same cached blocks
hold that prefix's KV once, and own only their suffix.

A :class:`PrefixGroup` is a cached prefix's keys and values, one buffer per
layer, built once from the pool's block payloads and referenced -- never
copied -- by every request that begins with those blocks (a request may
use only its leading part: the blocks it shares).

The cache a full-attention layer of such a request gets is a
:class:`SharedPrefixCache` (one request) or a :class:`BatchSharedPrefixCache`
(a decode batch, or requests prefilling together). To the model it looks
like mlx-lm's ``KVCache``/``BatchKVCache`` with one difference:
``update_and_fetch`` stores and returns only the request's own tokens (its
*suffix*), while ``offset`` counts the prefix too, so rotary positions stay
absolute; ``make_mask`` covers the suffix. The prefix is attended by the
shared-prefix attention the hook routes these classes to
(:mod:`mlxkv.actors.prefix_attention`, :mod:`mlxkv.actors.attention_hook`):
this module holds the caches, nothing of attention. Joining, leaving and
merging batches copy only suffixes.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

from mlxkv.cache.kv_state import BlockPayload, KVLayer

__all__ = [
    "SUFFIX_STEP",
    "BatchSharedPrefixCache",
    "BatchRows",
    "PrefixGroup",
    "PrefixGroups",
    "SharedPrefixCache",
    "suffix_cache",
    "suffix_layer",
    "suffix_of",
]


class PrefixGroup:
    """One cached prefix's KV, held once for every request that begins with it.

    Owns: per layer, keys and values ``(1, kv_heads, num_tokens, head_dim)``
    (evaluated, owned copies: no view of a block), and the payloads they were
    built from (their identity is the group's: the pool hands every request
    the same payload objects for the same blocks).

    Invariants:
        - never written after it is built;
        - ``keys[i][:, :, :n]`` is the KV of the first ``n // block_size``
          payloads for every block boundary ``n``.
    """

    __slots__ = ("payloads", "keys", "values", "__weakref__")

    def __init__(self, payloads: tuple[BlockPayload, ...], keys: tuple[Any, ...], values: tuple[Any, ...]) -> None:
        self.payloads = payloads
        self.keys = keys
        self.values = values

    @classmethod
    def build(cls, payloads: Sequence[BlockPayload]) -> PrefixGroup:
        """The group of ``payloads`` (blocks ``0..n-1`` of plain KV layers)."""
        import mlx.core as mx

        keys, values = _concatenate(payloads, 0)
        mx.eval(keys, values)
        return cls(tuple(payloads), keys, values)

    @property
    def num_tokens(self) -> int:
        return self.payloads[-1].end

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.keys, *self.values))

    def shared_blocks(self, payloads: Sequence[BlockPayload]) -> int:
        """How many leading ``payloads`` are this group's own blocks."""
        count = 0
        for mine, theirs in zip(self.payloads, payloads):
            if mine is not theirs:
                break
            count += 1
        return count


class PrefixGroups:
    """The live prefix groups of one model runner (MLX thread only).

    Owns: weak references to the groups (a group lives as long as a cache
    refers to it) and a count of the prefix tokens served from them.
    """

    def __init__(self) -> None:
        self._groups: weakref.WeakSet[PrefixGroup] = weakref.WeakSet()

    def take(self, payloads: Sequence[BlockPayload]) -> tuple[PrefixGroup, int]:
        """The group to begin a request with these prefix payloads, and how
        many of its leading blocks the request shares: the live group that
        shares most of them, else a new group of all of them."""
        best, shared = None, 0
        for group in self._groups:
            count = group.shared_blocks(payloads)
            if count > shared:
                best, shared = group, count
        if best is None:
            best, shared = PrefixGroup.build(payloads), len(payloads)
            self._groups.add(best)
        return best, shared

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def nbytes(self) -> int:
        return sum(group.nbytes for group in self._groups)


def suffix_cache(payloads: Sequence[BlockPayload], extra_tokens: int, num_layers: int) -> list[Any]:
    """Plain ``KVCache`` layers holding just ``payloads`` (any run of blocks,
    positions relative to its first; none: empty), with room for
    ``extra_tokens`` more."""
    if not payloads:
        return [suffix_layer() for _ in range(num_layers)]
    num_tokens = payloads[-1].end - payloads[0].start
    keys, values = _concatenate(payloads, _capacity(num_tokens, extra_tokens) - num_tokens)
    caches = []
    for k, v in zip(keys, values):
        layer = suffix_layer()
        layer.keys, layer.values, layer.offset = k, v, num_tokens
        caches.append(layer)
    return caches


def suffix_layer() -> Any:
    """An empty plain ``KVCache`` for a request's own tokens (grows by :data:`SUFFIX_STEP`)."""
    from mlx_lm.models.cache import KVCache

    layer = KVCache()
    layer.step = SUFFIX_STEP
    return layer


def _capacity(num_tokens: int, extra_tokens: int) -> int:
    """Buffer size for ``num_tokens`` now and ``extra_tokens`` to come."""
    needed = num_tokens + extra_tokens
    return -(-needed // SUFFIX_STEP) * SUFFIX_STEP


def suffix_of(cache: Sequence[Any], start: int, stop: int, extra_tokens: int) -> list[Any]:
    """Plain ``KVCache`` layers holding a copy of tokens ``[start, stop)`` of
    the plain ``KVCache`` layers ``cache``, with room for ``extra_tokens`` more."""
    import mlx.core as mx

    num_tokens = stop - start
    room = _capacity(num_tokens, extra_tokens) - num_tokens
    out = []
    for layer in cache:
        fresh = suffix_layer()
        if num_tokens:
            parts_k = [layer.keys[..., start:stop, :]]
            parts_v = [layer.values[..., start:stop, :]]
            if room:
                b, h, _, d = layer.keys.shape
                parts_k.append(mx.zeros((b, h, room, d), dtype=layer.keys.dtype))
                parts_v.append(mx.zeros((b, h, room, layer.values.shape[-1]), dtype=layer.values.dtype))
            fresh.keys, fresh.values = mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2)
            fresh.offset = num_tokens
        out.append(fresh)
    return out


def _concatenate(payloads: Sequence[BlockPayload], padding: int) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    import mlx.core as mx

    keys, values = [], []
    for layer, spec in enumerate(payloads[0].layers):
        assert isinstance(spec, KVLayer), "shared prefixes hold plain KV layers only"
        for out, part in ((keys, 0), (values, 1)):
            arrays = [p.arrays[layer][part] for p in payloads]
            if padding:
                b, h, _, d = arrays[0].shape
                arrays.append(mx.zeros((b, h, padding, d), dtype=arrays[0].dtype))
            out.append(mx.concatenate(arrays, axis=2) if len(arrays) > 1 else mx.array(arrays[0]))
    return tuple(keys), tuple(values)


class _OverSuffix:
    """What both shared-prefix caches do the same way: the request's (or
    rows') own tokens live in ``suffix``, a plain mlx-lm cache, which
    stores what the model writes and is what a checkpoint of the layer
    holds; the prefix is never written."""

    suffix: Any

    @property
    def state(self) -> Any:
        return self.suffix.state

    @property
    def nbytes(self) -> int:
        return self.suffix.nbytes

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        """Store the new tokens in the suffix; the suffix's keys and values."""
        return self.suffix.update_and_fetch(keys, values)

    def is_trimmable(self) -> bool:
        return True


class SharedPrefixCache(_OverSuffix):
    """One request's cache of one attention layer: a shared prefix and its own suffix.

    Attributes:
        group: the prefix group (None: no shared prefix).
        layer: this layer's index in the group's buffers.
        num_prefix: the group's leading tokens the request begins with.
        suffix: a plain ``KVCache`` of the request's own tokens after them.
    """

    def __init__(self, group: Optional[PrefixGroup], layer: int, num_prefix: int, suffix: Any) -> None:
        assert group is not None or num_prefix == 0, "a prefix comes with its group"
        self.group = group
        self.layer = layer
        self.num_prefix = num_prefix
        self.suffix = suffix

    @property
    def offset(self) -> int:
        """Tokens before the next one: the prefix's and the suffix's."""
        return self.num_prefix + self.suffix.offset

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None) -> Any:
        """The suffix's mask for ``N`` new tokens (the prefix needs none)."""
        from mlx_lm.models.base import create_causal_mask

        assert window_size is None, "a shared prefix serves full attention only"
        if N == 1:
            return None
        if return_array:
            return create_causal_mask(N, offset=self.suffix.offset)
        return "causal"

    def trim(self, n: int) -> int:
        """Drop the last ``n`` suffix tokens (never into the prefix)."""
        return self.suffix.trim(min(n, self.suffix.offset))

    def own_suffix(self) -> None:
        """Hold the suffix in buffers of its own: a batched prefill's rows
        hold views of the batch's (:meth:`BatchSharedPrefixCache.extract`),
        which a cache kept for long must not pin. Nothing is copied where the
        suffix has its own (MLX's ``contiguous`` then shares the buffer)."""
        import mlx.core as mx

        if self.suffix.keys is not None:
            self.suffix.keys, self.suffix.values = mx.contiguous(self.suffix.keys), mx.contiguous(self.suffix.values)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def cut(self, num_tokens: int, block_size: int) -> SharedPrefixCache:
        """This cache cut back to its first ``num_tokens`` tokens: the suffix
        trimmed, or, if that reaches into the prefix, the prefix shortened
        to whole blocks and the rest of it copied into a new suffix."""
        if num_tokens >= self.num_prefix:
            self.trim(self.offset - num_tokens)
            return self
        assert self.group is not None, "a cache without a prefix never cuts into one"
        kept = num_tokens // block_size * block_size
        keys = self.group.keys[self.layer][..., kept:num_tokens, :]
        values = self.group.values[self.layer][..., kept:num_tokens, :]
        suffix = suffix_layer()
        if num_tokens > kept:
            suffix.update_and_fetch(keys, values)
        return SharedPrefixCache(self.group if kept else None, self.layer, kept, suffix)

    @property
    def last_layer(self) -> bool:
        """Whether this is the model's last attention layer (see
        :func:`~mlxkv.actors.prefix_attention.cascade_attention`'s ``evaluate_slices``)."""
        return self.group is not None and self.layer == len(self.group.keys) - 1

    def segments(self) -> list[tuple[list[int], Any, Any, list[int]]]:
        """The prefix this cache attends to besides its suffix (see
        :func:`~mlxkv.actors.prefix_attention.cascade_attention`)."""
        if self.group is None or self.num_prefix == 0:
            return []
        keys, values = self.group.keys[self.layer], self.group.values[self.layer]
        return [([0], keys, values, [self.num_prefix])]

    def to_plain(self, extra_tokens: int = 0) -> Any:
        """A plain ``KVCache`` of prefix and suffix (a copy of both, made in
        one concatenation), with room for ``extra_tokens`` more (it then
        grows by :data:`SUFFIX_STEP`, as a suffix does); the suffix itself
        when there is no prefix."""
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache

        if self.num_prefix == 0:
            return self.suffix
        assert self.group is not None, "a prefix comes with its group"
        n = self.suffix.offset
        room = _capacity(self.offset, extra_tokens) - self.offset if extra_tokens else 0
        layer = suffix_layer() if extra_tokens else KVCache()
        arrays = []
        for prefix, own in (
            (self.group.keys[self.layer], self.suffix.keys),
            (self.group.values[self.layer], self.suffix.values),
        ):
            parts = [prefix[..., : self.num_prefix, :]]
            if n:
                parts.append(own[..., :n, :])
            if room:
                b, h, _, d = prefix.shape
                parts.append(mx.zeros((b, h, room, d), dtype=prefix.dtype))
            arrays.append(mx.concatenate(parts, axis=2) if len(parts) > 1 else mx.array(parts[0]))
        layer.keys, layer.values = arrays
        layer.offset = self.offset
        return layer

    @classmethod
    def merge(cls, caches: Sequence[SharedPrefixCache]) -> BatchSharedPrefixCache:
        """One batch cache of these requests' caches, in order (suffixes copied once).

        The suffixes left-padded to the longest, as mlx-lm's
        ``BatchKVCache.merge`` lays them, in a buffer made whole
        :data:`SUFFIX_STEP` steps long at once, with the room the rows have for
        tokens to come: written in place, the batch never regrows (and never
        holds two copies). One buffer, not mlx-lm's and then a longer one (a
        concatenation: three launches a layer for keys and values each on a
        GPU).
        """
        import mlx.core as mx
        from mlx_lm.models.cache import BatchKVCache

        suffixes = [c.suffix for c in caches]
        longest = max(s.size() for s in suffixes)
        padding = [longest - s.size() for s in suffixes]
        rows = [(c.group, c.num_prefix) for c in caches]
        if longest == 0:
            suffix = BatchKVCache(padding)
        else:
            room = max((s.keys.shape[2] - s.offset for s in suffixes if s.keys is not None), default=0)
            size = _capacity(longest, room)
            held = [s for s in suffixes if s.keys is not None]
            heads, dtype = held[0].keys.shape[1], held[0].keys.dtype
            keys = mx.zeros((len(caches), heads, size, held[0].keys.shape[3]), dtype=dtype)
            values = mx.zeros((len(caches), heads, size, held[0].values.shape[3]), dtype=dtype)
            for i, (pad, s) in enumerate(zip(padding, suffixes)):
                if s.keys is not None:
                    keys[i : i + 1, :, pad:longest] = s.keys[..., : s.offset, :]
                    values[i : i + 1, :, pad:longest] = s.values[..., : s.offset, :]
            suffix = BatchKVCache(padding)
            suffix.keys, suffix.values = keys, values
            suffix.offset += longest
            suffix._idx = longest
        suffix.step = SUFFIX_STEP
        return BatchSharedPrefixCache(rows, caches[0].layer, suffix, padding)


def _whole_steps(suffix: Any, room: int = 0) -> None:
    """Give a batch suffix ``room`` more positions and then up to whole
    :data:`SUFFIX_STEP` positions, in one copy (mlx-lm's ``BatchKVCache``
    makes other sizes on ``merge`` and trims the rows' common left padding
    on ``filter``): a stacked decode step attends over the whole buffer, so
    its fused call keeps its shapes from one batch's rows to the next
    (:func:`~mlxkv.actors.prefix_attention.stacked_attention`)."""
    if suffix.keys is None:
        return
    import mlx.core as mx

    size = suffix.keys.shape[2]
    room = _capacity(size, room) - size
    if room:
        for name in ("keys", "values"):
            old = getattr(suffix, name)
            b, h, _, d = old.shape
            setattr(suffix, name, mx.concatenate([old, mx.zeros((b, h, room, d), dtype=old.dtype)], axis=2))


class BatchRows(NamedTuple):
    """A batch cache's rows as numbers on the host, the same in every layer
    of a step (each layer's cache makes its own, equal, and keeps it until
    its rows or padding are replaced): what a step's per-layer work is keyed
    by, compared as a tuple.

    Attributes:
        segment: each row's index in the cache's ``segments()`` (-1: the
            row sees no prefix).
        prefix: each row's prefix length.
        padding: each row's left padding in the suffix.
    """

    segment: tuple[int, ...]
    prefix: tuple[int, ...]
    padding: tuple[int, ...]


_LAST_OFFSETS = threading.local()


def _host_offsets(prefixes: Optional[tuple[int, ...]], index: int, padding: tuple[int, ...]) -> Any:
    """Each row's prefix length (``prefixes``; None: the suffix's own offsets,
    no prefix) plus its own tokens (``index`` less its padding), as one array
    made on the host: the calling thread's last such array when the numbers
    are the same (a step's layers)."""
    import mlx.core as mx

    kind = "suffix" if prefixes is None else "batch"
    key = (prefixes, index, padding)
    last = getattr(_LAST_OFFSETS, kind, None)
    if last is not None and last[0] == key:
        return last[1]
    offsets = mx.array([n + index - pad for n, pad in zip(prefixes or [0] * len(padding), padding)])
    setattr(_LAST_OFFSETS, kind, (key, offsets))
    return offsets


class BatchSharedPrefixCache(_OverSuffix):
    """A batch's cache of one attention layer: each row's shared prefix, and
    every row's own suffix in one mlx-lm ``BatchKVCache`` (left-padded).

    Joining, leaving and extracting a row never wait for the device: mlx-lm's
    ``filter`` and ``extract`` read the rows' left padding back from it (a
    wait for every step queued before), so this cache keeps the padding on
    the host too (``padding``, always equal to the suffix's
    ``left_padding``) and cuts and extracts with it.

    Attributes:
        rows: ``(group, num_prefix)`` of each row, in batch order.
        layer: this layer's index in the groups' buffers.
        suffix: the rows' own tokens.
        padding: each row's left padding in ``suffix``, on the host.
    """

    def __init__(
        self, rows: list[tuple[Optional[PrefixGroup], int]], layer: int, suffix: Any, padding: list[int]
    ) -> None:
        self.rows = rows
        self.layer = layer
        self.suffix = suffix
        self.padding = padding
        self._right_padding: Optional[list[int]] = None

    @property
    def rows(self) -> list[tuple[Optional[PrefixGroup], int]]:
        """``(group, num_prefix)`` of each row, in batch order (replaced, never
        changed in place: what is derived from it is kept until it is)."""
        return self._rows

    @rows.setter
    def rows(self, rows: list[tuple[Optional[PrefixGroup], int]]) -> None:
        self._rows = rows
        self._grouping: Optional[list[tuple[PrefixGroup, list[int], list[int]]]] = None
        self._batch_rows: Optional[BatchRows] = None

    @property
    def padding(self) -> list[int]:
        """Each row's left padding in ``suffix``, on the host (replaced, never
        changed in place, like ``rows``)."""
        return self._padding

    @padding.setter
    def padding(self, padding: list[int]) -> None:
        self._padding = padding
        self._batch_rows = None

    def batch_rows(self) -> BatchRows:
        """The rows' segments, prefix lengths and padding as host tuples
        (:class:`BatchRows`), made once until ``rows`` or ``padding`` is
        replaced: a decode step's layers each read them, so a layer's work
        costs the host a lookup, not a walk over the rows."""
        if self._batch_rows is None:
            segment = [-1] * len(self.rows)
            for index, (_, rows, _) in enumerate(self._groups()):
                for row in rows:
                    segment[row] = index
            self._batch_rows = BatchRows(
                tuple(segment), tuple(n for _, n in self.rows), tuple(self.padding)
            )
        return self._batch_rows

    @property
    def offset(self) -> Any:
        """Each row's tokens before its next one: prefix and suffix.

        Known on the host: mlx-lm's ``BatchKVCache`` keeps a row's offset
        equal to its write index less the row's left padding, both of which
        this cache knows without the device (``padding``). So it is an
        array made from host numbers, not a sum on the device: a layer reads
        it twice (its queries' and its keys' rotary positions), each sum a
        kernel on a GPU, and every layer of a batch has the same rows, index
        and padding, so one array serves a step's layers (the calling
        thread's last, :func:`_host_offsets`)."""
        rows = self.batch_rows()
        return _host_offsets(rows.prefix, self.suffix._idx, rows.padding)

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        """mlx-lm's write: the new tokens at the suffix's write index, and the
        suffix's keys and values up to them; the suffix's own offset set to
        the same numbers made on the host. Where the buffers have room (a
        decode step's: :meth:`reserve` made it), the write is this cache's
        own, the same slices written and returned without mlx-lm's offset
        sum (nothing reads it: left queued it would chain a sum a step);
        where they have none, mlx-lm's, which grows them."""
        suffix = self.suffix
        start = suffix._idx
        stop = start + keys.shape[2]
        if suffix.keys is None or stop > suffix.keys.shape[2]:
            out = suffix.update_and_fetch(keys, values)
        else:
            suffix._idx = stop
            suffix.keys[:, :, start:stop] = keys
            suffix.values[:, :, start:stop] = values
            out = suffix.keys[:, :, :stop], suffix.values[:, :, :stop]
        suffix.offset = _host_offsets(None, stop, self.batch_rows().padding)
        return out

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None) -> Any:
        assert window_size is None, "a shared prefix serves full attention only"
        return self.suffix.make_mask(N, return_array=return_array)

    def prepare(self, **kwargs: Any) -> None:
        """mlx-lm's ``BatchKVCache.prepare``; the padding it adds (left now,
        right when :meth:`finalize` rolls it to the left) is kept here too."""
        self.suffix.prepare(**kwargs)
        left, right = kwargs.get("left_padding"), kwargs.get("right_padding")
        if left is not None:
            self.padding = [n + int(extra) for n, extra in zip(self.padding, left)]
        self._right_padding = [int(n) for n in right] if right is not None and max(right) > 0 else None

    def finalize(self) -> None:
        self.suffix.finalize()
        if self._right_padding is not None:
            self.padding = [n + extra for n, extra in zip(self.padding, self._right_padding)]
            self._right_padding = None

    def trim(self, n: int) -> int:
        return self.suffix.trim(n)

    def size(self) -> int:
        return self.suffix.size()

    def empty(self) -> bool:
        return self.suffix.empty() and not any(n for _, n in self.rows)

    @property
    def last_layer(self) -> bool:
        """Whether this is the model's last attention layer (see
        :func:`~mlxkv.actors.prefix_attention.cascade_attention`'s ``evaluate_slices``)."""
        # Every group holds the same layers (one model's): the first says.
        groups = self._groups()
        return bool(groups) and self.layer == len(groups[0][0].keys) - 1

    def segments(self) -> list[tuple[list[int], Any, Any, list[int]]]:
        """Rows grouped by prefix: ``(rows, keys, values, prefix lengths)``
        (the row and length lists are the cache's own: read them only)."""
        return [
            (rows, group.keys[self.layer], group.values[self.layer], lengths)
            for group, rows, lengths in self._groups()
        ]

    def _groups(self) -> list[tuple[PrefixGroup, list[int], list[int]]]:
        """Each prefix seen, with its rows and their lengths (rows that see
        no prefix left out), in the order of their first rows; kept until
        ``rows`` is replaced."""
        if self._grouping is None:
            by_group: dict[int, tuple[PrefixGroup, list[int], list[int]]] = {}
            for row, (group, n) in enumerate(self.rows):
                if group is None or n == 0:
                    continue
                entry = by_group.setdefault(id(group), (group, [], []))
                entry[1].append(row)
                entry[2].append(n)
            self._grouping = list(by_group.values())
        return self._grouping

    def suffix_buffer(self) -> tuple[Any, Any]:
        """The rows' whole suffix buffers ``(keys, values)``, room included:
        ``(batch, kv_heads, C, head_dim)``, of which the first ``_idx``
        positions are what ``update_and_fetch`` returns (left-padded as
        its mask says) and the rest is room for tokens to come (see
        :func:`~mlxkv.actors.prefix_attention.stacked_attention`)."""
        return self.suffix.keys, self.suffix.values

    def reserve(self, num_tokens: int) -> list[Any]:
        """Grow the suffix now if the next ``num_tokens`` would not fit; the
        grown arrays, to start evaluating before the step (none: it had room).

        Grown inside the step (as ``update_and_fetch`` would), the old and the
        new buffer are both held through the step's attention transients.
        """
        suffix = self.suffix
        if suffix.keys is None or suffix._idx + num_tokens <= suffix.keys.shape[2]:
            return []
        import mlx.core as mx

        used = suffix._idx
        grow = -(-num_tokens // suffix.step) * suffix.step
        arrays = []
        for name in ("keys", "values"):
            old = getattr(suffix, name)
            b, h, _, d = old.shape
            grown = mx.concatenate([old[..., :used, :], mx.zeros((b, h, grow, d), dtype=old.dtype)], axis=2)
            setattr(suffix, name, grown)
            arrays.append(grown)
        return arrays

    def filter(self, batch_indices: Any) -> None:
        """Keep the rows ``batch_indices`` (a host list or array), as mlx-lm's
        ``BatchKVCache.filter`` does, with the padding known here: the rows'
        common left padding is cut as far as the buffer stays whole
        :data:`SUFFIX_STEP` positions (up to a step less than mlx-lm cuts),
        so that the kept rows are taken in one gather a side, not a gather
        and then a longer copy to whole steps."""
        import mlx.core as mx

        indices = [int(i) for i in (batch_indices.tolist() if hasattr(batch_indices, "tolist") else batch_indices)]
        self.rows = [self.rows[i] for i in indices]
        padding = [self.padding[i] for i in indices]
        suffix, kept = self.suffix, mx.array(indices)
        cut = min(padding)
        if suffix.keys is not None:
            size = suffix.keys.shape[2]
            cut = max(size - _capacity(size - cut, 0), 0)
            suffix.keys = suffix.keys[kept, :, cut:] if cut else suffix.keys[kept]
            suffix.values = suffix.values[kept, :, cut:] if cut else suffix.values[kept]
        self.padding = [n - cut for n in padding]
        suffix.offset = suffix.offset[kept]
        suffix.left_padding = mx.array(self.padding)
        suffix._idx -= cut
        _whole_steps(suffix)

    def extend(self, other: BatchSharedPrefixCache) -> None:
        # mlx-lm right-justifies both at the longer one's index.
        longest = max(self.suffix._idx, other.suffix._idx)
        padding = [n + longest - self.suffix._idx for n in self.padding]
        padding += [n + longest - other.suffix._idx for n in other.padding]
        self.suffix.extend(other.suffix)  # (whole steps: the longer of two such buffers)
        self.rows, self.padding = self.rows + other.rows, padding

    def extract(self, idx: int, *, copy: bool = True) -> SharedPrefixCache:
        """Row ``idx``'s own cache (its suffix copied out, as mlx-lm's
        ``BatchKVCache.extract`` makes it, with the padding known here).

        ``copy=False``: the suffix as a view of the batch's buffer, which
        then lives as long as any row's view of it -- for a row whose cache
        is copied again soon (a batched prefill's rows: merged into a decode
        batch or the next chunk's batch). A copy is a kernel launch a row
        and a layer for keys and values each on a GPU.
        """
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache

        group, n = self.rows[idx]
        suffix, own = self.suffix, KVCache()
        if suffix.keys is not None:
            start = self.padding[idx]
            own.keys = suffix.keys[idx : idx + 1, :, start : suffix._idx]
            own.values = suffix.values[idx : idx + 1, :, start : suffix._idx]
            if copy:
                own.keys, own.values = mx.contiguous(own.keys), mx.contiguous(own.values)
            own.offset = own.keys.shape[2]
        return SharedPrefixCache(group, self.layer, n, own)


#: Tokens a suffix's buffer grows by (mlx-lm grows a ``KVCache`` by 256): a
#: request's own tokens are few, and every row of a batch is padded to the
#: longest, so room beyond them is memory a shared prefix would not save. A
#: growth copies only the suffixes. 64 held 13.0 MiB at 64 requests of 64
#: own tokens over a 2,048-token prefix, 16 holds 11.7 (scripts/bench_memory.py).
SUFFIX_STEP = 16
