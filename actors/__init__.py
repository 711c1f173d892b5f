"""Actors that own the runtime's state; each is driven by typed messages.

One actor per owned piece of state: :class:`BlockAllocatorActor` (blocks,
references, payloads), :class:`PrefixIndexActor` (hash chains, hints,
request tables), :class:`ImageCacheActor` (vision embeddings) and
:class:`ComputeActor` (the model, its tokenizer and the live request caches,
on one MLX thread). Each module
holds its actor, its messages and a typed handle; :mod:`mlxkv.actors.actor`
holds the base.
"""

from mlxkv.actors.actor import Actor, ActorFailed, ActorRef, ActorStatistics, Ask, Tell
from mlxkv.actors.allocator import (
    AllocatorStatistics,
    BlockAllocatorActor,
    BlockAllocatorHandle,
    BlockGrant,
    BlockId,
)
from mlxkv.actors.compute import (
    ComputeActor,
    ComputeFailed,
    ComputeHandle,
    ComputeStatistics,
    ModelInfo,
    Sampling,
    Step,
)
from mlxkv.actors.image_cache import (
    ImageCacheActor,
    ImageCacheHandle,
    ImageCacheStatistics,
    ImageEntry,
)
from mlxkv.actors.prefix_index import (
    PrefixIndexActor,
    PrefixIndexHandle,
    PrefixIndexStatistics,
    RequestId,
)

__all__ = [
    "Actor",
    "ActorFailed",
    "ActorRef",
    "ActorStatistics",
    "AllocatorStatistics",
    "Ask",
    "BlockAllocatorActor",
    "BlockAllocatorHandle",
    "BlockGrant",
    "BlockId",
    "ComputeActor",
    "ComputeFailed",
    "ComputeHandle",
    "ComputeStatistics",
    "ImageCacheActor",
    "ImageCacheHandle",
    "ImageCacheStatistics",
    "ImageEntry",
    "ModelInfo",
    "PrefixIndexActor",
    "PrefixIndexHandle",
    "PrefixIndexStatistics",
    "RequestId",
    "Sampling",
    "Step",
    "Tell",
]
