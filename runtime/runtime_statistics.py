"""What :meth:`~mlxkv.runtime.CacheRuntime.stats` returns: one snapshot of
every actor (:class:`RuntimeStatistics`, readable with ``str()``) and the KV
pool in bytes (:class:`KVMemoryStatistics`). Records only: the runtime
gathers them."""

from __future__ import annotations

from typing import Optional

import attrs

from mlxkv.actors.actor import ActorStatistics
from mlxkv.actors.compute import ComputeStatistics
from mlxkv.actors.image_cache import ImageCacheStatistics
from mlxkv.actors.prefix_index import PrefixIndexStatistics
from mlxkv.cache.pool import PoolStatistics
from mlxkv.cache.tiers.tier_stack import TierStackStatistics
from mlxkv.generation import GenerationStatistics
from mlxkv.units import format_bytes, format_count

__all__ = ["KVMemoryStatistics", "RuntimeStatistics"]


@attrs.frozen(kw_only=True)
class KVMemoryStatistics:
    """The KV block pool in bytes (known once a model is loaded).

    Attributes:
        block_bytes: bytes one block takes on this model.
        pool_bytes: bytes the whole pool can hold (usable blocks x block bytes).
        cached_bytes: bytes of the blocks that hold cached KV now.
        referenced_bytes: bytes of the blocks requests hold now.
        budget: the ``kv_memory`` the pool was sized from, or None if it was
            sized by ``max_blocks``.
    """

    block_bytes: int
    pool_bytes: int
    cached_bytes: int
    referenced_bytes: int
    budget: Optional[int]


@attrs.frozen(kw_only=True)
class RuntimeStatistics:
    """A snapshot of every actor (each consistent; together, approximately).

    ``str()`` gives a readable summary (:meth:`format`).

    Attributes:
        allocator: the block pool.
        index: hints, request tables, hits.
        images: the image cache.
        actors: each actor's counters and mailbox, once per actor.
        num_calls: calls made to the runtime so far.
        num_in_flight: calls in progress, this one excluded.
        compute: the compute actor, or None without a model.
        memory: the pool in bytes, or None without a model.
        generation: what ``generate`` calls did, or None without a model.
        tiers: the KV tiers below the pool (blocks written behind, chain
            lookups, blocks loaded, each tier's counters), or None without
            tiers.
    """

    allocator: PoolStatistics
    index: PrefixIndexStatistics
    images: ImageCacheStatistics
    actors: tuple[ActorStatistics, ...]
    num_calls: int
    num_in_flight: int
    compute: Optional[ComputeStatistics] = None
    memory: Optional[KVMemoryStatistics] = None
    generation: Optional[GenerationStatistics] = None
    tiers: Optional[TierStackStatistics] = None

    def format(self) -> str:
        """A few aligned lines a person can read."""
        pool, index, images = self.allocator, self.index, self.images
        rows = [
            (
                "blocks",
                f"{pool.num_blocks} x {pool.block_size} tokens: {pool.num_referenced} held by"
                f" requests, {pool.num_reusable} cached (reusable), {pool.num_empty} empty",
            ),
            (
                "block traffic",
                f"{pool.num_hits} taken from the cache, {pool.num_stored} stored new,"
                f" {pool.num_reused} found stored already, {pool.num_evictions} evicted",
            ),
            (
                "lookups",
                f"{index.num_lookups} ({index.num_hits} hit, {index.num_misses} missed),"
                f" {format_count(index.num_active_requests, 'request')} open",
            ),
            (
                "images",
                f"{format_count(images.num_entries, 'entry', 'entries')}, {format_bytes(images.num_bytes)},"
                f" {images.num_hits} hit, {images.num_misses} missed",
            ),
        ]
        if self.memory is not None:
            memory = self.memory
            budget = "" if memory.budget is None else f" (budget {format_bytes(memory.budget)})"
            rows.append(
                (
                    "KV memory",
                    f"{format_bytes(memory.cached_bytes)} cached of"
                    f" {format_bytes(memory.pool_bytes)}{budget},"
                    f" {format_bytes(memory.block_bytes)} per block",
                )
            )
        if self.compute is not None:
            compute = self.compute
            rows.append(
                (
                    "compute",
                    f"{compute.num_prefill_tokens} prompt tokens computed,"
                    f" {compute.num_cached_tokens} reused from cache"
                    f" ({format_count(compute.num_kept_cache_reuses, 'request')} took a kept"
                    f" cache), {compute.num_decode_steps} decode steps (mean batch"
                    f" {compute.mean_batch_size:.1f}), {compute.num_live} live",
                )
            )
        if self.generation is not None:
            generation = self.generation
            rows.append(
                (
                    "generations",
                    f"{generation.num_finished} finished, {generation.num_stopped} stopped,"
                    f" {format_count(generation.num_blocks_not_stored, 'block')} not stored"
                    f" (pool full, {format_count(generation.num_requests_not_stored, 'request')}),"
                    f" {format_count(generation.num_cold_fallbacks, 'cold fallback')}",
                )
            )
        if self.tiers is not None:
            tiers = self.tiers
            rows.append(
                (
                    "tiers",
                    f"{format_count(tiers.num_blocks_found, 'block')} loaded"
                    f" ({tiers.num_lookups} lookups, {tiers.lookup_seconds * 1e3:.1f} ms),"
                    f" {tiers.num_queued} written behind"
                    f" ({tiers.num_pending} pending, {tiers.num_queue_dropped} dropped),"
                    f" {tiers.num_timeouts} timeouts: "
                    + ", ".join(f"{tier.name} {tier.summary()}" for tier in tiers.tiers),
                )
            )
        rows.append(
            (
                "mailboxes",
                ", ".join(
                    f"{actor.name} {actor.mailbox.current_buffer_used}/{actor.mailbox.max_buffer_size}"
                    for actor in self.actors
                ),
            )
        )
        rows.append(("calls", f"{self.num_calls} made, {self.num_in_flight} in flight"))
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)

    def __str__(self) -> str:
        return self.format()

