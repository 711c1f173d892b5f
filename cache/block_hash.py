"""Parent-chained block hashes: the only key under which a KV block is shared.

A block's hash covers its parent's hash, its own token ids and, for the first
block of a sequence, the sequence's extra keys (tenant salt, image hashes,
adapter names). Two blocks therefore share a hash only if everything before
them, and they themselves, are the same: a hit is always exact, never a match
by content alone.

Hashing works on bytes (``array('I', tokens)``), which is both faster and
unambiguous compared with hashing ``str(tuple(tokens))``. A prompt's chain is
computed once, in one pass: :func:`hash_block_chain` is linear in the prompt.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Any, NewType, Optional, Tuple

from mlxkv.cache.errors import InvalidInput

__all__ = ["ROOT_HASH", "BlockHash", "compute_block_hash", "hash_block_chain"]

#: A full-strength (SHA-256) digest of one block and everything before it.
BlockHash = NewType("BlockHash", bytes)

#: The parent of every sequence's first block.
ROOT_HASH = BlockHash(hashlib.sha256(b"mlxkv-block-root-v1").digest())


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    try:
        return array("I", token_ids).tobytes()
    except (OverflowError, TypeError) as exc:
        raise InvalidInput(
            "token_ids", token_ids, "token ids must be integers in [0, 2**32)"
        ) from exc


def _extra_bytes(extra_keys: Optional[Tuple[Any, ...]]) -> bytes:
    if not extra_keys:
        return b""
    # repr() keeps types apart ('1' vs 1 vs b'1'); the length prefix keeps the
    # boundary between tokens and keys unambiguous.
    encoded = repr(tuple(extra_keys)).encode()
    return len(encoded).to_bytes(8, "little") + encoded


def compute_block_hash(
    parent_hash: Optional[BlockHash],
    token_ids: Sequence[int],
    extra_keys: Optional[Tuple[Any, ...]] = None,
) -> BlockHash:
    """Hash one block given its parent's hash.

    Args:
        parent_hash: the previous block's hash, or ``None`` for a first block.
        token_ids: the block's token ids.
        extra_keys: values that namespace the block (salt, image hashes...).

    Returns:
        A 32-byte digest.

    Raises:
        InvalidInput: a token id is not an integer in ``[0, 2**32)``.
    """
    tokens = _token_bytes(token_ids)
    hasher = hashlib.sha256(parent_hash or ROOT_HASH)
    hasher.update(len(tokens).to_bytes(8, "little"))
    hasher.update(tokens)
    hasher.update(_extra_bytes(extra_keys))
    return BlockHash(hasher.digest())


def hash_block_chain(
    token_ids: Sequence[int],
    block_size: int,
    *,
    extra_keys: Optional[Tuple[Any, ...]] = None,
    parent_hash: Optional[BlockHash] = None,
    late_keys: Optional[Tuple[Any, ...]] = None,
    late_block: int = -1,
) -> list[BlockHash]:
    """Hash every *full* block of ``token_ids``, each chained to the one before.

    ``extra_keys`` enter the first block only; through the chain they reach
    every later block. ``late_keys`` enter block ``late_block`` (counted from
    this call's first block) the same way, so they namespace that block and
    every later one but none before it. A trailing partial block gets no
    hash (it can't be shared: the next token changes it).

    Args:
        token_ids: the sequence.
        block_size: tokens per block, > 0.
        extra_keys: namespace of the whole sequence.
        parent_hash: hash of the block before ``token_ids[0]`` when extending
            an existing chain; ``extra_keys`` then apply to nothing.
        late_keys: namespace of the sequence from block ``late_block`` on.
        late_block: where ``late_keys`` enter; none of this call's blocks
            if negative or past its last.

    Returns:
        ``len(token_ids) // block_size`` hashes, in order.

    Raises:
        InvalidInput: bad ``block_size`` or token ids.
    """
    if not isinstance(block_size, int) or block_size <= 0:
        raise InvalidInput("block_size", block_size, "must be a positive int")
    data = _token_bytes(token_ids)
    width = block_size * 4
    length_prefix = width.to_bytes(8, "little")
    sha256 = hashlib.sha256
    chain: list[BlockHash] = []
    parent = parent_hash or ROOT_HASH
    extra = _extra_bytes(extra_keys) if parent_hash is None else b""
    late_start = late_block * width if late_keys and late_block >= 0 else -1
    for start in range(0, len(data) - width + 1, width):
        if start == late_start:
            extra += _extra_bytes(late_keys)
        # One hashlib call per block: the same bytes compute_block_hash feeds.
        parent = BlockHash(
            sha256(b"".join((parent, length_prefix, data[start : start + width], extra))).digest()
        )
        chain.append(parent)
        extra = b""
    return chain
