"""The stored form of one block: a header, the arrays' bytes and a checksum.

A value is laid out as::

    magic "MLXKVB" | format version (u16 LE) | header length (u32 LE)
    | header (UTF-8 JSON) | arrays' bytes, back to back | CRC-32 of all before (u32 LE)

The header names the namespace digest and the storage key the value was
written under, the block's ``start`` and ``num_tokens``, its KV layout
(layer specs and signature) and, per layer, each array's dtype, shape, byte
offset and size (``null`` for a layer, or a recurrent state entry, that
carries nothing). Arrays are written in C order in their own dtype; on
decode each is copied into a fresh MLX array of that dtype (bytes are
reinterpreted with ``view``, which is how bfloat16 survives without numpy
knowing it).

:func:`check_value` verifies everything a value claims before any array is
built: its size, magic, version and checksum, that its header parses and
names the expected namespace and key, that its layout is the namespace's,
that it is one full block (at the position it was read for, when the reader
knows it), and that every array's dtype, shape and bytes
agree with the layout and with the value's length (a header that differs
from one verified before only in its key and ``start`` is compared byte for
byte instead of parsed again: the same verdict, in about half the time).
Anything else raises
:class:`~mlxkv.cache.tiers.errors.CorruptValue`; :func:`decode_payload` then
cannot fail on what :func:`check_value` accepted. A value is therefore
either exactly the block that was encoded, or a miss: never wrong KV.

The checksum detects corruption, not forgery: whoever can write to a tier
can write a value that verifies. Share a tier only with writers you trust.
CRC-32 (zlib's) rather than a cryptographic hash, since forgery is out of its
reach either way: it misses a random corruption with probability 2**-32 (and
none of up to 32 flipped bits in a row), and costs a fifth of BLAKE2b's time
here, which was the largest part of verifying a value (a warm restart reads
one value per block).
"""

from __future__ import annotations

import functools
import json
import math
import re
import struct
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Optional, Union

import attrs

from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.kv_state import ArraysLayer, BlockPayload, QuantizedLayer
from mlxkv.cache.tiers.errors import CorruptValue
from mlxkv.cache.tiers.kv_layout import KVLayout
from mlxkv.cache.tiers.storage_key import KEY_SIZE, StorageKey

if TYPE_CHECKING:
    from mlxkv.cache.tiers.namespace import Namespace

__all__ = [
    "FORMAT_VERSION",
    "ArrayRecord",
    "CheckedValue",
    "check_value",
    "decode_block",
    "decode_payload",
    "decode_payloads",
    "encode_block",
    "max_value_size",
]

#: Version of the value layout above. A value of another version is corrupt
#: (a miss); the namespace includes the version, so its key differs anyway.
#: (1: a BLAKE2b-256 checksum.)
FORMAT_VERSION = 2

_MAGIC = b"MLXKVB"
_PREFIX = struct.Struct("<6sHI")
_CHECKSUM = struct.Struct("<I")
_CHECKSUM_SIZE = _CHECKSUM.size
_MAX_HEADER = 1 << 24

#: The dtypes a payload can hold, by ``str(dtype)``, with their item sizes.
_ITEM_SIZES = {
    "mlx.core.bool": 1,
    "mlx.core.uint8": 1,
    "mlx.core.uint16": 2,
    "mlx.core.uint32": 4,
    "mlx.core.uint64": 8,
    "mlx.core.int8": 1,
    "mlx.core.int16": 2,
    "mlx.core.int32": 4,
    "mlx.core.int64": 8,
    "mlx.core.float16": 2,
    "mlx.core.bfloat16": 2,
    "mlx.core.float32": 4,
    "mlx.core.float64": 8,
    "mlx.core.complex64": 8,
}

Buffer = Union[bytes, bytearray, memoryview]


