"""Every error mlxkv raises on purpose; all subclass :class:`CacheError`.

The cache layer's errors are re-exported here, next to the runtime's own:

- :class:`InvalidInput` -- an argument was rejected before any state changed.
- :class:`OutOfBlocks` -- not enough free blocks; says what was asked
  (``requested``) and what could be had (``available``).
- :class:`UnknownRequest` -- the request id holds nothing here.
- :class:`DuplicateRequest` -- the request id is already active.
- :class:`DoubleFree` -- a block was released by someone holding no reference.
- :class:`ModelLoadError` -- the model given to the runtime cannot be loaded;
  names the path and what is wrong (raised by ``async with``, before any
  actor runs).
- :class:`ComputeFailed` -- a model call of this request raised (the
  request fails; others go on).
- :class:`NotReconstructable` -- cached KV that cannot be rebuilt exactly
  (the cache layer's; generation falls back to computing it).
- :class:`ActorFailed` -- an actor stopped while a call waited on it (the
  runtime reports it as :class:`RuntimeClosed`, with this as ``__cause__``).
- :class:`RuntimeClosed` -- the runtime is not running: not entered yet,
  closing, closed, or stopped by an actor's crash (then ``cause`` is that
  crash).
"""

from __future__ import annotations

from typing import Optional

from mlxkv.actors.actor import ActorFailed
from mlxkv.actors.compute import ComputeFailed
from mlxkv.actors.model_source import ModelLoadError
from mlxkv.cache.kv_state import NotReconstructable
from mlxkv.cache.errors import (
    CacheError,
    DoubleFree,
    DuplicateRequest,
    InvalidInput,
    OutOfBlocks,
    UnknownRequest,
)

__all__ = [
    "ActorFailed",
    "CacheError",
    "ComputeFailed",
    "DoubleFree",
    "DuplicateRequest",
    "InvalidInput",
    "ModelLoadError",
    "NotReconstructable",
    "OutOfBlocks",
    "RuntimeClosed",
    "UnknownRequest",
]


class RuntimeClosed(CacheError):
    """The runtime cannot serve the call: it is not running.

    Attributes:
        reason: ``"not started"``, ``"closed"`` or ``"failed"``.
        cause: the exception that crashed an actor, when ``reason`` is
            ``"failed"``.
    """

    def __init__(self, reason: str, cause: Optional[BaseException] = None) -> None:
        self.reason = reason
        self.cause = cause
        detail = "" if cause is None else f": an actor crashed with {type(cause).__name__}: {cause}"
        super().__init__(f"the cache runtime is {reason}{detail}")
