"""The stored form of a block: exact round trips, and nothing that does not verify decodes."""

from __future__ import annotations

import json
import struct
import threading

import attrs
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tier_blocks import assert_same_payload, forge_start, kv_blocks, mixed_blocks, namespace_of

from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.kv_state import (
    ArraysLayer,
    BlockPayload,
    KVLayer,
    QuantizedLayer,
    RotatingLayer,
    reconstruct,
    slice_blocks,
)
from mlxkv.cache.tiers import (
    FORMAT_VERSION,
    CorruptValue,
    check_value,
    decode_block,
    decode_payload,
    encode_block,
    max_value_size,
    storage_key,
)

from device_arithmetic import ON_CPU

DTYPES = [
    mx.float32,
    mx.float16,
    mx.bfloat16,
    mx.uint32,
    mx.uint8,
    mx.int8,
    mx.int32,
    mx.bool_,
    mx.complex64,
    *([mx.float64] if ON_CPU else []),  # MLX has no float64 on a GPU
]


def _random_array(draw: st.DrawFn, dtype: mx.Dtype, shape: tuple[int, ...]) -> mx.array:
    size = int(np.prod(shape, dtype=np.int64)) * dtype.size
    seed = draw(st.integers(0, 2**32 - 1))
    raw = np.random.default_rng(seed).bytes(size)
    array = mx.array(np.frombuffer(raw, dtype=np.uint8)).view(dtype).reshape(shape)
    mx.eval(array)
    return array


@st.composite
def payloads(draw: st.DrawFn) -> BlockPayload:
    """A full block of a random layout: plain, sliding-window, quantized and
    recurrent layers, any payload dtype, recurrent snapshots with None entries
    or no snapshot at all."""
    block_size = draw(st.integers(1, 5))
    layers, arrays, signature = [], [], []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["kv", "rotating", "quantized", "arrays"]))
        if kind == "arrays":
            size = draw(st.integers(1, 3))
            entries = []
            for _ in range(size):
                if draw(st.booleans()):
                    entries.append(None)
                    continue
                shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
                entries.append(_random_array(draw, draw(st.sampled_from(DTYPES)), shape))
            layers.append(ArraysLayer(size=size))
            signature.append(tuple(None if a is None else (str(a.dtype), a.shape) for a in entries))
            arrays.append(tuple(entries) if draw(st.booleans()) else None)
            continue
        count = 6 if kind == "quantized" else 2
        group = []
        for _ in range(count):
            shape = (1, draw(st.integers(1, 2)), block_size, draw(st.integers(1, 3)))
            group.append(_random_array(draw, draw(st.sampled_from(DTYPES)), shape))
        if kind == "kv":
            layers.append(KVLayer())
        elif kind == "rotating":
            layers.append(RotatingLayer(max_size=draw(st.integers(8, 64)), keep=draw(st.integers(0, 4))))
        else:
            layers.append(QuantizedLayer(group_size=draw(st.sampled_from([32, 64])), bits=draw(st.sampled_from([4, 8]))))
        signature.append(tuple((str(a.dtype), a.shape[:2], a.shape[3:]) for a in group))
        arrays.append(tuple(group))
    return BlockPayload(
        layers=tuple(layers),
        start=block_size * draw(st.integers(0, 3)),
        num_tokens=block_size,
        arrays=tuple(arrays),
        signature=tuple(signature),
    )


PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class TestRoundTrip:
    @PROPERTY
    @given(payload=payloads())
    def test_random_layouts_round_trip_exactly(self, payload):
        """Any layout's block decodes to the same layers, position and array bytes."""
        namespace = namespace_of(payload)
        key = storage_key(namespace, b"chain")
        decoded = decode_block(encode_block(payload, key=key, namespace=namespace), key=key, namespace=namespace)
        assert_same_payload(decoded, payload)

    def test_mixed_model_blocks_round_trip_and_rebuild(self):
        """bfloat16, 4-bit quantized and recurrent blocks cut by slice_blocks decode
        to payloads that reconstruct the same cache."""
        blocks = mixed_blocks(2)
        namespace = namespace_of(blocks[0])
        decoded = []
        for i, block in enumerate(blocks):
            key = storage_key(namespace, bytes([i]))
            decoded.append(decode_block(encode_block(block, key=key, namespace=namespace), key=key, namespace=namespace))
            assert_same_payload(decoded[-1], block)
        assert decoded[0].arrays[2] is None and decoded[1].arrays[2][1] is None
        rebuilt, original = reconstruct(decoded), reconstruct(blocks)
        assert mx.array_equal(rebuilt[0].keys[..., :8, :], original[0].keys[..., :8, :]).item()
        assert mx.array_equal(rebuilt[1].keys[0][..., :8, :], original[1].keys[0][..., :8, :]).item()

    def test_decoded_arrays_own_their_memory(self):
        """Each decoded array is exactly its own size (no view of the value's buffer)."""
        (block,) = kv_blocks(1)
        namespace = namespace_of(block)
        key = storage_key(namespace, b"k")
        decoded = decode_block(encode_block(block, key=key, namespace=namespace), key=key, namespace=namespace)
        assert decoded.nbytes == block.nbytes

    def test_decoded_on_another_thread_usable_here(self):
        """A block decoded on a worker thread is evaluated: this thread can compute with it."""
        (block,) = kv_blocks(1, dtype=mx.bfloat16)
        namespace = namespace_of(block)
        key = storage_key(namespace, b"k")
        value = encode_block(block, key=key, namespace=namespace)
        result = []
        worker = threading.Thread(target=lambda: result.append(decode_block(value, key=key, namespace=namespace)))
        worker.start()
        worker.join()
        assert mx.array_equal(result[0].arrays[0][0] * 2, block.arrays[0][0] * 2).item()


class TestDetection:
    @PROPERTY
    @given(payload=payloads(), data=st.data())
    def test_any_flipped_bit_is_detected(self, payload, data):
        """Flipping any one bit anywhere in a value makes it corrupt."""
        namespace = namespace_of(payload)
        key = storage_key(namespace, b"chain")
        value = bytearray(encode_block(payload, key=key, namespace=namespace))
        position = data.draw(st.integers(0, len(value) - 1))
        value[position] ^= 1 << data.draw(st.integers(0, 7))
        with pytest.raises(CorruptValue):
            check_value(bytes(value), key=key, namespace=namespace)

    @PROPERTY
    @given(payload=payloads(), data=st.data())
    def test_any_truncation_or_extension_is_detected(self, payload, data):
        """A value cut short anywhere, or with bytes appended, is corrupt."""
        namespace = namespace_of(payload)
        key = storage_key(namespace, b"chain")
        value = encode_block(payload, key=key, namespace=namespace)
        with pytest.raises(CorruptValue):
            check_value(value[: data.draw(st.integers(0, len(value) - 1))], key=key, namespace=namespace)
        with pytest.raises(CorruptValue):
            check_value(value + data.draw(st.binary(min_size=1, max_size=8)), key=key, namespace=namespace)

    @pytest.mark.parametrize(
        "other",
        [
            pytest.param(lambda block: namespace_of(block, model="sha256:model-b"), id="other-model"),
            pytest.param(lambda block: namespace_of(block, extra="adapter-x"), id="other-extra"),
            pytest.param(lambda block: namespace_of(kv_blocks(1, block_size=8)[0]), id="other-block-size"),
            pytest.param(lambda block: namespace_of(kv_blocks(1, dtype=mx.float32)[0]), id="other-dtype"),
            pytest.param(lambda block: namespace_of(kv_blocks(1, heads=2)[0]), id="other-kv-heads"),
        ],
    )
    def test_another_namespace_never_decodes(self, other):
        """A value read as if it belonged to another namespace is corrupt, even
        under the key it was written with."""
        (block,) = kv_blocks(1)
        namespace = namespace_of(block)
        key = storage_key(namespace, b"chain")
        value = encode_block(block, key=key, namespace=namespace)
        with pytest.raises(CorruptValue, match="another namespace"):
            check_value(value, key=key, namespace=other(block))

    def test_value_under_another_key_is_corrupt(self):
        """A value copied under another block's key does not decode there."""
        (block,) = kv_blocks(1)
        namespace = namespace_of(block)
        value = encode_block(block, key=storage_key(namespace, b"a"), namespace=namespace)
        with pytest.raises(CorruptValue, match="another key"):
            check_value(value, key=storage_key(namespace, b"b"), namespace=namespace)

    def test_other_format_version_is_corrupt(self):
        """A value of another format version is corrupt (a miss, not a misread)."""
        (block,) = kv_blocks(1)
        namespace = namespace_of(block)
        key = storage_key(namespace, b"a")
        value = bytearray(encode_block(block, key=key, namespace=namespace))
        struct.pack_into("<H", value, 6, FORMAT_VERSION + 1)
        with pytest.raises(CorruptValue, match=f"format version {FORMAT_VERSION + 1}"):
            check_value(bytes(value), key=key, namespace=namespace)

    def test_empty_and_foreign_values_are_corrupt(self):
        """Empty bytes and bytes that are no block value at all are corrupt."""
        (block,) = kv_blocks(1)
        namespace = namespace_of(block)
        key = storage_key(namespace, b"a")
        for value in (b"", b"hello", b"x" * 100):
            with pytest.raises(CorruptValue):
                check_value(value, key=key, namespace=namespace)