@attrs.frozen
class ArrayRecord:
    """Where one array's bytes are in a value and what they are.

    Attributes:
        dtype: ``str(array.dtype)``, one of the payload dtypes.
        shape: the array's shape.
        offset: byte offset from the start of the arrays' region.
        nbytes: ``prod(shape) * itemsize``.
    """

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@attrs.frozen(eq=False)
class CheckedValue:
    """A stored value that :func:`check_value` verified against its key and namespace.

    Attributes:
        key: the storage key it was read under (and names in its header).
        start: position of the block's first token.
        num_tokens: tokens in the block (the namespace's block size).
        layout: the block's layout (the namespace's).
        arrays: per layer, ``None`` or one record (or ``None``) per array.
        data: the whole value as read.
        arrays_offset: where the arrays' region begins in ``data``.
    """

    key: StorageKey
    start: int
    num_tokens: int
    layout: KVLayout
    arrays: tuple[Optional[tuple[Optional[ArrayRecord], ...]], ...]
    data: Buffer = attrs.field(repr=False)
    arrays_offset: int

    @property
    def nbytes(self) -> int:
        """Size of the stored value in bytes."""
        return len(self.data)


def encode_block(payload: BlockPayload, *, key: StorageKey, namespace: Namespace) -> bytes:
    """The stored form of ``payload`` under ``key`` in ``namespace``.

    Reads the payload's (evaluated) arrays through the buffer protocol, so it
    may run on any thread.

    Args:
        payload: one full block of the namespace's layout.
        key: the storage key it will be stored under.
        namespace: the namespace it belongs to.

    Returns:
        The value; :func:`decode_block` with the same key and namespace gives
        back a payload equal to this one array for array, bit for bit.

    Raises:
        InvalidInput: ``payload`` is not a full block of ``namespace``'s
            layout (wrong layout, length, start or arrays).
    """
    if not isinstance(payload, BlockPayload):
        raise InvalidInput("payload", payload, "must be a BlockPayload")
    if _layout_of(payload) != namespace.layout:
        raise InvalidInput("payload", payload, "its layout is not the namespace's")
    _check_block_extent(payload.start, payload.num_tokens, namespace, _refuse)
    records: list[Optional[tuple[Optional[ArrayRecord], ...]]] = []
    buffers: list[memoryview] = []
    offset = 0
    for group in payload.arrays:
        if group is None:
            records.append(None)
            continue
        layer_records: list[Optional[ArrayRecord]] = []
        for array in group:
            if array is None:
                layer_records.append(None)
                continue
            view = memoryview(array)
            if not view.c_contiguous:
                view = memoryview(view.tobytes())
            dtype = str(array.dtype)
            layer_records.append(ArrayRecord(dtype, tuple(array.shape), offset, view.nbytes))
            buffers.append(view)
            offset += view.nbytes
        records.append(tuple(layer_records))
    records_tuple = tuple(records)
    _check_arrays(namespace.layout, payload.num_tokens, records_tuple, _refuse)
    header = _header(namespace, key, payload.start, payload.num_tokens, records_tuple)
    base = _PREFIX.size + len(header)
    out = bytearray(base + offset + _CHECKSUM_SIZE)
    _PREFIX.pack_into(out, 0, _MAGIC, FORMAT_VERSION, len(header))
    out[_PREFIX.size : base] = header
    position = base
    for view in buffers:
        out[position : position + view.nbytes] = view
        position += view.nbytes
    body = memoryview(out)[: len(out) - _CHECKSUM_SIZE]
    _CHECKSUM.pack_into(out, len(out) - _CHECKSUM_SIZE, zlib.crc32(body))
    body.release()
    return bytes(out)


