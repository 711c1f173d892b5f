"""The synchronous cache layer: seed-compatible API of vllm-mlx 0.6.0's
``paged_cache``, ``prefix_cache`` and ``mllm_cache``, plus the pure helpers
the actors build on. Nothing here knows about async, actors or logging set-up.
"""

from mlxkv.cache.block_hash import BlockHash, compute_block_hash, hash_block_chain
from mlxkv.cache.errors import (
    CacheError,
    DoubleFree,
    DuplicateRequest,
    InvalidInput,
    OutOfBlocks,
    UnknownRequest,
)

__all__ = [
    "BlockHash",
    "CacheError",
    "DoubleFree",
    "DuplicateRequest",
    "InvalidInput",
    "OutOfBlocks",
    "UnknownRequest",
    "compute_block_hash",
    "hash_block_chain",
]
