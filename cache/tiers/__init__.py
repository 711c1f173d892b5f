"""KV tiers below the block pool: a disk directory and a Redis/Valkey server.

Blocks are immutable and content-addressed: each is stored under a key
derived from its chain hash and a :class:`Namespace` of everything else that
makes its KV differ (:mod:`~mlxkv.cache.tiers.namespace`,
:mod:`~mlxkv.cache.tiers.storage_key`), as one value holding a header, its
arrays and a checksum (:mod:`~mlxkv.cache.tiers.block_format`). Anything that
does not verify is a miss, counted, never wrong KV.

The pieces, one owner each:

- pure and synchronous, like the rest of :mod:`mlxkv.cache`:
  :mod:`~mlxkv.cache.tiers.fingerprint` (model fingerprint, memoized weight
  digests), :mod:`~mlxkv.cache.tiers.kv_layout`,
  :mod:`~mlxkv.cache.tiers.namespace`, :mod:`~mlxkv.cache.tiers.storage_key`,
  :mod:`~mlxkv.cache.tiers.block_format`, :mod:`~mlxkv.cache.tiers.disk_index`
  (LRU bookkeeping), :mod:`~mlxkv.cache.tiers.tier_health` (back-off),
  :mod:`~mlxkv.cache.tiers.tier_url`;
- I/O shells on anyio: :mod:`~mlxkv.cache.tiers.disk_tier`,
  :mod:`~mlxkv.cache.tiers.redis_tier` (both implement
  :class:`~mlxkv.cache.tiers.tier.Tier`), :mod:`~mlxkv.cache.tiers.kv_events`
  and :mod:`~mlxkv.cache.tiers.tier_stack` (chain lookups, write-behind).

The I/O shells are the one place under ``cache/`` that uses anyio, threads
and the file system or network: they were built here, ahead of their wiring
into the pool's lookup and store path, as a self-contained layer. Where they
end up living is the integration's choice; nothing else in ``cache/``
imports them.
"""

from mlxkv.cache.tiers.block_format import (
    FORMAT_VERSION,
    CheckedValue,
    check_value,
    decode_block,
    decode_payload,
    decode_payloads,
    encode_block,
    max_value_size,
)
from mlxkv.cache.tiers.cache_dir import default_fingerprint_memo, default_kv_dir
from mlxkv.cache.tiers.disk_tier import DiskTier
from mlxkv.cache.tiers.errors import CorruptValue, MissingExtra
from mlxkv.cache.tiers.fingerprint import model_fingerprint
from mlxkv.cache.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventHub,
    KVEventStatistics,
    KVEventSubscription,
)
from mlxkv.cache.tiers.kv_layout import KVLayout
from mlxkv.cache.tiers.namespace import (
    SCHEMA_VERSION,
    Namespace,
    namespace_for_model,
    namespace_from_fields,
)
from mlxkv.cache.tiers.redis_tier import RedisTier
from mlxkv.cache.tiers.storage_key import StorageKey, storage_key, storage_keys
from mlxkv.cache.tiers.tier import Tier, TierRemoval, TierStatistics
from mlxkv.cache.tiers.tier_health import TierHealth
from mlxkv.cache.tiers.tier_stack import TierStack, TierStackStatistics
from mlxkv.cache.tiers.tier_url import (
    DiskTierSpec,
    RedisTierSpec,
    TierSpec,
    open_tier,
    parse_tier_url,
    redact_url,
)

__all__ = [
    "FORMAT_VERSION",
    "SCHEMA_VERSION",
    "BlockRemoved",
    "BlockStored",
    "CheckedValue",
    "CorruptValue",
    "DiskTier",
    "DiskTierSpec",
    "KVEvent",
    "KVEventHub",
    "KVEventStatistics",
    "KVEventSubscription",
    "KVLayout",
    "MissingExtra",
    "Namespace",
    "RedisTier",
    "RedisTierSpec",
    "StorageKey",
    "Tier",
    "TierHealth",
    "TierRemoval",
    "TierSpec",
    "TierStack",
    "TierStackStatistics",
    "TierStatistics",
    "check_value",
    "decode_block",
    "decode_payload",
    "decode_payloads",
    "default_fingerprint_memo",
    "default_kv_dir",
    "encode_block",
    "max_value_size",
    "model_fingerprint",
    "namespace_for_model",
    "namespace_from_fields",
    "open_tier",
    "parse_tier_url",
    "redact_url",
    "storage_key",
    "storage_keys",
]