def check_value(
    data: Buffer, *, key: StorageKey, namespace: Namespace, start: Optional[int] = None
) -> CheckedValue:
    """Verify a stored value against the key it was read under and its namespace.

    Pure Python and zlib (no MLX), so tiers run it in their reading
    threads.

    Args:
        data: the value as read.
        key: the storage key it was read under.
        namespace: the namespace it must belong to.
        start: the position (token index) its block must begin at, when the
            reader knows it; a value for another position is corrupt (its
            key and checksum may well verify: whoever wrote it changed its
            ``start``).

    Returns:
        The verified value, ready for :func:`decode_payload`.

    Raises:
        CorruptValue: anything about the value does not verify (see the
            module docstring).
    """
    size = len(data)
    if size < _PREFIX.size + _CHECKSUM_SIZE:
        _corrupt(f"{size} bytes is shorter than any value")
    magic, version, header_size = _PREFIX.unpack_from(data, 0)
    if magic != _MAGIC:
        _corrupt("not a block value (bad magic)")
    if version != FORMAT_VERSION:
        _corrupt(f"format version {version}, expected {FORMAT_VERSION}")
    if header_size > min(_MAX_HEADER, size - _PREFIX.size - _CHECKSUM_SIZE):
        _corrupt(f"header length {header_size} does not fit in {size} bytes")
    with memoryview(data) as view:
        (stored,) = _CHECKSUM.unpack_from(view, size - _CHECKSUM_SIZE)
        if zlib.crc32(view[: size - _CHECKSUM_SIZE]) != stored:
            _corrupt("checksum mismatch")
        header_bytes = bytes(view[_PREFIX.size : _PREFIX.size + header_size])
    fields = _known_header(header_bytes, key, namespace)
    if fields is None:
        fields = _parse_header(header_bytes, key, namespace)
    found_start, num_tokens, layout, arrays, end = fields
    _check_block_extent(found_start, num_tokens, namespace, _corrupt)
    if start is not None and found_start != start:
        _corrupt(f"a block of position {found_start} stored where position {start} was read")
    region = size - _PREFIX.size - header_size - _CHECKSUM_SIZE
    if end != region:
        _corrupt(f"arrays take {end} bytes, the value holds {region}")
    return CheckedValue(
        key=key,
        start=found_start,
        num_tokens=num_tokens,
        layout=layout,
        arrays=arrays,
        data=data,
        arrays_offset=_PREFIX.size + header_size,
    )


#: A ``start`` beyond any real block's, for :func:`max_value_size`'s header.
_LARGEST_START = 2**64


@functools.lru_cache(maxsize=16)
def max_value_size(namespace: Namespace) -> int:
    """The most bytes a value of ``namespace`` can take (a block starting below 2**64).

    Every value of a namespace has the same arrays but for a recurrent
    layer's snapshot, which a block may leave out, and the same header but
    for its key and ``start``: this is the size of a value holding every
    array, with the longest ``start``. A tier reads no more than this of
    anything stored under a key: a longer value is corrupt unread.
    """
    size = namespace.block_size
    records: list[tuple[Optional[ArrayRecord], ...]] = []
    offset = 0
    for spec, signature in zip(namespace.layout.layers, namespace.layout.signature):
        group: list[Optional[ArrayRecord]] = []
        for entry in signature:
            if entry is None:
                group.append(None)
                continue
            if isinstance(spec, ArraysLayer):
                shape = tuple(entry[1])
            else:
                shape = (*entry[1], size, *entry[2])
            nbytes = math.prod(shape) * _ITEM_SIZES.get(entry[0], 0)
            group.append(ArrayRecord(entry[0], shape, offset, nbytes))
            offset += nbytes
        records.append(tuple(group))
    header = _header(namespace, _PLACEHOLDER_KEY, _LARGEST_START, size, tuple(records))
    return _PREFIX.size + len(header) + offset + _CHECKSUM_SIZE


def _header(
    namespace: Namespace,
    key: StorageKey,
    start: int,
    num_tokens: int,
    records: tuple[Optional[tuple[Optional[ArrayRecord], ...]], ...],
) -> bytes:
    """A value's header as :func:`encode_block` writes it."""
    return json.dumps(
        {
            "namespace": namespace.digest.hex(),
            "key": bytes(key).hex(),
            "start": start,
            "num_tokens": num_tokens,
            "layout": namespace.layout.to_json(),
            "arrays": [_records_to_json(group) for group in records],
        },
        separators=(",", ":"),
    ).encode()


