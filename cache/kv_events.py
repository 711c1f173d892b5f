"""KV events: blocks stored in and removed from the block pool and the tiers,
broadcast to subscribers.

Events are plain frozen records (after vLLM's ``BlockStored`` /
``BlockRemoved``), numbered in publication order by ``seq``. Each names
where the block is: :data:`POOL`, the runtime's block pool (what the model
reads from), or a tier by its name. A block the pool stores is announced
with its tokens and the keys its hash was derived under beside them, so a
subscriber (a prefix-aware router) can key it by the tokens it sees. A
:class:`KVEventHub` hands each one to every subscriber through the
subscriber's own bounded buffer: publishing never waits. A subscriber whose
buffer is full loses that event, and its ``num_lost`` says how many it lost
(gaps in ``seq`` say where); it never slows the writer that published.
"""

from __future__ import annotations

import math
from types import TracebackType
from typing import TYPE_CHECKING, Any, Optional, Union

import anyio
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from mlxkv.cache.errors import InvalidInput

if TYPE_CHECKING:  # the tiers import this module: types only
    from mlxkv.cache.tiers.storage_key import StorageKey
    from mlxkv.cache.tiers.tier import RemovalReason

__all__ = [
    "POOL",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventHub",
    "KVEventStatistics",
    "KVEventSubscription",
]


#: Where a block the runtime's block pool holds is (``tier`` of its events).
POOL = "pool"


@attrs.frozen(kw_only=True)
class BlockStored:
    """The block pool or a tier now holds a block.

    Attributes:
        seq: publication number (0, 1, 2, ... per hub).
        tier: :data:`POOL`, or the tier's name.
        block_hash: the block's chain hash.
        parent_hash: the previous block's chain hash, None for a first block
            (or when the writer did not say).
        block_size: tokens per block.
        key: its storage key in the tier (None for the pool).
        token_ids: the block's tokens, when the writer knew them.
        extra_keys: the keys that entered this block's hash beside its
            tokens and its parent's hash (the sequence's first block: its
            salt, images and extra keys; the block holding its first image
            token: its images), None for a block of tokens alone.
        salted: whether the block belongs to a tenant (its chain is keyed
            under a ``cache_salt``).
    """

    seq: int
    tier: str
    block_hash: bytes
    parent_hash: Optional[bytes]
    block_size: int
    key: Optional[StorageKey] = None
    token_ids: Optional[tuple[int, ...]] = None
    extra_keys: Optional[tuple[Any, ...]] = None
    salted: bool = False


@attrs.frozen(kw_only=True)
class BlockRemoved:
    """The block pool or a tier no longer holds a block.

    Attributes:
        seq: publication number.
        tier: :data:`POOL`, or the tier's name.
        reason: ``"evicted"`` (budget), ``"corrupt"`` (did not verify) or
            ``"deleted"`` (on request).
        block_size: tokens per block.
        key: its storage key in the tier (None for the pool).
        block_hash: its chain hash (the pool's removals; None for a tier's).

    A tier knows a value by its storage key only (the key is a one-way
    digest): match a tier's removals to its stores by ``key``, the pool's
    by ``block_hash``.
    """

    seq: int
    tier: str
    reason: RemovalReason
    block_size: int
    key: Optional[StorageKey] = None
    block_hash: Optional[bytes] = None


KVEvent = Union[BlockStored, BlockRemoved]


@attrs.frozen
class KVEventStatistics:
    """A hub's counters: events published, subscribers now, events lost by
    subscribers whose buffers were full (all subscribers, ever)."""

    num_published: int
    num_subscribers: int
    num_lost: int


