"""Moved to :mod:`mlxkv.cache.kv_events` (the block pool announces blocks too);
these names keep working from here."""

from mlxkv.cache.kv_events import (  # noqa: F401
    POOL,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventHub,
    KVEventStatistics,
    KVEventSubscription,
)