#: What :func:`_parse_header` returns: ``start``, ``num_tokens``, the
#: layout, the array records and where the last array ends.
_HeaderFields = tuple[int, int, KVLayout, tuple[Optional[tuple[Optional[ArrayRecord], ...]], ...], int]

#: A run of ASCII digits as JSON writes an int >= 0 (no leading zero).
_COUNT = re.compile(rb"0|[1-9][0-9]*")

#: The storage key :func:`_header_after_start` parses its headers under.
_PLACEHOLDER_KEY = StorageKey(bytes(KEY_SIZE))


def _known_header(header: bytes, key: StorageKey, namespace: Namespace) -> Optional[_HeaderFields]:
    """The header's fields without parsing it, when it is the kind
    :func:`encode_block` writes and one like it (all but its key and start)
    verified before; else None (then :func:`_parse_header` decides).

    Every header of a namespace's blocks is one text but for the key and
    ``start``, so what follows ``start`` is parsed and verified once
    (:func:`_header_after_start`, cached) and compared byte for byte after
    that: a block's header costs a comparison, not a JSON parse and a
    check of every array record (a warm restart reads one per block).
    Whatever this accepts, :func:`_parse_header` accepts with the same fields.
    """
    if len(key) != KEY_SIZE:
        return None
    lead = _header_lead(namespace.digest, bytes(key))
    if not header.startswith(lead):
        return None
    count = _COUNT.match(header, len(lead))
    if count is None:
        return None
    try:
        _, num_tokens, layout, arrays, end = _header_after_start(header[count.end() :], namespace)
    except CorruptValue:
        return None
    return int(count.group()), num_tokens, layout, arrays, end


def _header_lead(digest: bytes, key: bytes) -> bytes:
    """A header's text up to its ``start`` value, as :func:`encode_block` writes it."""
    return b'{"namespace":"%s","key":"%s","start":' % (digest.hex().encode(), key.hex().encode())


@functools.lru_cache(maxsize=64)
def _header_after_start(rest: bytes, namespace: Namespace) -> _HeaderFields:
    """:func:`_parse_header` of a header that ends with ``rest`` after a
    ``start`` of 0 (under a placeholder key); raises CorruptValue if that
    header does not verify or its ``start`` is not the one before ``rest``
    (``rest`` names one of its own: JSON's last duplicate wins)."""
    lead = _header_lead(namespace.digest, _PLACEHOLDER_KEY)
    for start in (1, 0):
        fields = _parse_header(lead + b"%d" % start + rest, _PLACEHOLDER_KEY, namespace)
        if fields[0] != start:
            _corrupt("a header that names its start twice")
    return fields


def _parse_header(header_bytes: bytes, key: StorageKey, namespace: Namespace) -> _HeaderFields:
    """Parse and verify a value's header against its key and namespace (its
    block extent and size are checked by the caller)."""
    try:
        header = json.loads(header_bytes)
    except ValueError as exc:
        _corrupt(f"header is not JSON: {exc}")
    if not isinstance(header, dict) or set(header) != {
        "namespace",
        "key",
        "start",
        "num_tokens",
        "layout",
        "arrays",
    }:
        _corrupt("header fields are not a block header's")
    if header["namespace"] != namespace.digest.hex():
        _corrupt("another namespace")
    if len(key) != KEY_SIZE or header["key"] != bytes(key).hex():
        _corrupt("stored under another key")
    if header["layout"] == _layout_json(namespace.layout):
        layout = namespace.layout  # the usual case, without building it again
    else:
        try:
            layout = KVLayout.from_json(header["layout"])
        except InvalidInput as exc:
            _corrupt(f"layout: {exc}")
        if layout != namespace.layout:
            _corrupt("another KV layout")
    start, num_tokens = header["start"], header["num_tokens"]
    if not (_is_count(start) and _is_count(num_tokens)):
        _corrupt("start and num_tokens must be ints >= 0")
    arrays = _records_from_json(header["arrays"])
    end = _check_arrays(layout, num_tokens, arrays, _corrupt)
    return start, num_tokens, layout, arrays, end