class KVEventSubscription:
    """One subscriber's events, in order: ``async for event in subscription``.

    Iteration ends when the hub closes. ``close()`` (or leaving ``with``)
    unsubscribes.

    Owns: the receiving end of its buffer. ``num_lost`` is written by the
    hub only.
    """

    def __init__(self, receive: MemoryObjectReceiveStream[KVEvent]) -> None:
        self._receive = receive
        self.num_lost = 0

    def __aiter__(self) -> KVEventSubscription:
        return self

    async def __anext__(self) -> KVEvent:
        try:
            return await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StopAsyncIteration from None

    def receive_nowait(self) -> KVEvent:
        """The next buffered event.

        Raises:
            anyio.WouldBlock: none is buffered.
            anyio.EndOfStream: the hub closed and every event was taken.
        """
        return self._receive.receive_nowait()

    def close(self) -> None:
        """Unsubscribe; buffered events are discarded."""
        self._receive.close()

    def __enter__(self) -> KVEventSubscription:
        return self

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        self.close()


class KVEventHub:
    """Numbers events and broadcasts them to subscribers without ever waiting.

    Owns: the sending ends of every subscriber's buffer and the sequence
    counter. Used on the event loop only.

    Invariants:
        - ``seq`` values are 0, 1, 2, ... in publication order;
        - each subscriber receives a subsequence of them, in order, and
          ``num_lost`` counts exactly the ones it missed while subscribed.
    """

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._subscribers: list[tuple[MemoryObjectSendStream[KVEvent], KVEventSubscription]] = []
        self._seq = 0
        self._num_lost_by_gone = 0
        self._closed = False

    def subscribe(self, buffer: int = 1024) -> KVEventSubscription:
        """A new subscription, receiving every event published from now on.

        Args:
            buffer: events it holds before it starts losing them (>= 1, or
                ``math.inf``, which never loses and is unbounded).

        Raises:
            InvalidInput: a bad buffer size.
        """
        if buffer != math.inf and (type(buffer) is not int or buffer < 1):
            raise InvalidInput("buffer", buffer, "must be an int >= 1 or math.inf")
        send, receive = anyio.create_memory_object_stream[KVEvent](buffer)
        subscription = KVEventSubscription(receive)
        if self._closed:
            send.close()
        else:
            self._subscribers.append((send, subscription))
        return subscription

    @property
    def num_subscribers(self) -> int:
        """Subscribers now (a publisher with none may skip building events)."""
        return len(self._subscribers)

    def stored(self, *, tier: str, block_hash: bytes, parent_hash: Optional[bytes], **fields: Any) -> None:
        """Publish a :class:`BlockStored` (``fields``: its optional attributes)."""
        self._publish(
            BlockStored(
                seq=self._seq,
                tier=tier,
                block_hash=block_hash,
                parent_hash=parent_hash,
                block_size=self._block_size,
                **fields,
            )
        )

    def removed(
        self,
        *,
        tier: str,
        reason: RemovalReason,
        key: Optional[StorageKey] = None,
        block_hash: Optional[bytes] = None,
    ) -> None:
        """Publish a :class:`BlockRemoved`."""
        self._publish(
            BlockRemoved(
                seq=self._seq, tier=tier, reason=reason, block_size=self._block_size, key=key, block_hash=block_hash
            )
        )

    def close(self) -> None:
        """End every subscription's iteration (after its buffered events)."""
        self._closed = True
        for send, subscription in self._subscribers:
            self._num_lost_by_gone += subscription.num_lost
            send.close()
        self._subscribers.clear()

    def statistics(self) -> KVEventStatistics:
        """The counters now."""
        return KVEventStatistics(
            num_published=self._seq,
            num_subscribers=self.num_subscribers,
            num_lost=self._num_lost_by_gone + sum(s.num_lost for _, s in self._subscribers),
        )

    def _publish(self, event: KVEvent) -> None:
        self._seq += 1
        gone = []
        for send, subscription in self._subscribers:
            try:
                send.send_nowait(event)
            except anyio.WouldBlock:
                subscription.num_lost += 1
            except anyio.BrokenResourceError:  # the subscriber closed
                gone.append((send, subscription))
        for entry in gone:
            self._subscribers.remove(entry)
            self._num_lost_by_gone += entry[1].num_lost
            entry[0].close()
