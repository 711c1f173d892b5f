"""Parent-chained block hashes and the keys they are derived under: where a block is keyed.

A block's hash covers its parent's hash, its own token ids and, for the first
block of a sequence, the sequence's extra keys (tenant salt, image hashes,
adapter names). Two blocks therefore share a hash only if everything before
them, and they themselves, are the same: a hit is always exact, never a match
by content alone.

:class:`ChainKeys` is the one derivation of those keys -- the salt, the
images and the block that holds the first image token -- for every caller:
the runtime (``fetch``, ``generate``), the prefix-index actor and the seed's
:class:`~mlxkv.cache.block_prefix.BlockAwarePrefixCache`, so a prompt keys
alike through either API. The image cache keys its entries by the same
namespace (:meth:`ChainKeys.namespace`).

Hashing works on bytes (``array('I', tokens)``), which is both faster and
unambiguous compared with hashing ``str(tuple(tokens))``. A prompt's chain is
computed once, in one pass: :func:`hash_block_chain` is linear in the prompt.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Any, NewType, Optional, Tuple

import attrs

from mlxkv.cache.errors import InvalidInput

__all__ = ["ROOT_HASH", "BlockHash", "ChainKeys", "compute_block_hash", "hash_block_chain"]

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


@attrs.frozen
class ChainKeys:
    """What a sequence's blocks are keyed under beside their tokens: its namespace.

    Made by :meth:`derive` (the one place the keys are spelled), used by
    :meth:`hash_chain`. ``first`` enters the sequence's first block and so,
    through the chain, every block; ``late`` enters block ``late_block`` and
    namespaces it and every later block but none before it (a prompt's
    images, from the block that holds its first image token: the text before
    them depends on its tokens alone and is shared with any request).

    Attributes:
        first: keys of the whole sequence (salt, caller's extra keys, images
            that key the whole chain).
        late: keys from block ``late_block`` on.
        late_block: where ``late`` enters.

    Invariants:
        ``late`` is empty or ``late_block >= 1`` (keys entering block 0 are
        ``first``'s), so equal namespaces are equal records.
    """

    first: tuple[Any, ...] = ()
    late: tuple[Any, ...] = ()
    late_block: int = 0

    @classmethod
    def derive(
        cls,
        *,
        cache_salt: Optional[Any] = None,
        images_key: Optional[str] = None,
        images_start: Optional[int] = None,
        block_size: int = 1,
        extra_keys: Sequence[Any] = (),
    ) -> ChainKeys:
        """The keys of a sequence with this salt, these images and extra keys.

        Args:
            cache_salt: a tenant namespace: sequences with different salts
                share no block (``("salt", s)``, in the first block).
            images_key: the ordered images' 64-hex key
                (:func:`~mlxkv.cache.mllm.combine_image_keys`), or None.
            images_start: the index of the first image token: the images key
                the blocks from the one that holds it on; None: every block.
            block_size: tokens per block (to find that block).
            extra_keys: further keys of the whole sequence (an adapter's
                name...), after the salt, hashable with a stable ``repr``.

        Returns:
            The namespace; the empty one when nothing is given.
        """
        first: tuple[Any, ...] = () if cache_salt is None else (("salt", cache_salt),)
        if extra_keys:
            first += tuple(extra_keys)
        if images_key is None:
            return cls(first)
        images = (("images", images_key),)
        late_block = 0 if images_start is None else images_start // block_size
        if late_block == 0:
            return cls(first + images)
        return cls(first, images, late_block)

    def hash_chain(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        start_block: int = 0,
        parent_hash: Optional[BlockHash] = None,
    ) -> list[BlockHash]:
        """The hashes of the full blocks of ``token_ids`` under these keys.

        Args:
            token_ids: tokens of the sequence from block ``start_block`` on.
            block_size: tokens per block.
            start_block: the sequence's block that ``token_ids`` starts with.
            parent_hash: the hash of the block before it (None for block 0).

        Returns:
            ``len(token_ids) // block_size`` hashes, in order.

        Raises:
            InvalidInput: bad ``block_size`` or token ids.
        """
        return hash_block_chain(
            token_ids,
            block_size,
            extra_keys=(self.first or None) if parent_hash is None else None,
            parent_hash=parent_hash,
            late_keys=self.late or None,
            late_block=self.late_block - start_block,
        )

    @property
    def salted(self) -> bool:
        """Whether the sequence belongs to a tenant (keyed under a ``cache_salt``)."""
        return any(type(key) is tuple and key[:1] == ("salt",) for key in self.first)

    def entering(self, block: int) -> Optional[tuple[Any, ...]]:
        """The keys that enter block ``block``'s hash beside its tokens and its
        parent's hash (``first`` at block 0, ``late`` at ``late_block``), or
        None where none do."""
        keys = (self.first if block == 0 else ()) + (self.late if block == self.late_block else ())
        return keys or None

    def namespace(self) -> bytes:
        """The whole namespace as bytes, for caches keyed by it rather than by
        a chain (the image cache's entries, per salt and images)."""
        return _extra_bytes(self.first + self.late)
