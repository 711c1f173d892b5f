"""Real blocks for the tier tests: mlx-lm caches with random KV, cut by ``slice_blocks``."""

from __future__ import annotations

import textwrap
from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models import cache as mlc

from mlxkv.cache.block_hash import hash_block_chain
from mlxkv.cache.kv_state import BlockPayload, slice_blocks
from mlxkv.cache.tiers import KVLayout, Namespace, namespace_from_fields

BLOCK_SIZE = 4


def kv_blocks(
    num_blocks: int = 3,
    *,
    block_size: int = BLOCK_SIZE,
    dtype: Any = mx.float16,
    num_layers: int = 2,
    heads: int = 1,
    head_dim: int = 8,
    seed: int = 0,
) -> list[BlockPayload]:
    """Payloads of ``num_blocks`` full blocks of a plain-attention model."""
    mx.random.seed(seed)
    caches = []
    for _ in range(num_layers):
        cache = mlc.KVCache()
        shape = (1, heads, num_blocks * block_size, head_dim)
        cache.update_and_fetch(
            mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype)
        )
        caches.append(cache)
    return slice_blocks(caches, block_size)


def mixed_blocks(num_blocks: int = 2, *, block_size: int = BLOCK_SIZE, seed: int = 1) -> list[BlockPayload]:
    """Payloads of a model with bfloat16 KV, 4-bit quantized KV and a
    recurrent layer (its snapshot only in the last block)."""
    mx.random.seed(seed)
    n = num_blocks * block_size
    plain = mlc.KVCache()
    plain.update_and_fetch(
        mx.random.normal((1, 2, n, 8)).astype(mx.bfloat16),
        mx.random.normal((1, 2, n, 8)).astype(mx.bfloat16),
    )
    quantized = mlc.QuantizedKVCache(group_size=32, bits=4)
    quantized.update_and_fetch(mx.random.normal((1, 1, n, 64)), mx.random.normal((1, 1, n, 64)))
    recurrent = mlc.ArraysCache(2)
    recurrent.cache = [mx.random.normal((1, 3, 16)), None]
    return slice_blocks([plain, quantized, recurrent], block_size)


def namespace_of(
    payload: BlockPayload, *, model: str = "sha256:model-a", block_size: Optional[int] = None, extra: str = ""
) -> Namespace:
    """The namespace of ``payload``'s layout for a named model."""
    layout = KVLayout.of(payload)
    return namespace_from_fields(
        model_fingerprint=model,
        layers=layout.layers,
        signature=layout.signature,
        block_size=block_size if block_size is not None else payload.num_tokens,
        extra=extra,
    )


def chain_of(num_blocks: int, *, block_size: int = BLOCK_SIZE, first_token: int = 0) -> list[bytes]:
    """Chain hashes of ``num_blocks`` blocks of consecutive token ids."""
    tokens = list(range(first_token, first_token + num_blocks * block_size))
    return hash_block_chain(tokens, block_size)


def array_bytes(array: Any) -> bytes:
    return bytes(memoryview(array))


def assert_same_payload(actual: BlockPayload, expected: BlockPayload) -> None:
    """Equal layout, position and arrays: same dtypes, shapes and bytes."""
    assert isinstance(actual, BlockPayload)
    assert actual.layers == expected.layers
    assert actual.signature == expected.signature
    assert (actual.start, actual.num_tokens) == (expected.start, expected.num_tokens)
    assert len(actual.arrays) == len(expected.arrays)
    for got, want in zip(actual.arrays, expected.arrays):
        if want is None:
            assert got is None
            continue
        assert got is not None and len(got) == len(want)
        for a, b in zip(got, want):
            if b is None:
                assert a is None
                continue
            assert a.dtype == b.dtype and a.shape == b.shape
            assert array_bytes(a) == array_bytes(b)


def forge_start(value: bytes, start: int) -> bytes:
    """``value`` claiming another ``start``, its checksum recomputed: what a
    writer with access to a tier can store, which the checksum cannot catch."""
    import json
    import struct
    import zlib

    _, version, size = struct.unpack_from("<6sHI", value, 0)
    header = json.loads(value[12 : 12 + size])
    header["start"] = start
    encoded = json.dumps(header, separators=(",", ":")).encode()
    body = struct.pack("<6sHI", b"MLXKVB", version, len(encoded)) + encoded + value[12 + size : -4]
    return body + struct.pack("<I", zlib.crc32(body))


_PEAK_RSS_PRELUDE = """
import os, sys, anyio

def peak_kib():
    # This process image's own peak RSS (getrusage's ru_maxrss starts
    # from the parent's peak: Linux keeps it across fork and exec).
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("VmHWM:")).split()[1])
sys.path.insert(0, {tests!r})
from tier_blocks import chain_of, kv_blocks, namespace_of
"""


def peak_rss_script(main: str, **fields: Any) -> str:
    """A script for a fresh process: ``peak_kib()`` (its own peak resident set,
    in KiB) and this module at hand, then ``main`` (an ``async def main()``,
    formatted with ``fields``) run under anyio."""
    from pathlib import Path

    prelude = _PEAK_RSS_PRELUDE.format(tests=str(Path(__file__).parent))
    return prelude + textwrap.dedent(main).format(**fields) + "\nanyio.run(main)\n"