@functools.lru_cache(maxsize=16)
def _layout_json(layout: KVLayout) -> Any:
    """``layout`` as a value header's JSON reads back (lists for tuples)."""
    return json.loads(json.dumps(layout.to_json()))


def decode_payload(value: CheckedValue) -> BlockPayload:
    """The block a verified value holds, as evaluated MLX arrays that own their memory.

    MLX work: the arrays are built and evaluated on the calling thread (any
    thread will do; only evaluated arrays are returned).

    Args:
        value: what :func:`check_value` returned.

    Returns:
        A payload equal to the one encoded, array for array, bit for bit.
    """
    return decode_payloads([value])[0]


def decode_payloads(values: Sequence[CheckedValue]) -> list[BlockPayload]:
    """:func:`decode_payload` of each value, with one evaluation for all of them.

    An array whose dtype NumPy has is copied into MLX straight from a typed
    view of the value's bytes (no MLX graph); only the others (bfloat16) are
    reinterpreted by MLX, and evaluated together at the end.
    """
    import mlx.core as mx
    import numpy as np

    pending: list[Any] = []

    def build(value: CheckedValue, record: ArrayRecord) -> Any:
        start = value.arrays_offset + record.offset
        typed = _numpy_dtype(record.dtype)
        if typed is not None:
            count = record.nbytes // np.dtype(typed).itemsize
            view = np.frombuffer(value.data, dtype=typed, count=count, offset=start)
            return mx.array(view.reshape(record.shape))
        raw = np.frombuffer(value.data, dtype=np.uint8, count=record.nbytes, offset=start)
        # mx.array copies; view reinterprets those bytes in place.
        array = mx.array(raw).view(_mx_dtype(record.dtype)).reshape(record.shape)
        pending.append(array)
        return array

    payloads = [
        BlockPayload(
            layers=value.layout.layers,
            start=value.start,
            num_tokens=value.num_tokens,
            arrays=tuple(
                None if group is None else tuple(None if r is None else build(value, r) for r in group)
                for group in value.arrays
            ),
            signature=value.layout.signature,
        )
        for value in values
    ]
    if pending:
        mx.eval(pending)
    return payloads


def decode_block(data: Buffer, *, key: StorageKey, namespace: Namespace) -> BlockPayload:
    """:func:`check_value`, then :func:`decode_payload`.

    Raises:
        CorruptValue: the value does not verify.
    """
    return decode_payload(check_value(data, key=key, namespace=namespace))


