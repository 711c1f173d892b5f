"""Actors that own the runtime's state; each is driven by typed messages.

One actor per owned piece of state: :class:`BlockAllocatorActor` (blocks,
references, payloads), :class:`PrefixIndexActor` (hash chains, hints,
in-flight claims, request tables), :class:`ImageCacheActor` (vision
embeddings) and :class:`ComputeActor` (a scheduler over a
:class:`ModelRunner`: the live requests, their prefill queue and decode
batch, on one MLX thread). Each module
holds its actor, its messages and a typed handle; :mod:`mlxkv.actors.actor`
holds the base.
"""

from mlxkv.actors.actor import Actor, ActorFailed, ActorRef, ActorStatistics, Ask, Tell
from mlxkv.actors.allocator import (
    BlockAllocatorActor,
    BlockAllocatorHandle,
    BlockGrant,
    BlockId,
)
from mlxkv.actors.compute import ComputeActor, ComputeFailed, ComputeHandle, ComputeStatistics
from mlxkv.actors.decode_batch import DecodeBatch
from mlxkv.actors.model_info import ModelInfo
from mlxkv.actors.model_runner import ModelRunner, TextRunner
from mlxkv.actors.sampling import Sampling
from mlxkv.actors.sequence import SequenceState
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
    "Ask",
    "BlockAllocatorActor",
    "BlockAllocatorHandle",
    "BlockGrant",
    "BlockId",
    "ComputeActor",
    "ComputeFailed",
    "ComputeHandle",
    "ComputeStatistics",
    "DecodeBatch",
    "ImageCacheActor",
    "ImageCacheHandle",
    "ImageCacheStatistics",
    "ImageEntry",
    "ModelInfo",
    "ModelRunner",
    "PrefixIndexActor",
    "PrefixIndexHandle",
    "PrefixIndexStatistics",
    "RequestId",
    "Sampling",
    "SequenceState",
    "Tell",
    "TextRunner",
]
