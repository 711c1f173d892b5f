"""KV state of mlx-lm caches, cut into per-block payloads and put back together.

It is a set of pure functions over small frozen records (the seed's caches,
the shared-prefix caches and the tiers' value format call it; they touch MLX
arrays too):

* :func:`describe_cache` reads a model's list of cache objects (or the seed's
  ``{'state': ...}`` dicts) and says what each layer is (:data:`LayerSpec`) and
  how many tokens the cache holds, or raises :class:`NotReconstructable` for
  anything it could not rebuild exactly.
* :func:`slice_blocks` cuts that state into :class:`BlockPayload` records, one
  per block of ``block_size`` tokens. Each payload owns evaluated, contiguous
  copies of its slice: a lazy or view slice would keep the whole source buffer
  alive, and evicting blocks would free nothing.
* :func:`reconstruct` builds real mlx-lm cache objects from the payloads of
  blocks ``0..n-1``, each array written once into a buffer that already has
  room for the tokens that will follow, so that the first ``update_and_fetch``
  does not grow (copy) it again.
* :func:`num_reconstructable_blocks` says how many leading payloads
  :func:`reconstruct` can rebuild exactly (hybrid models need a recurrent-state
  snapshot at the last block's end).
* :func:`as_block_payload` reads a block's ``cache_data`` written in the seed's
  declared format (a ``(keys, values)`` pair per layer) as a payload, when it
  is exactly one.

Cache objects are read and built through their attributes (``keys``,
``values``, ``offset``, ``max_size``, ``keep``, ``_idx``, ``group_size``,
``bits``, ``cache``), never through ``.state``, whose meaning differs between
mlx-lm 0.31 and 0.32.

Everything runs on the calling thread and evaluates what it returns: an
unevaluated MLX array belongs to the stream of the thread that built it, so
only evaluated arrays may leave.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Optional, Union

import attrs

from mlxkv.cache.errors import CacheError, InvalidInput

__all__ = [
    "STEP",
    "ArraysLayer",
    "BlockPayload",
    "CacheLayout",
    "KVLayer",
    "LayerSpec",
    "NotReconstructable",
    "QuantizedLayer",
    "RotatingLayer",
    "as_block_payload",
    "capacity_for",
    "describe_cache",
    "num_reconstructable_blocks",
    "reconstruct",
    "slice_blocks",
    "state_seq_axis",
]

logger = logging.getLogger(__name__)

#: mlx-lm grows ``KVCache``/``QuantizedKVCache`` buffers in chunks of this many
#: tokens; reconstructed buffers are sized in the same chunks.
STEP = 256


class NotReconstructable(CacheError):
    """A cache (or a run of block payloads) that cannot be rebuilt exactly.

    Raised instead of ever returning a cache that would differ from the one
    that was stored: a wrapped ``RotatingKVCache``, an unknown cache class,
    layers holding different numbers of tokens, payloads that do not line up,
    or a hybrid prefix whose recurrent state was never snapshotted.

    Attributes:
        reason: what is wrong, in words.
        layer: index of the offending layer, when one layer is to blame.
    """

    def __init__(self, reason: str, *, layer: Optional[int] = None) -> None:
        self.reason = reason
        self.layer = layer
        where = f"layer {layer}: " if layer is not None else ""
        super().__init__(f"not reconstructable: {where}{reason}")


@attrs.frozen
class KVLayer:
    """A full-attention layer (mlx-lm ``KVCache``): keys and values per token."""

    @property
    def sequential(self) -> bool:
        return True


@attrs.frozen
class RotatingLayer:
    """A sliding-window layer (``RotatingKVCache``) that has not wrapped yet.

    Attributes:
        max_size: the window's buffer size.
        keep: leading tokens that are never rotated out.
    """

    max_size: int
    keep: int

    @property
    def sequential(self) -> bool:
        return True


@attrs.frozen
class QuantizedLayer:
    """A quantized attention layer (``QuantizedKVCache``).

    Keys and values are each stored as ``(packed, scales, biases)``.

    Attributes:
        group_size: quantization group size.
        bits: bits per quantized element.
    """

    group_size: int
    bits: int

    @property
    def sequential(self) -> bool:
        return True


@attrs.frozen
class ArraysLayer:
    """A recurrent or convolution layer (``ArraysCache``).

    Its state summarises every token so far and cannot be sliced by token: it
    is stored as a snapshot in the block that ends where the cache ended.

    Attributes:
        size: number of state arrays (``len(ArraysCache.cache)``).
    """

    size: int

    @property
    def sequential(self) -> bool:
        return False


#: What one layer is, and the parameters needed to rebuild it.
LayerSpec = Union[KVLayer, RotatingLayer, QuantizedLayer, ArraysLayer]


@attrs.frozen
class CacheLayout:
    """The layers of a model's cache and how many tokens it holds.

    Attributes:
        layers: one spec per layer, in model order.
        num_tokens: tokens held by every sequence layer, or ``None`` when the
            cache has no sequence layer (its length cannot be read from it).
    """

    layers: tuple[LayerSpec, ...]
    num_tokens: Optional[int]

    @property
    def has_recurrent(self) -> bool:
        """Whether some layer needs a boundary snapshot (``ArraysLayer``)."""
        return any(not spec.sequential for spec in self.layers)


@attrs.frozen(eq=False)
class BlockPayload(Sequence[Optional[tuple[Any, ...]]]):
    """The KV state of one block: owned, evaluated arrays per layer.

    ``arrays[i]`` holds layer ``i``'s arrays for tokens ``[start, end)``:
    ``(keys, values)`` for :class:`KVLayer`/:class:`RotatingLayer`, the six
    arrays ``(k_packed, k_scales, k_biases, v_packed, v_scales, v_biases)``
    for :class:`QuantizedLayer`, each 4-D with the token axis 2; for an
    :class:`ArraysLayer`, the snapshot of its state arrays after token
    ``end - 1`` (entries may be ``None`` like the cache's own), or ``None``
    when this block does not end where the stored cache ended.

    A payload is also the read-only per-layer sequence that the seed declares
    ``CacheBlock.cache_data`` to be: ``len(payload)`` is the number of layers
    and ``payload[i]`` is ``arrays[i]`` (``None`` for a layer that carries
    nothing in this block). A payload is always true, whatever its length,
    and equal only to itself.

    ``signature`` describes every array the layers have (dtype, and shape
    with the token axis left out) whether or not this block carries it;
    payloads with different signatures never go into one cache.

    Invariants:
        - ``len(arrays) == len(layers) == len(signature)``.
        - every sequence layer's arrays have ``num_tokens`` entries on axis 2.
        - every array is evaluated and owns its memory (no view of a bigger
          buffer), so dropping the payload frees it.
        - payloads are never mutated; :func:`reconstruct` copies out of them.
    """

    layers: tuple[LayerSpec, ...]
    start: int
    num_tokens: int
    arrays: tuple[Optional[tuple[Any, ...]], ...]
    signature: tuple[tuple[Any, ...], ...] = ()

    def __len__(self) -> int:
        return len(self.arrays)

    def __getitem__(self, index: Any) -> Any:
        return self.arrays[index]

    def __iter__(self) -> Iterator[Optional[tuple[Any, ...]]]:
        return iter(self.arrays)

    def __bool__(self) -> bool:
        # A payload is a value that is present, not a container that may be
        # empty: ``if block.cache_data`` must mean "has a payload".
        return True

    @property
    def end(self) -> int:
        """Position one past this block's last token."""
        return self.start + self.num_tokens

    @property
    def has_snapshots(self) -> bool:
        """Whether every recurrent layer carries a state snapshot here."""
        return all(
            spec.sequential or arrays is not None
            for spec, arrays in zip(self.layers, self.arrays)
        )

    @property
    def nbytes(self) -> int:
        """Bytes of MLX memory this payload holds."""
        return sum(
            a.nbytes for arrays in self.arrays if arrays for a in arrays if a is not None
        )

    def __deepcopy__(self, memo: dict) -> BlockPayload:
        # copy.deepcopy is how a copy-on-write must duplicate a payload: give it
        # fresh, evaluated arrays, never views of (or lazy graphs over) ours.
        import mlx.core as mx

        arrays = tuple(
            None if group is None else tuple(None if a is None else mx.array(a) for a in group)
            for group in self.arrays
        )
        mx.eval([a for group in arrays if group for a in group if a is not None])
        return attrs.evolve(self, arrays=arrays)


@attrs.frozen
class _LayerView:
    """One layer as read from a cache object: spec, length and arrays.

    ``seq`` are 4-D arrays (token axis 2) covering at least ``length`` tokens;
    ``state`` the recurrent state arrays. Arrays here may be views of the
    caller's buffers; nothing is copied until slicing.
    """

    spec: LayerSpec
    length: Optional[int]
    seq: tuple[Any, ...] = ()
    state: Optional[tuple[Any, ...]] = None


def state_seq_axis(state: Any) -> Optional[int]:
    """The token axis of a ``(keys, values)`` pair as the seed's dicts hold it.

    Args:
        state: a ``'state'`` entry of a seed-style per-layer dict.

    Returns:
        ``2`` for 4-D ``(B, H, T, D)`` arrays, ``1`` for 3-D ``(H, T, D)``
        arrays, ``None`` when ``state`` does not start with such a pair.
    """
    import mlx.core as mx

    if not isinstance(state, (list, tuple)) or len(state) < 2:
        return None
    keys, values = state[0], state[1]
    if not (isinstance(keys, mx.array) and isinstance(values, mx.array)):
        return None
    if keys.ndim != values.ndim:
        return None
    return {4: 2, 3: 1}.get(keys.ndim)


def describe_cache(cache_data: Sequence[Any]) -> CacheLayout:
    """Say what each layer of a cache is and how many tokens it holds.

    Args:
        cache_data: the model's per-layer caches: mlx-lm cache objects, the
            seed's dicts ``{'state': ..., 'meta_state': ..., 'class_name': ...}``
            or plain ``(keys, values)`` pairs (4-D or 3-D arrays).

    Returns:
        The layout.

    Raises:
        InvalidInput: ``cache_data`` is empty or malformed.
        NotReconstructable: a layer could not be rebuilt exactly.
    """
    views = _read_layers(cache_data)
    return CacheLayout(layers=tuple(v.spec for v in views), num_tokens=_common_length(views))


def _read_layers(cache_data: Sequence[Any]) -> list[_LayerView]:
    if isinstance(cache_data, (str, bytes, Mapping)) or not isinstance(cache_data, Sequence):
        raise InvalidInput("cache_data", cache_data, "must be a list with one entry per layer")
    if not cache_data:
        raise InvalidInput("cache_data", cache_data, "holds no layers")
    return [_read_layer(layer, i) for i, layer in enumerate(cache_data)]


def _common_length(views: Sequence[_LayerView]) -> Optional[int]:
    lengths = {v.length for v in views if v.spec.sequential}
    if len(lengths) > 1:
        raise NotReconstructable(f"layers hold different numbers of tokens: {sorted(lengths)}")
    return lengths.pop() if lengths else None


def _read_layer(layer: Any, index: int) -> _LayerView:
    from mlx_lm.models import cache as mlc

    if isinstance(layer, Mapping):
        return _read_dict(layer, index)
    if isinstance(layer, (tuple, list)):
        # The seed's declared per-layer format: a (keys, values) pair.
        return _kv_dict_view(layer, index, f"cache_data[{index}]")
    kind = type(layer)
    # Exact classes only: a subclass may keep state we would not rebuild.
    if kind is mlc.KVCache:
        return _kv_view(KVLayer(), layer.keys, layer.values, layer.offset, index)
    if kind is mlc.RotatingKVCache:
        return _rotating_view(
            layer.keys, layer.values, layer.offset, layer.keep, layer.max_size, layer._idx, index
        )
    if kind is mlc.QuantizedKVCache:
        return _quantized_view(
            layer.keys, layer.values, layer.offset, layer.group_size, layer.bits, index
        )
    if kind is mlc.ArraysCache:
        if layer.left_padding is not None or getattr(layer, "lengths", None) is not None:
            raise NotReconstructable("ArraysCache prepared for a padded batch", layer=index)
        return _arrays_view(layer.cache, index)
    raise NotReconstructable(f"unsupported cache class {kind.__name__}", layer=index)


def _read_dict(layer: Mapping[str, Any], index: int) -> _LayerView:
    if "state" not in layer:
        raise InvalidInput(f"cache_data[{index}]", layer, "a dict layer needs a 'state' entry")
    state = layer["state"]
    meta = layer.get("meta_state")
    name = layer.get("class_name")
    if name is None and layer.get("class_ref") is not None:
        name = getattr(layer["class_ref"], "__name__", None)
    try:
        if name == "RotatingKVCache":
            if len(state) == 6:  # mlx-lm 0.32: (keys, values, offset, keep, max_size, _idx)
                keys, values, offset, keep, max_size, idx = state
            else:  # mlx-lm 0.31: (keys, values) + meta (keep, max_size, offset, _idx)
                keys, values = state
                keep, max_size, offset, idx = (int(x) for x in meta)
            return _rotating_view(keys, values, offset, keep, max_size, idx, index)
        if name == "QuantizedKVCache":
            if len(state) == 5:  # 0.32: (keys, values, offset, group_size, bits)
                keys, values, offset, group_size, bits = state
            else:  # 0.31: (keys, values) + meta (offset, group_size, bits)
                keys, values = state
                offset, group_size, bits = (int(x) for x in meta)
            return _quantized_view(keys, values, offset, group_size, bits, index)
        if name == "ArraysCache":
            # 0.32: (cache, left_padding, lengths); 0.31: the list itself.
            if isinstance(state, tuple) and len(state) == 3 and isinstance(state[0], list):
                if state[1] is not None or state[2] is not None:
                    raise NotReconstructable("ArraysCache prepared for a padded batch", layer=index)
                state = state[0]
            return _arrays_view(state, index)
    except CacheError:
        raise
    except (TypeError, ValueError) as exc:
        raise InvalidInput(
            f"cache_data[{index}]", layer, f"malformed {name} state: {exc}"
        ) from exc
    if name not in (None, "KVCache", "ConcatenateKVCache"):
        raise NotReconstructable(f"unsupported cache class {name}", layer=index)
    return _kv_dict_view(state, index, f"cache_data[{index}]['state']")


def _kv_dict_view(state: Any, index: int, where: str) -> _LayerView:
    axis = state_seq_axis(state)
    if axis is None:
        raise InvalidInput(
            where,
            state,
            "expected (keys, values) as 4-D (B, H, T, D) or 3-D (H, T, D) arrays",
        )
    keys, values = state[0], state[1]
    if axis == 1:
        keys, values = keys[None], values[None]
    offset = keys.shape[2]
    if len(state) == 3 and isinstance(state[2], int):  # mlx-lm 0.32's (keys, values, offset)
        offset = state[2]
    elif len(state) != 2:
        raise InvalidInput(where, state, "expected (keys, values)")
    return _kv_view(KVLayer(), keys, values, offset, index)


def _check_seq_arrays(arrays: Sequence[Any], offset: Any, index: int) -> int:
    import mlx.core as mx

    if not all(isinstance(a, mx.array) and a.ndim == 4 for a in arrays):
        raise InvalidInput(f"cache_data[{index}]", arrays, "expected 4-D (B, H, T, D) arrays")
    if any(a.shape[0] != 1 for a in arrays):
        raise NotReconstructable("batch size must be 1", layer=index)
    if not isinstance(offset, int) or offset < 0:
        raise InvalidInput(f"cache_data[{index}].offset", offset, "must be an int >= 0")
    capacity = min(a.shape[2] for a in arrays)
    if offset > capacity:
        raise InvalidInput(
            f"cache_data[{index}].offset", offset, f"exceeds the buffer's {capacity} tokens"
        )
    return offset


def _kv_view(spec: LayerSpec, keys: Any, values: Any, offset: Any, index: int) -> _LayerView:
    if keys is None or values is None:
        if offset:
            raise InvalidInput(f"cache_data[{index}]", offset, "offset > 0 but no keys")
        return _LayerView(spec=spec, length=0)
    offset = _check_seq_arrays((keys, values), offset, index)
    return _LayerView(spec=spec, length=offset, seq=(keys, values))


def _rotating_view(
    keys: Any, values: Any, offset: Any, keep: Any, max_size: Any, idx: Any, index: int
) -> _LayerView:
    offset, keep, max_size, idx = (int(x) for x in (offset, keep, max_size, idx))
    # Until it wraps, a rotating buffer holds token p at index p. After that,
    # tokens were dropped or moved: no block slice could be trusted.
    if offset > max_size or idx != offset:
        raise NotReconstructable(
            f"RotatingKVCache has wrapped (offset={offset}, max_size={max_size}, _idx={idx})",
            layer=index,
        )
    return _kv_view(RotatingLayer(max_size=max_size, keep=keep), keys, values, offset, index)


def _quantized_view(
    keys: Any, values: Any, offset: Any, group_size: Any, bits: Any, index: int
) -> _LayerView:
    spec = QuantizedLayer(group_size=int(group_size), bits=int(bits))
    if keys is None or values is None:
        return _kv_view(spec, None, None, offset, index)
    if not (isinstance(keys, (tuple, list)) and isinstance(values, (tuple, list))):
        raise InvalidInput(f"cache_data[{index}]", keys, "quantized keys must be 3-tuples")
    if len(keys) != 3 or len(values) != 3:
        raise InvalidInput(f"cache_data[{index}]", keys, "quantized keys must be 3-tuples")
    arrays = (*keys, *values)
    offset = _check_seq_arrays(arrays, offset, index)
    return _LayerView(spec=spec, length=offset, seq=arrays)


def _arrays_view(state: Any, index: int) -> _LayerView:
    import mlx.core as mx

    if not isinstance(state, (list, tuple)) or not state:
        raise InvalidInput(f"cache_data[{index}]", state, "ArraysCache state must be a list")
    for a in state:
        if a is None:
            continue
        if not isinstance(a, mx.array):
            raise InvalidInput(f"cache_data[{index}]", state, "ArraysCache holds non-arrays")
        if a.ndim == 0 or a.shape[0] != 1:
            raise NotReconstructable("batch size must be 1", layer=index)
    return _LayerView(spec=ArraysLayer(size=len(state)), length=None, state=tuple(state))


def slice_blocks(
    cache_data: Sequence[Any],
    block_size: int,
    block_indices: Optional[Iterable[int]] = None,
    *,
    num_tokens: Optional[int] = None,
    wait: bool = True,
) -> list[BlockPayload]:
    """Cut a cache's state into per-block payloads that own their memory.

    Block ``i`` covers tokens ``[i * block_size, min((i + 1) * block_size,
    num_tokens))``; the last one may be partial. Recurrent layers get a
    snapshot only in the block that ends where the cache ends.

    Args:
        cache_data: the per-layer caches (see :func:`describe_cache`).
        block_size: tokens per block, > 0.
        block_indices: which blocks to cut, in any order; all by default.
        num_tokens: how many leading tokens the blocks cover; defaults to the
            cache's length, may be less, never more. Required for a cache with
            no sequence layer, whose state is then taken to cover exactly
            ``num_tokens`` tokens.
        wait: evaluate the payloads before returning; False queues them
            (``mx.async_eval``) for a caller that queues more work before it
            reads them: a read then waits for these, not for that work.

    Returns:
        One payload per requested block, in the order requested: evaluated,
        or queued (``wait=False``).

    Raises:
        InvalidInput: bad ``block_size``, ``num_tokens`` or block index, or
            malformed ``cache_data``.
        NotReconstructable: the cache could not be rebuilt exactly.
    """
    import mlx.core as mx

    if not isinstance(block_size, int) or block_size <= 0:
        raise InvalidInput("block_size", block_size, "must be a positive int")
    views = _read_layers(cache_data)
    length = _common_length(views)
    if num_tokens is None:
        if length is None:
            raise InvalidInput("num_tokens", None, "required: the cache has no sequence layer")
        num_tokens = length
    if not isinstance(num_tokens, int) or num_tokens <= 0:
        raise InvalidInput("num_tokens", num_tokens, "must be a positive int")
    if length is not None and num_tokens > length:
        raise InvalidInput("num_tokens", num_tokens, f"the cache holds only {length} tokens")
    boundary = num_tokens if length is None else length
    num_blocks = -(-num_tokens // block_size)
    indices = range(num_blocks) if block_indices is None else list(block_indices)
    for i in indices:
        if not isinstance(i, int) or not 0 <= i < num_blocks:
            raise InvalidInput("block_indices", i, f"must be in [0, {num_blocks})")

    specs = tuple(v.spec for v in views)
    signature = tuple(_signature(v) for v in views)
    payloads: list[BlockPayload] = []
    fresh: list[Any] = []
    for i in indices:
        start = i * block_size
        end = min(start + block_size, num_tokens)
        per_layer: list[Optional[tuple[Any, ...]]] = []
        for view in views:
            if view.spec.sequential:
                # mx.array() copies: the block must not be a view that pins
                # the source buffer.
                group = tuple(mx.array(a[:, :, start:end, :]) for a in view.seq)
            elif end == boundary:
                group = tuple(None if a is None else mx.array(a) for a in view.state)
            else:
                group = None
            if group:
                fresh.extend(a for a in group if a is not None)
            per_layer.append(group)
        payloads.append(
            BlockPayload(
                layers=specs,
                start=start,
                num_tokens=end - start,
                arrays=tuple(per_layer),
                signature=signature,
            )
        )
    if wait:
        mx.eval(fresh)
    else:
        mx.async_eval(fresh)
    logger.debug("sliced %d blocks of %d tokens, %d layers", len(payloads), block_size, len(views))
    return payloads


def _signature(view: _LayerView) -> tuple[Any, ...]:
    if view.spec.sequential:
        return tuple((str(a.dtype), a.shape[:2], a.shape[3:]) for a in view.seq)
    return tuple(None if a is None else (str(a.dtype), a.shape) for a in view.state)


def as_block_payload(
    cache_data: Any, *, start: int, num_tokens: int
) -> Optional[BlockPayload]:
    """Read a block's ``cache_data`` as a payload, if it is exactly one.

    A :class:`BlockPayload` is returned as it is. Otherwise ``cache_data`` is
    read the way the seed declares ``CacheBlock.cache_data``: one entry per
    layer, each a ``(keys, values)`` pair (4-D ``(1, H, T, D)`` or 3-D
    ``(H, T, D)`` arrays) or a seed-style ``{'state': (keys, values)}`` dict.
    It is taken as the block's KV state only if every layer is a plain KV
    layer whose arrays hold exactly ``num_tokens`` tokens; the arrays are
    used as they are (not copied), so the result must not be stored.

    Args:
        cache_data: a block's payload, as anyone may have set it.
        start: position of the block's first token.
        num_tokens: tokens the block holds, > 0.

    Returns:
        The payload, or None when ``cache_data`` is not exactly the KV state
        of ``num_tokens`` tokens (no data, a layer that carries nothing, a
        recurrent or unknown layer, another length, a malformed entry).
    """
    if isinstance(cache_data, BlockPayload):
        return cache_data
    if (
        cache_data is None
        or isinstance(cache_data, (str, bytes, Mapping))
        or not isinstance(cache_data, Sequence)
        or num_tokens <= 0
    ):
        return None
    try:
        views = _read_layers(cache_data)
    except CacheError:
        return None
    for view in views:
        if not isinstance(view.spec, KVLayer) or view.length != num_tokens:
            return None
        if any(a.shape[2] != num_tokens for a in view.seq):
            return None
    return BlockPayload(
        layers=tuple(v.spec for v in views),
        start=start,
        num_tokens=num_tokens,
        arrays=tuple(v.seq for v in views),
        signature=tuple(_signature(v) for v in views),
    )


def capacity_for(num_tokens: int, extra_tokens: int = 0) -> int:
    """Buffer size (in tokens) that :func:`reconstruct` allocates.

    Room for ``num_tokens`` plus at least ``max(extra_tokens, 1)`` more,
    rounded up to mlx-lm's :data:`STEP`: any use of a cache appends, and a
    buffer with no room would be regrown (copied) by the first append.

    Args:
        num_tokens: tokens to hold.
        extra_tokens: tokens the caller will append next.

    Returns:
        The capacity, a multiple of :data:`STEP`.
    """
    needed = num_tokens + max(extra_tokens, 1)
    return -(-needed // STEP) * STEP


def num_reconstructable_blocks(payloads: Sequence[Optional[BlockPayload]]) -> int:
    """How many leading payloads :func:`reconstruct` can rebuild exactly.

    The run stops at the first missing payload, at a payload that does not
    continue the previous one (position or layer layout), and, for layouts
    with recurrent layers, is cut back to the last payload that carries every
    recurrent snapshot.

    Args:
        payloads: payloads of blocks ``0, 1, ...`` in order; anything that is
            not a :class:`BlockPayload` (``None`` for a block without stored
            state) ends the run.

    Returns:
        ``n`` such that ``reconstruct(payloads[:n])`` succeeds (0 if none).
    """
    if not payloads or not isinstance(payloads[0], BlockPayload):
        return 0
    layers = payloads[0].layers
    signature = payloads[0].signature
    recurrent = any(not spec.sequential for spec in layers)
    position = 0
    usable = 0
    for i, payload in enumerate(payloads):
        if (
            not isinstance(payload, BlockPayload)
            or payload.layers != layers
            or payload.signature != signature
            or payload.start != position
            or payload.num_tokens <= 0
        ):
            break
        position = payload.end
        if not recurrent or payload.has_snapshots:
            usable = i + 1
    return usable


def reconstruct(
    payloads: Sequence[BlockPayload], *, extra_tokens: int = 0, evaluate: bool = True
) -> list[Any]:
    """Build mlx-lm cache objects holding exactly the tokens of ``payloads``.

    Each sequence layer's arrays are written with one ``concatenate`` (the
    blocks plus zero padding) into a buffer of :func:`capacity_for` tokens, so
    the prefix is copied once and the first ``update_and_fetch`` of up to
    ``extra_tokens`` tokens writes in place. On the CPU, keys and values are
    copied on two streams (two cores) at once. A ``RotatingKVCache`` gets room
    (up to its ``max_size``) only when ``extra_tokens <= 1``: mlx-lm appends
    several tokens to it by concatenation anyway. Recurrent layers get a copy
    of the last payload's snapshot.

    Args:
        payloads: payloads of blocks ``0..n-1``, in order.
        extra_tokens: tokens the caller will append next (the suffix).
        evaluate: evaluate the rebuilt arrays before returning. A caller that
            runs the model on the same thread right away passes False, so the
            copy is evaluated in one graph with the first model call.

    Returns:
        One cache object per layer (evaluated unless ``evaluate`` is False).

    Raises:
        InvalidInput: ``extra_tokens`` is negative.
        NotReconstructable: ``payloads`` is empty, does not line up from
            token 0, or (hybrid models) its last payload has no snapshot.
    """
    import mlx.core as mx
    from mlx_lm.models import cache as mlc

    if not isinstance(extra_tokens, int) or extra_tokens < 0:
        raise InvalidInput("extra_tokens", extra_tokens, "must be an int >= 0")
    if not payloads:
        raise NotReconstructable("no blocks to rebuild from")
    usable = num_reconstructable_blocks(payloads)
    if usable != len(payloads):
        raise NotReconstructable(
            f"only the first {usable} of {len(payloads)} blocks can be rebuilt exactly"
        )
    num_tokens = payloads[-1].end
    capacity = capacity_for(num_tokens, extra_tokens)

    streams = _copy_streams()
    caches: list[Any] = []
    fresh: list[Any] = []
    for i, spec in enumerate(payloads[0].layers):
        if not spec.sequential:
            layer = mlc.ArraysCache(spec.size)
            # Copies, so a model writing into its cache never touches a block.
            layer.cache = [None if a is None else mx.array(a) for a in payloads[-1].arrays[i]]
            fresh.extend(a for a in layer.cache if a is not None)
            caches.append(layer)
            continue
        size = capacity
        if isinstance(spec, RotatingLayer):
            # mlx-lm appends several tokens to a rotating cache by concatenation,
            # whatever room it has: padding would only be copied again. One
            # token is written in place, so room for it saves a copy.
            size = num_tokens if extra_tokens > 1 else min(capacity, spec.max_size)
        arrays = tuple(
            _concat_blocks(
                [p.arrays[i][j] for p in payloads], size - num_tokens, streams[j % len(streams)]
            )
            for j in range(len(payloads[0].arrays[i]))
        )
        fresh.extend(arrays)
        if isinstance(spec, KVLayer):
            layer = mlc.KVCache()
            layer.keys, layer.values = arrays
        elif isinstance(spec, RotatingLayer):
            layer = mlc.RotatingKVCache(max_size=spec.max_size, keep=spec.keep)
            layer.keys, layer.values = arrays
            layer._idx = num_tokens
        else:
            layer = mlc.QuantizedKVCache(group_size=spec.group_size, bits=spec.bits)
            layer.keys, layer.values = arrays[:3], arrays[3:]
        layer.offset = num_tokens
        caches.append(layer)
    if evaluate:
        mx.eval(fresh)
    logger.debug("rebuilt %d layers: %d tokens, room for %d", len(caches), num_tokens, capacity)
    return caches


_THREAD_STREAMS = threading.local()


def _copy_streams() -> tuple[Any, ...]:
    """Streams to spread a rebuild's copies over: the current one, and on the
    CPU a second one of this thread, so that keys and values are copied on two
    cores at once (MLX runs each CPU stream on its own worker thread)."""
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return (None,)
    second = getattr(_THREAD_STREAMS, "second", None)
    if second is None:
        second = _THREAD_STREAMS.second = mx.new_stream(mx.cpu)
    return (None, second)


def _concat_blocks(parts: list[Any], padding: int, stream: Any = None) -> Any:
    import mlx.core as mx

    if padding > 0:
        b, h, _, d = parts[0].shape
        parts = [*parts, mx.zeros((b, h, padding, d), dtype=parts[0].dtype, stream=stream)]
    if len(parts) == 1:
        # A one-input concatenate may return a view of that input.
        return mx.array(parts[0])
    return mx.concatenate(parts, axis=2, stream=stream)