#: MLX dtypes NumPy has under the same name (bfloat16 is the one it lacks).
_NUMPY_DTYPES = frozenset(
    {"bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "float16", "float32"}
)


def _numpy_dtype(name: str) -> Optional[str]:
    attribute = name.rpartition(".")[2]
    return attribute if attribute in _NUMPY_DTYPES else None


def _mx_dtype(name: str) -> Any:
    import mlx.core as mx

    attribute = name.rpartition(".")[2]
    return mx.bool_ if attribute == "bool" else getattr(mx, attribute)


def _layout_of(payload: BlockPayload) -> Optional[KVLayout]:
    try:
        return KVLayout.of(payload)
    except InvalidInput:
        return None


def _refuse(reason: str) -> NoReturn:
    raise InvalidInput("payload", None, reason)


def _corrupt(reason: str) -> NoReturn:
    raise CorruptValue(reason)


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _check_block_extent(
    start: int, num_tokens: int, namespace: Namespace, fail: Callable[[str], NoReturn]
) -> None:
    if num_tokens != namespace.block_size:
        fail(f"{num_tokens} tokens, a block holds {namespace.block_size}")
    if start < 0 or start % namespace.block_size:
        fail(f"start {start} is not at a block boundary")


def _check_arrays(
    layout: KVLayout,
    num_tokens: int,
    arrays: tuple[Optional[tuple[Optional[ArrayRecord], ...]], ...],
    fail: Callable[[str], NoReturn],
) -> int:
    """Check every array against the layout; return where the last one ends.

    Sequence layers carry all their arrays (2, or 6 quantized), 4-D with
    ``num_tokens`` on axis 2; a recurrent layer carries nothing or its
    snapshot, whose entries are ``None`` exactly where the signature's are.
    Arrays are back to back from offset 0, each of its dtype's size.
    """
    if len(arrays) != len(layout.layers):
        fail(f"{len(arrays)} layers of arrays for {len(layout.layers)} layers")
    end = 0
    for index, (spec, signature, group) in enumerate(zip(layout.layers, layout.signature, arrays)):
        where = f"layer {index}"
        if isinstance(spec, ArraysLayer):
            if group is None:
                continue
            if len(group) != len(signature) or len(group) != spec.size:
                fail(f"{where}: {len(group)} state arrays, expected {spec.size}")
            expected = [None if s is None else (s[0], tuple(s[1])) for s in signature]
            actual = [None if r is None else (r.dtype, r.shape) for r in group]
        else:
            count = 6 if isinstance(spec, QuantizedLayer) else 2
            if group is None or len(group) != count or len(signature) != count:
                fail(f"{where}: a sequence layer carries {count} arrays")
            if any(r is None or len(r.shape) != 4 or r.shape[2] != num_tokens for r in group):
                fail(f"{where}: arrays must be 4-D with {num_tokens} tokens on axis 2")
            expected = [(s[0], tuple(s[1]), tuple(s[2])) for s in signature]
            actual = [(r.dtype, r.shape[:2], r.shape[3:]) for r in group]
        if actual != expected:
            fail(f"{where}: arrays {actual} do not match the layout {expected}")
        for record in group:
            if record is None:
                continue
            if record.dtype not in _ITEM_SIZES:
                fail(f"{where}: dtype {record.dtype} is not a payload dtype")
            if record.offset != end:
                fail(f"{where}: array at offset {record.offset}, expected {end}")
            if record.nbytes != math.prod(record.shape) * _ITEM_SIZES[record.dtype]:
                fail(f"{where}: {record.nbytes} bytes for {record.dtype} {record.shape}")
            end += record.nbytes
    return end


def _records_to_json(group: Optional[tuple[Optional[ArrayRecord], ...]]) -> Any:
    if group is None:
        return None
    return [
        None
        if r is None
        else {"dtype": r.dtype, "shape": list(r.shape), "offset": r.offset, "nbytes": r.nbytes}
        for r in group
    ]


def _records_from_json(data: Any) -> tuple[Optional[tuple[Optional[ArrayRecord], ...]], ...]:
    if not isinstance(data, list):
        _corrupt("'arrays' is not a list")
    return tuple(None if group is None else _group_from_json(group) for group in data)


def _group_from_json(group: Any) -> tuple[Optional[ArrayRecord], ...]:
    if not isinstance(group, list):
        _corrupt("a layer's arrays are not a list")
    return tuple(None if item is None else _record_from_json(item) for item in group)


def _record_from_json(item: Any) -> ArrayRecord:
    if not isinstance(item, dict) or set(item) != {"dtype", "shape", "offset", "nbytes"}:
        _corrupt("an array record's fields are not dtype, shape, offset, nbytes")
    dtype, shape, offset, nbytes = item["dtype"], item["shape"], item["offset"], item["nbytes"]
    if not isinstance(dtype, str) or not isinstance(shape, list):
        _corrupt("an array record's dtype or shape has the wrong type")
    if not all(_is_count(d) for d in shape) or not (_is_count(offset) and _is_count(nbytes)):
        _corrupt("an array record holds a negative or non-integer size")
    return ArrayRecord(dtype, tuple(shape), offset, nbytes)
