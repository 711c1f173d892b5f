"""Storage keys: what a block is stored under in every tier.

``storage_key = SHA-256("mlxkv.storage-key\\0" || namespace digest || chain hash)``.

- It commits to the namespace, so a block of another model, layout, block
  size or format is another key: never a hit.
- It reveals no prompt text: the chain hash already is a one-way digest of
  the tokens (and salt, images), and the key is a digest of that.
- It is 32 bytes; tiers name files and Redis keys by its hex form.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, NewType, Union

from mlxkv.cache.errors import InvalidInput

if TYPE_CHECKING:
    from mlxkv.cache.tiers.namespace import Namespace

__all__ = ["KEY_SIZE", "StorageKey", "storage_key", "storage_keys"]

#: A block's key in the tiers: 32 bytes.
StorageKey = NewType("StorageKey", bytes)

KEY_SIZE = 32

_DOMAIN = b"mlxkv.storage-key\0"


def _hash_bytes(block_hash: Union[bytes, int]) -> bytes:
    # A type tag keeps an int hash and the bytes that spell it apart.
    if isinstance(block_hash, (bytes, bytearray, memoryview)) and len(block_hash):
        return b"b" + bytes(block_hash)
    if type(block_hash) is int:
        return b"i" + str(block_hash).encode()
    raise InvalidInput("block_hash", block_hash, "must be non-empty bytes (a chain hash) or an int")


def storage_key(namespace: Namespace, block_hash: Union[bytes, int]) -> StorageKey:
    """The key of the block with chain hash ``block_hash`` in ``namespace``.

    Args:
        namespace: the namespace the block belongs to.
        block_hash: its parent-chained hash (``BlockHash`` bytes; an int is
            accepted too, and never equals a bytes hash's key).

    Returns:
        32 bytes.

    Raises:
        InvalidInput: ``block_hash`` is neither.
    """
    return StorageKey(hashlib.sha256(_DOMAIN + namespace.digest + _hash_bytes(block_hash)).digest())


def storage_keys(namespace: Namespace, chain: Sequence[Union[bytes, int]]) -> list[StorageKey]:
    """:func:`storage_key` of every hash of ``chain``, in order."""
    return [storage_key(namespace, block_hash) for block_hash in chain]
