"""Real blocks for the tier tests: mlx-lm caches with random KV, cut by ``slice_blocks``."""

from __future__ import annotations

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
