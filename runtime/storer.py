"""Storing what a generation computed, in a task of its own.

The compute actor hands back what a request computed that is worth caching
(see :class:`~mlxkv.actors.compute.Generate`'s ``to_cache`` stream): each
prefill chunk's full blocks, a mark once the prompt's blocks are all out
(the last chunk's come just after the first token, which does not wait for
them), the vision encoder's features when it ran, and the answer's blocks
as the request finishes. A :class:`RequestStorer` stores them through the
cache client while the generation streams tokens, so neither waits on the
other: the first token is not held back by storing, and a consumer slow to
take its tokens does not hold back the requests that wait for these blocks.
"""

from __future__ import annotations

from array import array
from typing import Optional

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from mlxkv.actors.compute import Event, ImagesEncoded, PromptPublished, Published
from mlxkv.actors.event_log import EventLog
from mlxkv.actors.prefix_index import RequestId
from mlxkv.cache.token_ids import TokenIds
from mlxkv.client import CacheClient
from mlxkv.gate import Gate

__all__ = ["RequestStorer"]


class RequestStorer:
    """Stores one request's published blocks and image features, and drops
    its claims once its prompt's blocks are stored.

    Storing is best effort: when the blocks of a chunk do not all fit (the
    rest of the pool is held), one store keeps the leading ones that fit
    (:meth:`CacheClient.store <mlxkv.client.CacheClient.store>` with
    ``leading``), the others are counted, warned about and not stored,
    storing stops there, and the claims are dropped so that waiters compute
    those blocks themselves.

    Owns: the request's store state (blocks it holds, whether storing goes
    on, what it stored and did not) and the receiving end of its
    ``to_cache`` stream. The generation reads its outcome once :attr:`done`
    is set.

    Invariants:
        - blocks are stored in order, each at most once; once a store falls
          short none follow (a cached chain has no gaps);
        - :attr:`done` is set once the stream has ended and everything it
          carried is handled; :meth:`run` raises nothing but cancellation
          (what went wrong is kept in :attr:`error` for the generation).
    """

    def __init__(
        self,
        client: CacheClient,
        gate: Gate,
        request_id: RequestId,
        prompt_ids: TokenIds,
        *,
        held: int,
        block_size: int,
        images_key: Optional[str],
        cache_salt: Optional[str],
        num_image_tokens: int,
        log: EventLog,
    ) -> None:
        self._client = client
        self._gate = gate
        self._request_id = request_id
        #: The request's tokens as far as they are known here: the prompt,
        #: then the answer as its blocks are published.
        self._tokens = prompt_ids
        self._held = held
        self._block_size = block_size
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
        #: Computed blocks not stored: the pool had no room.
        self.num_not_stored = 0
        #: 1 if storing stopped because the pool had no room, else 0.
        self.gave_up = 0
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
        if not self._storing:
            self.num_not_stored += end - max(self._held, published.start)
            return
        size = self._block_size
        known = len(self._tokens)
        if end * size > known:
            self._tokens = self._tokens + array("I", published.tokens[known - published.start * size :])
        payloads = published.payloads[self._held - published.start :]
        with self._gate.call():
            result = await self._client.store(
                self._request_id, self._tokens[: end * size], payloads, leading=True
            )
        if result.refused is not None:
            # The pool is full of referenced blocks: the leading ones that fit
            # are kept (the chain has no gaps, so nothing after them).
            self._storing = False
            not_stored = len(payloads) - result.num_blocks
            self.num_not_stored += not_stored
            self.gave_up = 1  # it stores no more
            self._log.warning(
                "generation.not_stored",
                blocks=not_stored,
                stored=result.num_blocks,
                error=str(result.refused),
            )
            await self._drop_claims()  # waiters compute the rest themselves
        new = result.num_blocks - result.num_reused
        self.stored_blocks += new
        if new:
            # Blocks of one model are alike in size.
            self.stored_bytes += new * payloads[0].nbytes
        self._held = result.num_held_blocks

    async def _drop_claims(self) -> None:
        """No more of the prompt's blocks will be stored: waiters go on."""
        if self._claims_dropped:
            return
        self._claims_dropped = True
        with self._gate.call():
            await self._client.unclaim(self._request_id)

    async def _store_images(self, encoded: ImagesEncoded) -> None:
        assert self._images_key is not None, "images were encoded for a request without"
        with self._gate.call():
            await self._client.store_images(
                self._images_key,
                encoded.features,
                num_image_tokens=self._num_image_tokens,
                cache_salt=self._cache_salt,
                request_id=self._request_id,
            )
