"""Storing what a generation computed, in a task of its own.

The compute actor hands back what a request computed that is worth caching
(see :class:`~mlxkv.actors.compute.Generate`'s ``to_cache`` stream): each
prefill chunk's full blocks, a mark once the prompt's blocks are all out
(the last chunk's come just after the first token, which does not wait for
them), the vision encoder's features when it ran, and the answer's blocks
as the request finishes. A :class:`RequestStorer` stores them while the
generation streams tokens, so neither waits on the other: the first token
is not held back by storing, and a consumer slow to take its tokens does
not hold back the requests that wait for these blocks.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Any, Optional

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from mlxkv.actors.compute import Event, ImagesEncoded, PromptPublished, Published
from mlxkv.actors.event_log import EventLog
from mlxkv.cache.errors import OutOfBlocks

if TYPE_CHECKING:
    from mlxkv.runtime import CacheRuntime, StoreResult

__all__ = ["RequestStorer"]


class RequestStorer:
    """Stores one request's published blocks and image features, and drops
    its claims once its prompt's blocks are stored.

    Storing is best effort: when the blocks of a chunk do not all fit
    (``OutOfBlocks``: the rest of the pool is held), the leading ones that fit
    are stored, the others counted, warned about and not stored, storing
    stops there, and the claims are dropped so that waiters compute those
    blocks themselves.

    Owns: the request's store state (blocks it holds, whether storing goes
    on, what it stored) and the receiving end of its ``to_cache`` stream.

    Invariants:
        - blocks are stored in order, each at most once; once a store fails
          none follow (a cached chain has no gaps);
        - :attr:`done` is set once the stream has ended and everything it
          carried is handled; :meth:`run` raises nothing but cancellation
          (what went wrong is kept in :attr:`error` for the generation).
    """

    def __init__(
        self,
        runtime: CacheRuntime,
        request_id: str,
        prompt_ids: array,
        *,
        held: int,
        images_key: Optional[str],
        cache_salt: Optional[str],
        num_image_tokens: int,
        log: EventLog,
    ) -> None:
        self._runtime = runtime
        self._request_id = request_id
        #: The request's tokens as far as they are known here: the prompt,
        #: then the answer as its blocks are published.
        self._tokens = prompt_ids
        self._held = held
        self._images_key = images_key
        self._cache_salt = cache_salt
        self._num_image_tokens = num_image_tokens
        self._log = log
        self._storing = True
        self._claims_dropped = False
        #: New blocks stored (others' copies of a block are not counted).
        self.stored_blocks = 0
        #: Bytes of KV those blocks hold.
        self.stored_bytes = 0
        #: Set once the stream has ended and everything on it is handled.
        self.done = anyio.Event()
        #: What stopped storing, other than blocks that do not fit.
        self.error: Optional[Exception] = None

    async def run(self, stream: MemoryObjectReceiveStream[Event]) -> None:
        """Handle ``stream`` until it ends (the request ended), then set :attr:`done`."""
        try:
            with stream:
                async for event in stream:
                    if isinstance(event, Published):
                        await self._store(event)
                    elif isinstance(event, PromptPublished):
                        await self._drop_claims()
                    else:
                        assert isinstance(event, ImagesEncoded), f"unexpected {event!r} to cache"
                        await self._store_images(event)
        except Exception as error:
            self.error = error
        finally:
            self.done.set()

    async def _store(self, published: Published) -> None:
        """Store the published blocks beyond those the request holds."""
        end = published.start + len(published.payloads)
        if end <= self._held:
            return
        runtime = self._runtime
        if not self._storing:
            runtime._generation_counts["blocks_not_stored"] += end - max(self._held, published.start)
            return
        block_size = runtime.config.block_size
        known = len(self._tokens)
        if end * block_size > known:
            self._tokens = self._tokens + array("I", published.tokens[known - published.start * block_size :])
        payloads = published.payloads[self._held - published.start :]
        try:
            result = await runtime.store(self._request_id, self._tokens[: end * block_size], payloads)
        except OutOfBlocks as error:
            # The pool is full of referenced blocks: keep the leading ones
            # that fit (the chain has no gaps, so nothing after them).
            self._storing = False
            result = await self._store_leading(payloads, error.available)
            not_stored = len(payloads) - (0 if result is None else result.num_blocks)
            runtime._generation_counts["blocks_not_stored"] += not_stored
            runtime._generation_counts["requests_not_stored"] += 1  # it stores no more
            self._log.warning(
                "generation.not_stored",
                blocks=not_stored,
                stored=len(payloads) - not_stored,
                error=str(error),
            )
            await self._drop_claims()  # waiters compute the rest themselves
            if result is None:
                return
        new = result.num_blocks - result.num_reused
        self.stored_blocks += new
        # Blocks of one model are alike in size.
        self.stored_bytes += new * payloads[0].nbytes
        self._held = result.num_held_blocks

    async def _store_leading(self, payloads: tuple[Any, ...], available: int) -> Optional[StoreResult]:
        """Store the first ``available`` of ``payloads`` (at most that many are
        new, so they fit unless others took the room meanwhile); None if none."""
        count = min(available, len(payloads))
        if count <= 0:
            return None
        end = (self._held + count) * self._runtime.config.block_size
        try:
            return await self._runtime.store(self._request_id, self._tokens[:end], payloads[:count])
        except OutOfBlocks:
            return None

    async def _drop_claims(self) -> None:
        """No more of the prompt's blocks will be stored: waiters go on."""
        if self._claims_dropped:
            return
        self._claims_dropped = True
        with self._runtime._call():
            await self._runtime._index.unclaim(self._request_id)

    async def _store_images(self, encoded: ImagesEncoded) -> None:
        assert self._images_key is not None, "images were encoded for a request without"
        with self._runtime._call():
            await self._runtime._images.store(
                self._images_key,
                encoded.features,
                num_image_tokens=self._num_image_tokens,
                cache_salt=self._cache_salt,
                request_id=self._request_id,
            )
