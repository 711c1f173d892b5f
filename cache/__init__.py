"""The synchronous cache layer: the seed-compatible API of vllm-mlx 0.6.0's
``paged_cache`` (:mod:`mlxkv.cache.paged`), ``prefix_cache``
(:mod:`mlxkv.cache.prefix`) and ``mllm_cache`` (:mod:`mlxkv.cache.mllm`), plus
the pure pieces the actors build on: chained block hashes
(:mod:`~mlxkv.cache.block_hash`), KV-state slicing and reconstruction
(:mod:`~mlxkv.cache.kv_state`) and typed errors (:mod:`~mlxkv.cache.errors`).

Every class here has exactly one owner at a time and takes no locks; nothing
here knows about async code, actors or logging configuration.
"""

from mlxkv.cache.block_hash import BlockHash, compute_block_hash, hash_block_chain
from mlxkv.cache.errors import (
    CacheError,
    DoubleFree,
    DuplicateRequest,
    InvalidInput,
    InvariantViolation,
    OutOfBlocks,
    UnknownRequest,
)
from mlxkv.cache.kv_state import NotReconstructable
from mlxkv.cache.mllm import (
    MLLMCacheStats,
    MLLMPrefixCacheEntry,
    MLLMPrefixCacheManager,
    compute_image_hash,
    compute_images_hash,
)
from mlxkv.cache.paged import (
    BlockHashToBlockMap,
    BlockTable,
    CacheBlock,
    CacheStats,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    PagedCacheManager,
)
from mlxkv.cache.prefix import (
    BlockAwarePrefixCache,
    BlockCacheEntry,
    CacheEntry,
    PrefixCacheManager,
    PrefixCacheStats,
)

__all__ = [
    "BlockAwarePrefixCache",
    "BlockCacheEntry",
    "BlockHash",
    "BlockHashToBlockMap",
    "BlockTable",
    "CacheBlock",
    "CacheEntry",
    "CacheError",
    "CacheStats",
    "DoubleFree",
    "DuplicateRequest",
    "FreeKVCacheBlockQueue",
    "InvalidInput",
    "InvariantViolation",
    "KVCacheBlock",
    "MLLMCacheStats",
    "MLLMPrefixCacheEntry",
    "MLLMPrefixCacheManager",
    "NotReconstructable",
    "OutOfBlocks",
    "PagedCacheManager",
    "PrefixCacheManager",
    "PrefixCacheStats",
    "UnknownRequest",
    "compute_block_hash",
    "compute_images_hash",
    "compute_image_hash",
    "hash_block_chain",
]
