"""mlxkv: a KV-cache runtime for LLM inference on MLX.

Concurrent requests that share a prompt prefix reuse the KV state an earlier
request computed. :class:`CacheRuntime` is the async entry point
(``CacheRuntime(model=PATH)`` and :meth:`CacheRuntime.generate` for
generation); the
synchronous, seed-compatible cache layer lives in :mod:`mlxkv.cache`, the
actors in :mod:`mlxkv.actors`.
"""

__version__ = "0.1.0"

from mlxkv.errors import (
    ActorFailed,
    CacheError,
    ComputeFailed,
    DoubleFree,
    DuplicateRequest,
    InvalidInput,
    ModelLoadError,
    NotReconstructable,
    OutOfBlocks,
    RuntimeClosed,
    UnknownRequest,
)
from mlxkv.actors.token_logprobs import TokenLogprob
from mlxkv.generation import GeneratedToken, Generation, GenerationReport
from mlxkv.json_output import JsonText
from mlxkv.runtime import CacheRuntime, FetchResult, RequestHandle, StoreResult
from mlxkv.runtime_config import RuntimeConfig
from mlxkv.runtime_statistics import KVMemoryStatistics, RuntimeStatistics

__all__ = [
    "ActorFailed",
    "CacheError",
    "CacheRuntime",
    "ComputeFailed",
    "DoubleFree",
    "DuplicateRequest",
    "FetchResult",
    "GeneratedToken",
    "Generation",
    "GenerationReport",
    "InvalidInput",
    "JsonText",
    "KVMemoryStatistics",
    "ModelLoadError",
    "NotReconstructable",
    "OutOfBlocks",
    "RequestHandle",
    "RuntimeClosed",
    "RuntimeConfig",
    "RuntimeStatistics",
    "StoreResult",
    "TokenLogprob",
    "UnknownRequest",
    "__version__",
]