class TestPosition:
    def test_a_value_for_another_position_is_corrupt_where_the_position_is_known(self):
        """A value whose ``start`` was changed and its checksum recomputed verifies
        on its own, but not for the position it was read for."""
        blocks = kv_blocks(2)
        namespace = namespace_of(blocks[0])
        key = storage_key(namespace, b"second")
        value = encode_block(blocks[1], key=key, namespace=namespace)
        assert check_value(value, key=key, namespace=namespace, start=4).start == 4
        forged = forge_start(value, 8)
        assert check_value(forged, key=key, namespace=namespace).start == 8  # a forgery, not a corruption
        with pytest.raises(CorruptValue, match="position 8 stored where position 4 was read"):
            check_value(forged, key=key, namespace=namespace, start=4)


class TestMaxValueSize:
    @PROPERTY
    @given(payload=payloads())
    def test_no_value_is_larger(self, payload):
        """Any block of any layout, at any position, encodes to at most the bound."""
        namespace = namespace_of(payload)
        value = encode_block(payload, key=storage_key(namespace, b"chain"), namespace=namespace)
        assert len(value) <= max_value_size(namespace)

    @pytest.mark.parametrize("make", [kv_blocks, mixed_blocks], ids=["plain", "mixed"])
    def test_the_bound_is_exact(self, make):
        """A block holding every array (a recurrent snapshot too) at the
        largest position takes exactly the bound: a tier refuses nothing real."""
        block = make(2)[-1]
        namespace = namespace_of(block)
        value = encode_block(attrs.evolve(block, start=2**64), key=storage_key(namespace, b"c"), namespace=namespace)
        assert len(value) == max_value_size(namespace)


class TestEncodeRefuses:
    def test_a_partial_block(self):
        """Only full blocks are stored: a trailing partial block is refused."""
        import mlx_lm.models.cache as mlc

        cache = mlc.KVCache()
        cache.update_and_fetch(mx.zeros((1, 1, 6, 8)), mx.zeros((1, 1, 6, 8)))
        full, partial = slice_blocks([cache], 4)
        namespace = namespace_of(full)
        with pytest.raises(InvalidInput, match="2 tokens"):
            encode_block(partial, key=storage_key(namespace, b"a"), namespace=namespace)

    def test_a_block_off_the_boundaries(self):
        """A block whose start is not a multiple of the block size is refused."""
        (block,) = kv_blocks(1)
        namespace = namespace_of(block)
        with pytest.raises(InvalidInput, match="boundary"):
            encode_block(attrs.evolve(block, start=1), key=storage_key(namespace, b"a"), namespace=namespace)

    def test_a_block_of_another_layout(self):
        """A float32 block is refused by a float16 namespace."""
        namespace = namespace_of(kv_blocks(1)[0])
        (other,) = kv_blocks(1, dtype=mx.float32)
        with pytest.raises(InvalidInput, match="layout"):
            encode_block(other, key=storage_key(namespace, b"a"), namespace=namespace)


def _rewritten(value: bytes, header: bytes) -> bytes:
    """``value`` with its header replaced and its checksum made to match:
    what a writer other than :func:`encode_block` could store."""
    import zlib

    _, version, size = struct.unpack_from("<6sHI", value, 0)
    body = struct.pack("<6sHI", b"MLXKVB", version, len(header)) + header + value[12 + size : -4]
    return body + struct.pack("<I", zlib.crc32(body))


def _verdict(check):
    try:
        return check()
    except CorruptValue:
        return "corrupt"


class TestHeaderFastPath:
    """A header like one already verified is compared, not parsed; the
    verdict is the full parse's on every header."""

    def test_every_block_of_a_run_verifies_with_its_own_start(self):
        blocks = kv_blocks(3)
        namespace = namespace_of(blocks[0])
        for index, block in enumerate(blocks):
            key = storage_key(namespace, bytes([index]))
            checked = check_value(encode_block(block, key=key, namespace=namespace), key=key, namespace=namespace)
            assert (checked.start, checked.num_tokens) == (block.start, block.num_tokens)
            assert_same_payload(decode_payload(checked), block)

    @pytest.mark.parametrize(
        "rewrite",
        [
            pytest.param(lambda h: h, id="as-written"),
            pytest.param(lambda h: json.dumps(json.loads(h)).encode(), id="spaced"),
            pytest.param(lambda h: json.dumps(dict(reversed(json.loads(h).items()))).encode(), id="reordered"),
            pytest.param(lambda h: h.replace(b'"start":8', b'"start":08'), id="leading-zero"),
            pytest.param(lambda h: h.replace(b'"start":8', b'"start":8.0'), id="float-start"),
            pytest.param(lambda h: h.replace(b'"start":8', b'"start":-8'), id="negative-start"),
            pytest.param(lambda h: h.replace(b'"start":8', b'"start":16'), id="other-start"),
            pytest.param(lambda h: h.replace(b'"start":8', b'"start":9'), id="off-boundary"),
            pytest.param(lambda h: h.replace(b'"num_tokens"', b'"start":0,"num_tokens"'), id="start-twice"),
            pytest.param(lambda h: h.replace(b'"start":8', b'"start":8e0'), id="exponent"),
            pytest.param(lambda h: h[:-1] + b',"extra":1}', id="extra-field"),
            pytest.param(lambda h: h.replace(b'"nbytes":', b'"nbytes":1', 1), id="wrong-size"),
        ],
    )
    def test_the_verdict_is_the_full_parse(self, rewrite):
        from mlxkv.cache.tiers import block_format

        first, second = kv_blocks(2, block_size=8)
        namespace = namespace_of(first)
        key = storage_key(namespace, b"second")
        # The first block's header is verified first, so the fast path knows its kind.
        known = storage_key(namespace, b"first")
        check_value(encode_block(first, key=known, namespace=namespace), key=known, namespace=namespace)
        value = encode_block(second, key=key, namespace=namespace)
        size = struct.unpack_from("<I", value, 8)[0]
        header = rewrite(value[12 : 12 + size])
        stored = _rewritten(value, header)
        checked = _verdict(lambda: check_value(stored, key=key, namespace=namespace))
        parsed = _verdict(lambda: block_format._parse_header(header, key, namespace))
        if parsed != "corrupt":
            start, num_tokens = parsed[0], parsed[1]
            if num_tokens != 8 or start % 8 or parsed[4] != len(value) - 16 - size:
                parsed = "corrupt"
        if checked == "corrupt" or parsed == "corrupt":
            assert checked == parsed
        else:
            assert (checked.start, checked.num_tokens, checked.arrays) == (parsed[0], parsed[1], parsed[3])
